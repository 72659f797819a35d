"""How one statement is printed, decided before the printer runs (the printers only print what it says).

- **Buffers**: an entrywise value — a sum, a Hadamard product, an entrywise or row-wise function — whose root
  operand is an array that dies at this statement (``consumable``, from the sections' liveness) is computed
  into that array (NumPy ``out=``, torch's in-place methods): no new temporary of its size. The root of a sum
  or a Hadamard product is its first positive term of the full shape (not a broadcast u 𝟏ᵀ) that has a buffer.
- **Products**: F₁ ⋯ F_k in the order that is cheapest at every size (``optimize.orders``), left to right where
  that is one; where the cheapest order depends on sizes the spec leaves open (φ(Q) (φ(K)ᵀ V) costs n·d²,
  (φ(Q) φ(K)ᵀ) V n²·d: which is less depends on n and d), the runtime's ``chain`` orders it from the arrays'
  shapes at call time. A chain with a block of ones (row sums and broadcasts: A (B 𝟏) 𝟏ᵀ, never an n × n
  product of ones) takes its cheapest order at typical sizes when that halves the cost. A scalar multiplies
  the smallest factor ((c·K) is m·d_k products, (c·dA) would be n·m).
- **Transposed products**: Aᵀ B as (Bᵀ A)ᵀ where a backend's GEMM is faster that way (``flip_ratio``) and A
  has that many times B's columns.

Sizes are typical sizes (sequence lengths long, feature sizes short: ``dag.typical_size``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, OneMatrix, Transpose

from symattn.codegen.schedule.chains import left_to_right, left_to_right_flops, tree_flops
from symattn.codegen.schedule.dag import typical_size as schedule_size
from symattn.lang.algebra import product
from symattn.numeric.printers import split_sign
from symattn.optimize.cost import chain_order
from symattn.optimize.orders import order_at_every_size


def typical_size(expr: MatrixExpr) -> int:
    """rows × columns of expr at typical sizes (symbolic dimensions made numbers)."""
    return schedule_size(expr.shape[0]) * schedule_size(expr.shape[1])


def broadcast_column(expr: Basic) -> Basic | None:
    """A smaller value that broadcasts to expr, else None: u for u 𝟏ᵀ (u = F₁ ⋯ F_k a column), vᵀ for 𝟏 vᵀ
    (vᵀ = F₁ ⋯ F_k a row), u^∘k for (u 𝟏ᵀ)^∘k."""
    if isinstance(expr, HadamardPower):
        base = broadcast_column(expr.base)
        return None if base is None else HadamardPower(base, expr.exp)
    if not isinstance(expr, MatMul):
        return None
    mats = [a for a in expr.args if isinstance(a, MatrixExpr)]
    coeff = sp.Mul(*(a for a in expr.args if not isinstance(a, MatrixExpr)))
    if len(mats) >= 2 and isinstance(mats[-1], OneMatrix) and mats[-1].shape[0] == 1:
        return product(coeff, *mats[:-1], canonical=False)
    if len(mats) >= 2 and isinstance(mats[0], OneMatrix) and mats[0].shape[1] == 1:
        return product(coeff, *mats[1:], canonical=False)
    return None


@dataclass
class Plan:
    """The buffer decisions for one statement; consumable: the names of the arrays that die at it."""

    consumable: frozenset = frozenset()
    _buffers: dict = field(default_factory=dict, repr=False)

    def buffer(self, expr: Basic) -> str | None:
        """The dying array expr is computed into, if any."""
        if not self.consumable:
            return None
        if expr not in self._buffers:
            self._buffers[expr] = self._find(expr)
        return self._buffers[expr]

    def _find(self, expr: Basic) -> str | None:
        if isinstance(expr, sp.MatrixSymbol):
            return str(expr.name) if str(expr.name) in self.consumable else None
        if isinstance(expr, (MatAdd, HadamardProduct)):
            for term in expr.args:
                sign, rest = split_sign(term)
                if sign > 0 and broadcast_column(term) is None and rest.shape == expr.shape:
                    found = self.buffer(rest)
                    if found is not None:
                        return found
        return None

    def root(self, expr: Basic, terms: list[tuple[str, Basic]], operation: str) -> Basic:
        """The term of expr (terms: (operation, operand) pairs) computed into expr's buffer first."""
        buffer = self.buffer(expr)
        return next(t for op, t in terms if op == operation and t.shape == expr.shape and self.buffer(t) == buffer)


# A plan with no dying arrays: every value a new array (JAX's, an in-place chain too long for a line, …)
NO_BUFFERS = Plan()


AT_CALL = "at call"  # a chain whose cheapest order depends on the sizes: ordered at call time (runtime ``chain``)


def cheapest_tree(mats: list[Basic]) -> Basic | str | None:
    """F₁ ⋯ F_k (k ≥ 3) as a binary tree of products in the order that is cheapest at every size
    (``optimize.orders``); None when that is left to right (print it so), ``AT_CALL`` when no order is
    cheapest at every size (the module orders the chain from its arrays' shapes). A chain with a block of
    ones is sums and broadcasts, whose orders differ by O(entries): its cheapest order at typical sizes
    when that halves the cost, else left to right."""
    if len(mats) < 3:
        return None
    if any(isinstance(m, OneMatrix) for m in mats):
        tree = chain_order(mats, sp.sympify)
        return tree if 2 * tree_flops(tree) < left_to_right_flops(mats) else None
    tree = order_at_every_size(mats)
    if tree is None:
        return AT_CALL
    return None if left_to_right(tree) else tree


def scaled_factor(mats: list[Basic]) -> int:
    """The index of the factor a product's scalar multiplies: the smallest (the first of equals)."""
    return min(range(len(mats)), key=lambda i: (typical_size(mats[i]), i))


def flipped(left: Basic, right: Basic, ratio: int | None) -> bool:
    """Is left·right = Aᵀ B computed as (Bᵀ A)ᵀ: A has at least ratio times B's columns?"""
    if ratio is None or not isinstance(left, Transpose):
        return False
    return schedule_size(left.shape[0]) >= ratio * schedule_size(right.shape[1])


def widens(left: Basic, right: Basic) -> bool:
    """Is left·right at least twice as large as either factor (at ``TYPICAL_SIZES``): an n × m product of thin
    factors, such as the scores Q Kᵀ, whose fresh result the torch runtime's big_matmul places in huge pages?"""
    size = schedule_size(left.shape[0] * right.shape[1])
    return size >= 2 * max(schedule_size(left.shape[0] * left.shape[1]), schedule_size(right.shape[0] * right.shape[1]))


def narrows(left: Basic, right: Basic) -> bool:
    """Is a factor of left·right as large as a widening product makes (``widens``: r × k from r × c and c × k, c
    the product's other side), such as P in P V or dS in dS K: an n × m array that a 16-bit run keeps in float32
    and rounds right before this product?"""
    rows, inner, cols = left.shape[0], left.shape[1], right.shape[1]
    made = (MatrixSymbol("_", rows, cols), MatrixSymbol("_", cols, inner))
    return widens(*made) or widens(MatrixSymbol("_", inner, rows), MatrixSymbol("_", rows, cols))


WIDE, NARROW = "wide", "narrow"  # how a 16-bit run computes a product of two factors (``precision``)


def precision(left: Basic, right: Basic, weights: Collection[str] = ()) -> str | None:
    """How a bfloat16 or float16 run computes left·right: WIDE, an n × m product of thin factors (Q Kᵀ, dP = dO Vᵀ)
    whose result stays float32 as SDPA keeps the scores; NARROW, a product that reads such an array (P V, dS K),
    rounded once, right before it; None: in the run's dtype. A product with a factor among weights (by name; or its
    transpose) is a projection X Wᵀ, never WIDE, where at typical sizes it widens (d → 2d)."""
    weighted = any(str(getattr(f.arg if isinstance(f, Transpose) else f, "name", "")) in weights for f in (left, right))
    return WIDE if widens(left, right) and not weighted else NARROW if narrows(left, right) else None
