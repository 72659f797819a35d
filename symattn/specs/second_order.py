"""The second-order spec of a spec: the scalar whose gradients are the double backward.

For a spec Y = F(x_1, …, x_k) with output cotangent G, the first closed forms are the
gradients g_i(x, G) = ∂ tr(Gᵀ Y)/∂x_i. Given directions V_i (cotangents of the g_i, or
the direction of a Hessian-vector product), the scalar

    f₂ = Σ_i tr(V_iᵀ g_i(x, G)) = Σ_i 𝟏ᵀ (V_i ⊙ g_i) 𝟏

has ∂f₂/∂x_j = Σ_i V_iᵀ-weighted second derivatives (the Hessian of tr(Gᵀ Y) applied to V)
and ∂f₂/∂G = the Jacobian-vector product of F along V. So f₂ is an ordinary spec (inputs:
x, G and the V_i; output 1 × 1) and the whole pipeline (derive, schedule, simplify, print)
gives the double backward in closed form. The V_i are inputs whose own gradients (the g_i)
are not asked for. A trainable scalar τ's direction is a scalar v_τ, and its term v_τ ∂f/∂τ, the
gradient written as the 1 × 1 sum of entries it is (``autodiff.scalars.as_matrix``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixSymbol, OneMatrix
from sympy.matrices.expressions import MatMul, Transpose

from symattn.autodiff.grad import backward
from symattn.autodiff.scalars import as_matrix
from symattn.errors import SymattnError
from symattn.lang.algebra import factors, product, total
from symattn.lang.graph import children, intern, postorder, rebuilt
from symattn.lang.naming.names import Names, fresh_name
from symattn.lang.ops import hadamard
from symattn.specs.spec import Spec
from symattn.specs.validate import is_identifier

__all__ = ["SecondOrder", "inner", "second_order_spec"]

COTANGENT = "G_out"  # the first cotangent G, an input of f₂ (G itself is reserved)
DIRECTION = "{}_v"  # the direction V_i of input x_i: W_Q_v (a weight's direction is a weight: no batch axes)


@dataclass(frozen=True)
class SecondOrder:
    """f₂'s spec and how its inputs relate to the first spec's.

    ``directions``: first input name → the name of its direction V_i; ``cotangent``: G's name in f₂.
    """

    spec: Spec
    first: Spec
    cotangent: str
    directions: tuple[tuple[str, str], ...]

    @property
    def direction_names(self) -> frozenset[str]:
        return frozenset(v for _, v in self.directions)


def inner(v: Basic, g: Basic) -> sp.MatrixExpr:
    """tr(Vᵀ g) as a 1 × 1 matrix: 𝟏ᵀ (V ⊙ g) 𝟏; v·g for a trainable scalar's direction v (g is 1 × 1)."""
    if not isinstance(v, MatrixSymbol):
        return product(v, g)
    rows, cols = v.shape
    return product(OneMatrix(1, rows), hadamard(v, g), OneMatrix(cols, 1))  # SymPy's * would re-walk g deep


def nested(s: Spec) -> tuple[list[tuple[str, Basic]], Basic]:
    """The intermediates and the output with every earlier intermediate kept as one node.

    SymPy's sums flatten Y₂ = Y₁ + P₂ Y₁ W into X + P₁ X W₁ + P₂ (…) W: the node Y₁ is then
    not where the output's cotangent reaches X + P₁ X W₁, a reverse sweep gives Y₁ only part
    of its cotangent, and the rest is repeated in every earlier layer's (quadratic in depth).
    Each intermediate is written with the earlier ones' names (``Names.substitute``), then the
    names are replaced by those nodes, on the DAG (``_with_nodes``).
    """
    names, nodes_of = Names(), {}
    out = []
    for label, expr in s.intermediates:
        nested = _with_nodes(names.substitute(expr), nodes_of)
        names.add(expr, symbol := MatrixSymbol(label, *expr.shape))
        nodes_of[symbol] = nested
        out.append((label, nested))
    return out, _with_nodes(names.substitute(s.output), nodes_of)


def _with_nodes(expr: Basic, nodes_of: dict[Basic, Basic]) -> Basic:
    """expr with each name replaced by its node; products stay flat (a product among a product's factors is
    spliced in, a transposed one is written as the product of the transposed factors), sums stay nodes."""
    out: dict[Basic, Basic] = {}
    for node in postorder(expr):
        args = [out[a] for a in children(node)]
        if node in nodes_of:
            out[node] = nodes_of[node]
        elif not args:
            out[node] = node
        elif isinstance(node, MatMul):
            out[node] = product(*args, canonical=False, flatten=True)
        elif isinstance(node, Transpose):
            out[node] = _transposed(args[0])
        else:
            out[node] = rebuilt(node, args)
    return out[expr]


def _transposed(a: Basic) -> Basic:
    """aᵀ: pushed through a product (its factors transposed in reverse order), a Transpose node otherwise."""
    if isinstance(a, MatMul):
        coeff, mats = factors(a)
        return product(coeff, *(_transposed(m) for m in reversed(mats)), canonical=False, flatten=True)
    return a.arg if isinstance(a, Transpose) else intern(Transpose(a))


def second_order_spec(s: Spec, wrt: Sequence[str] | None = None) -> SecondOrder:
    """The spec of f₂ = Σ_i tr(V_iᵀ ∂tr(Gᵀ Y)/∂x_i) over the inputs x_i named in wrt (default: all).

    Its inputs: the spec's inputs, G (named ``G_out``), then one direction per x_i in wrt; its
    constants: the spec's (the additive mask M). Intermediates: the spec's, the cotangents of
    those the reverse sweep reaches and the first gradients (named G_<name>: G_A = ∂f/∂A).
    """
    names = [str(x.name) for x in s.inputs]
    wrt = list(names if wrt is None else wrt)
    unknown = [w for w in wrt if w not in names]
    if unknown:
        raise SymattnError(f"spec {s.name!r} has no input {unknown[0]!r}; inputs: {', '.join(names)}")
    taken = set(names) | {str(c.name) for c in s.constants} | {label for label, _ in s.intermediates}
    cotangent = MatrixSymbol(fresh_name(COTANGENT, taken, bare=True, first=2), *s.output.shape)
    taken.add(str(cotangent.name))
    intermediates, output = nested(s)
    tape = backward(output, s.inputs, cotangent)
    labels = set(taken)
    # the first sweep's cotangents, named as the first schedule names them, in the order the sweep computes
    # them (the last intermediate's first): each is written with the later ones' names, never expanded
    for label, expr in reversed(intermediates[: len(s.intermediates)]):
        cot = tape.cotangents.get(expr)
        name = f"G_{label}"
        if cot is not None and not isinstance(cot, MatrixSymbol) and name not in labels and is_identifier(name):
            intermediates.append((name, cot))
            labels.add(name)
    directions: list[tuple[str, MatrixSymbol]] = []
    terms = []
    for x in s.inputs:
        if str(x.name) not in wrt:
            continue
        v_name = fresh_name(DIRECTION.format(x.name), labels | taken, bare=True, first=2)
        v = MatrixSymbol(v_name, *x.shape) if isinstance(x, MatrixSymbol) else sp.Symbol(v_name, real=True)
        taken.add(v_name)
        directions.append((str(x.name), v))
        g = tape.gradients[x]
        if g == 0 or getattr(g, "is_ZeroMatrix", False):
            continue
        if not isinstance(x, MatrixSymbol):  # a trainable scalar τ: ∂f/∂τ as the 1 × 1 sum of entries it is
            g = as_matrix(g)
        label = fresh_name(f"G_{x.name}", labels | taken, bare=True, first=2)
        intermediates.append((label, g))
        labels.add(label)
        terms.append(inner(v, g))
    if not terms:
        raise SymattnError(f"spec {s.name!r}: the output depends on none of {', '.join(wrt)}")
    f2 = total(*terms) if len(terms) > 1 else terms[0]
    spec = Spec(
        f"{s.name}_order2",
        f"Σ_i tr(V_iᵀ ∂tr(Gᵀ Y)/∂x_i), Y = {s.summary}",
        (*s.inputs, cotangent, *(v for _, v in directions)),
        f2,
        tuple(intermediates),
        s.options,
        s.dims,
        s.constants,
        None
        if s.parameters is None
        else (*s.parameters, *(str(v.name) for x, v in directions if str(x) in s.parameters)),
    )
    return SecondOrder(spec, s, str(cotangent.name), tuple((x, str(v.name)) for x, v in directions))
