"""The n × m core a Triton kernel computes: O = N(A) V with A = E(S), S = Q Kᵀ, found in a spec's expression.

Q (n × d), K (m × d) and V (m × d_v) are thin factors, themselves any expressions of the inputs (X W_Q); E is
a chain of entrywise steps on the raw scores S (a scalar times S, n × m inputs and constants added or multiplied
in, trainable scalars, the language's entrywise functions); N is the row softmax, or none (P = A, as sigmoid
attention's σ(c·S)). A scalar c multiplying the scores product goes into E (A = E(c·S)), one multiplying the
product with V into V. What lies outside the core (the factors' expressions, what the spec makes of O) stays
torch: ``rest`` is the spec's output with the core's value replaced by the symbol ``output``.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, OneMatrix, Transpose

from symattn.errors import SymattnError
from symattn.lang.functions import Elementwise
from symattn.lang.graph import matrix_symbols, postorder
from symattn.lang.ops import RowSoftmax
from symattn.specs import Spec

WHAT = "no n × m core the Triton kernels cover"


@dataclass(frozen=True)
class Core:
    """O = N(E(S)) V of a spec; S (the raw scores Q Kᵀ) and O are fresh symbols of the kernels' tiles."""

    query: MatrixExpr  # Q, n × d
    key: MatrixExpr  # K, m × d
    value: MatrixExpr  # V, m × d_v (a scalar multiplying P V included)
    scores: MatrixSymbol  # S = Q Kᵀ, n × m
    logits: MatrixExpr  # A = E(S, tiles, scalars), entrywise
    softmax: bool  # N: the row softmax (True) or none (P = A)
    output: MatrixSymbol  # O = N(A) V, n × d_v
    rest: MatrixExpr  # the spec's output, O written as ``output``
    tiles: tuple[MatrixSymbol, ...]  # the n × m inputs and constants A reads, loaded tile by tile
    scalars: tuple[sp.Symbol, ...]  # the trainable scalars A reads


def find_core(spec: Spec) -> Core:
    """The spec's one core O = N(E(Q Kᵀ)) V; a SymattnError of one line naming what is missing otherwise."""
    found = {c for c in (_core_at(spec, node) for node in postorder(spec.output)) if c is not None}
    if len(found) != 1:
        raise SymattnError(f"{spec.name}: {WHAT} ({_why_not(spec, len(found))})")
    return found.pop()


def _why_not(spec: Spec, count: int) -> str:
    """Why no single core was found (count of them)."""
    if count > 1:
        return f"{count} products N(E(Q Kᵀ)) V; one kernel computes one"
    softmaxes = [x for x in postorder(spec.output) if isinstance(x, RowSoftmax)]
    if not softmaxes and not any(isinstance(x, MatMul) and _scores_product(x) for x in postorder(spec.output)):
        return "no n × m scores product Q Kᵀ of thin factors"
    return "no product N(A) V with A entrywise in one scores product Q Kᵀ and N a row softmax or none"


def _core_at(spec: Spec, node: Basic) -> Core | None:
    """The core whose O is node (a product N(A) V₁ … V_k), or None."""
    if not isinstance(node, MatMul):
        return None
    coeff, mats = node.as_coeff_matrices()
    if len(mats) < 2 or not isinstance(mats[0], MatrixExpr):
        return None
    first = mats[0]
    softmax = isinstance(first, RowSoftmax)
    logits = first.arg if softmax else first
    products = [x for x in postorder(logits) if isinstance(x, MatMul) and _scores_product(x)]
    if len(set(products)) != 1 or not _entrywise(logits, products[0]):
        return None
    if not softmax and not any(isinstance(x, Elementwise) for x in postorder(logits)):
        return None  # P = c·Q Kᵀ + B with no function: a product of products, not a kernel's core
    split = _split(products[0])
    if split is None:
        return None
    c, query, key = split
    n, m = logits.shape
    scores = MatrixSymbol("S", n, m)
    a = logits.xreplace({products[0]: c * scores if c != 1 else scores})
    value = MatMul(*mats[1:]).doit() if len(mats) > 2 else mats[1]
    value = coeff * value if coeff != 1 else value
    taken = {str(x.name) for x in (*spec.inputs, *spec.constants)}
    output = MatrixSymbol("O" if "O" not in taken else "core_o", n, value.shape[1])
    tiles = tuple(sorted((x for x in matrix_symbols(a) if x != scores), key=str))
    allowed = {*spec.inputs, *spec.constants}
    if any(t not in allowed or t.shape != (n, m) for t in tiles):
        return None
    scalars = tuple(x for x in spec.inputs if isinstance(x, sp.Symbol) and x in a.free_symbols)
    rest = spec.output.xreplace({node: output})
    if any(x in (first, products[0]) for x in postorder(rest)):
        return None  # the output reads P or the scores besides P V: they are never made whole
    return Core(query, key, value, scores, a, softmax, output, rest, tiles, scalars)


def _scores_product(node: MatMul) -> bool:
    """Is node a product of two or more matrices whose result is wider than some factor inside it (n × m from
    thin factors)?"""
    _, mats = node.as_coeff_matrices()
    return len(mats) >= 2 and _split(node) is not None


def _split(product: MatMul) -> tuple[Basic, MatrixExpr, MatrixExpr] | None:
    """(c, Q, K) with product = c · Q Kᵀ: the cut of its factors whose right part is all transposes (X W_Q ·
    W_Kᵀ Xᵀ), else the first whose right part starts with one; the inner dimension is neither of the result's."""
    coeff, mats = product.as_coeff_matrices()
    n, m = product.shape
    cuts = [i for i in range(1, len(mats)) if mats[i].shape[0] not in (n, m)]
    transposed = [i for i in cuts if all(isinstance(f, Transpose) for f in mats[i:])]
    transposed += [i for i in cuts if isinstance(mats[i], Transpose)]
    if not transposed:
        return None
    i = transposed[0]
    left = MatMul(*mats[:i]).doit() if i > 1 else mats[0]
    right = MatMul(*mats[i:]).doit() if len(mats) - i > 1 else mats[i]
    return coeff, left, Transpose(right).doit()


def _entrywise(value: Basic, scores: MatMul) -> bool:
    """Is value made entry by entry from the scores product's entries (sums, ⊙, powers, scalar multiples, the
    language's entrywise functions, n × m symbols and ones)?"""
    if value == scores or not isinstance(value, MatrixExpr):
        return True
    if isinstance(value, MatMul):
        if sum(isinstance(f, MatrixExpr) for f in value.args) > 1:
            return False
    elif isinstance(value, (OneMatrix, MatrixSymbol)):
        return value.shape == scores.shape
    elif not isinstance(value, (MatAdd, HadamardProduct, HadamardPower, Elementwise)):
        return False
    return all(_entrywise(a, scores) for a in value.args)
