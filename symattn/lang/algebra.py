"""Products and sums taken apart and put together: the one toolkit every layer uses.

``factors`` and ``terms`` split; ``product`` and ``total`` build. The builders
canonicalise only the node they make, never their operands: SymPy's operators
(*, +) and a deep ``doit()`` re-walk a shared (DAG) operand as a tree, which takes
exponential time on deep or shared graphs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import (
    HadamardPower,
    HadamardProduct,
    Identity,
    MatAdd,
    MatMul,
    MatPow,
    OneMatrix,
    Transpose,
    ZeroMatrix,
)
from sympy.matrices.expressions.hadamard import canonicalize as hadamard_canonical
from sympy.matrices.expressions.special import GenericIdentity

from symattn.lang.graph import bottom_up, intern, memo_table, sort_key, sort_keys_of


def factors(expr: Basic) -> tuple[Basic, list[Basic]]:
    """(c, [F₁, …, F_k]) with expr = c F₁ ⋯ F_k.

    For a product: c is the product of its scalar arguments and F₁ … F_k its matrix
    arguments in order (a nested product stays one factor). Anything else is (1, [expr]).
    """
    if isinstance(expr, MatMul):
        scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
        return sp.Mul(*scalars), [a for a in expr.args if isinstance(a, MatrixExpr)]
    return sp.Integer(1), [expr]


def terms(expr: Basic) -> tuple[Basic, ...]:
    """(T₁, …, T_k) with expr = T₁ + … + T_k: a sum's arguments (a nested sum stays one term), or (expr,)."""
    return expr.args if isinstance(expr, MatAdd) else (expr,)


_PRODUCTS: dict[tuple, Basic] = {}  # canonical products by their parts: SymPy's canonicalisation is the costly step
_PRODUCTS_MAX = 1 << 16


def product(*parts: Basic, canonical: bool = True, flatten: bool = False, drop_units: bool = False) -> Basic:
    """The product of scalars and matrices ``parts`` (left to right); see ``_product``. Hash-consed (``intern``),
    a canonical product of the same parts built once."""
    if not canonical:
        return intern(_product(*parts, canonical=False, flatten=flatten, drop_units=drop_units))
    found = _PRODUCTS.get(parts)
    if found is None:
        if len(_PRODUCTS) > _PRODUCTS_MAX:
            _PRODUCTS.clear()
        found = _PRODUCTS[parts] = intern(_product(*parts))
    return found


def _product(*parts: Basic, canonical: bool = True, flatten: bool = False, drop_units: bool = False) -> Basic:
    """The product of scalars and matrices ``parts`` (left to right).

    canonical=True: SymPy's canonical product of this node only (``doit(deep=False)``:
    scalars multiplied and put first, nested products flattened, identities and zeros
    resolved), and c (A + B) = c A + c B for a rational c, as SymPy's operators do.
    Factors that are canonical as they stand (``_canonical_as_is``) are put together without
    SymPy's rules (the same node, at a fraction of the cost).

    canonical=False: the parts as given: the scalars multiplied into one leading
    coefficient (left out when it is 1), the matrices in order, a lone matrix with
    coefficient 1 returned bare, nothing evaluated. ``flatten`` first splices the
    factors of a product among the parts into the new one (one level);
    ``drop_units`` resolves zeros (c = 0 or a zero factor gives a zero matrix) and
    drops identity factors (all but one, if every factor is an identity).
    """
    mats = [f for f in parts if isinstance(f, MatrixExpr)]
    coeff = sp.Mul(*(f for f in parts if not isinstance(f, MatrixExpr)))
    if canonical:
        if len(mats) == 1 and isinstance(mats[0], MatAdd) and coeff.is_Rational and coeff != 1:
            return MatAdd(*(product(coeff, term) for term in mats[0].args))
        if _canonical_as_is(coeff, mats):
            return _product(coeff, *mats, canonical=False)
        return MatMul(*parts).doit(deep=False)
    if flatten:
        flat: list[Basic] = []
        for f in mats:
            c, inner = factors(f) if isinstance(f, MatMul) else (sp.Integer(1), [f])
            coeff, flat = coeff * c, [*flat, *inner]
        mats = flat
    if drop_units:
        if coeff == 0 or any(isinstance(f, ZeroMatrix) for f in mats):
            return ZeroMatrix(mats[0].shape[0], mats[-1].shape[1])
        mats = [f for f in mats if not isinstance(f, Identity)] or mats[:1]
    if coeff == 1 and len(mats) == 1:
        return mats[0]
    if _chained(coeff, mats):  # put together as given: SymPy's constructor would only sympify and validate them
        return Basic.__new__(MatMul, *([coeff] * (coeff != 1)), *mats)
    return MatMul(coeff, *mats) if coeff != 1 else MatMul(*mats)  # SymPy's ShapeError, if it is one


# factors SymPy's canonical product would resolve, flatten or merge (``sympy.matrices.expressions.matmul.rules``)
_RESOLVED = (MatMul, Identity, ZeroMatrix, MatPow, sp.MatrixBase, sp.Inverse, sp.PermutationMatrix, GenericIdentity)


def _chained(coeff: Basic, mats: list[Basic]) -> bool:
    """Matrices whose shapes chain as they stand (each one's columns the next one's rows), a commutative c."""
    if not mats or not coeff.is_commutative or any(isinstance(m, GenericIdentity) for m in mats):
        return False
    return all(a.shape[1] == b.shape[0] for a, b in itertools.pairwise(mats))


def _canonical_as_is(coeff: Basic, mats: list[Basic]) -> bool:
    """Is c F₁ ⋯ F_k canonical as it stands: no factor SymPy resolves, no two ones blocks or equal square factors
    side by side, c nonzero? (Then SymPy's canonicalisation, the costly step, would only put c in front.)"""
    if not _chained(coeff, mats) or coeff == 0 or any(isinstance(m, _RESOLVED) for m in mats):
        return False
    if any(isinstance(m, OneMatrix) and m.shape == (1, 1) for m in mats):  # 𝟏_{1×1} is an identity
        return False
    for a, b in itertools.pairwise(mats):
        if (isinstance(a, OneMatrix) and isinstance(b, OneMatrix)) or (a == b and a.is_square is not False):
            return False
    return True


def total(*parts: Basic, canonical: bool = True) -> Basic:
    """The sum of the matrices ``parts``; see ``_total``. Hash-consed (``intern``)."""
    return intern(_total(*parts, canonical=canonical))


def _total(*parts: Basic, canonical: bool = True) -> Basic:
    """The sum of the matrices ``parts``.

    canonical=True: sums among the parts spliced in (one level), zero matrices
    dropped, like terms collected (c₁ M + c₂ M = (c₁ + c₂) M, a zero total dropped),
    the terms sorted by ``sympy.default_sort_key``; one term is returned bare, none a
    zero matrix of the first part's shape. This is SymPy's canonical sum without its
    deep re-canonicalisation of the collected terms.

    canonical=False: the parts as given, one part returned bare.
    """
    if not canonical:
        return parts[0] if len(parts) == 1 else MatAdd(*parts)
    coefficients: dict[Basic, Basic] = {}
    for part in parts:
        for t in terms(part):
            if isinstance(t, ZeroMatrix):
                continue
            coeff, mats = factors(t)
            mat = product(*mats, canonical=False)
            coefficients[mat] = coefficients.get(mat, 0) + coeff
    args = [mat if c == 1 else product(c, mat) for mat, c in coefficients.items() if c != 0]
    if not args:
        return ZeroMatrix(*parts[0].shape)
    if len(args) == 1:
        return args[0]
    args.sort(key=sort_key)
    if all(a.shape == args[0].shape for a in args):  # SymPy's constructor would only validate them again
        return Basic.__new__(MatAdd, *args)
    return MatAdd(*args)  # SymPy's ShapeError


def hadamard_product(*parts: Basic) -> Basic:
    """Entrywise product, canonical (a c𝟏𝟏ᵀ factor taken out as c, flattened, sorted, X ⊙ X becomes X^{∘2});
    the factors' sort keys computed leaves first (SymPy's own recurse as deep as the factors are)."""
    if any(isinstance(part, ZeroMatrix) for part in parts):  # X ⊙ 0 = 0 (step′, ReLU″)
        return ZeroMatrix(*parts[0].shape)
    coeff, rest = sp.Integer(1), []
    for part in parts:  # X ⊙ c𝟏𝟏ᵀ = c X
        c, mats = factors(part)
        if len(mats) == 1 and isinstance(mats[0], OneMatrix):
            coeff *= c
        else:
            rest.append(part)
    if len(rest) < len(parts):
        body = hadamard_product(*rest) if rest else OneMatrix(*parts[0].shape)
        return body if coeff == 1 else product(coeff, body)
    if len(parts) == 1:
        return parts[0]
    with sort_keys_of(*parts):
        return intern(hadamard_canonical(HadamardProduct(*parts)))


_TRANSPOSED: dict[Basic, Basic] = memo_table({})  # a shared (DAG) cotangent: transposed once per distinct node
_TRANSPOSED_MAX = 1 << 16


def transpose(a: Basic) -> Basic:
    """aᵀ pushed through products, sums and entrywise nodes: (AB)ᵀ = BᵀAᵀ, (A + B)ᵀ = Aᵀ + Bᵀ, (Aᵀ)ᵀ = A.

    Walked on an explicit stack, each distinct subexpression once: a 200-deep chain is transposed
    without recursion.
    """
    return bottom_up(a, _TRANSPOSED, _pushed_through, _transposed_node, _TRANSPOSED_MAX)


def _pushed_through(a: Basic) -> Sequence[Basic]:
    """The parts of a that aᵀ transposes in turn (none: a's transpose is Transpose(a))."""
    if isinstance(a, MatMul):
        return factors(a)[1]
    if isinstance(a, (MatAdd, HadamardProduct)):
        return a.args
    if isinstance(a, (HadamardPower, MatPow)):
        return (a.args[0],)
    return ()


def _transposed_node(a: Basic, t: dict[Basic, Basic]) -> Basic:
    """aᵀ from its parts' transposes t (see _pushed_through)."""
    if isinstance(a, MatMul):
        coeff, mats = factors(a)
        return product(coeff, *(t[m] for m in reversed(mats)))
    if isinstance(a, MatAdd):
        if any(isinstance(x, MatAdd) for x in a.args):  # a sum kept as one term (Y₁ in Y₁ + P₂ Y₁ W) stays one
            return intern(MatAdd(*(t[x] for x in a.args)))
        return total(*(t[x] for x in a.args))
    if isinstance(a, HadamardProduct):
        return intern(HadamardProduct(*(t[f] for f in a.args)))
    if isinstance(a, (HadamardPower, MatPow)):
        return intern(type(a)(t[a.args[0]], a.args[1]))
    return intern(Transpose(a).doit(deep=False))


def transposed_factors(mats: Iterable[Basic]) -> list[Basic]:
    """[F_kᵀ, …, F₁ᵀ] for [F₁, …, F_k]: the factors of (F₁ ⋯ F_k)ᵀ."""
    return [transpose(m) for m in reversed(list(mats))]
