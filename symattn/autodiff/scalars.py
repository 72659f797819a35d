"""Trainable scalars: a scalar's gradient written as a sum of entries, a 1 × 1 matrix.

The engine gives ∂f/∂τ for a scalar input τ as a scalar expression of traces: for
Y = τ S, tr(Ȳᵀ d(τS)) = dτ tr(Ȳᵀ S) + τ tr(Ȳᵀ dS), so ∂f/∂τ = tr(Ȳᵀ S). Generated
code and printed steps want it as what it computes, a sum of entries:

    tr(Aᵀ B) = 𝟏ᵀ (A ⊙ B) 𝟏        (A, B of one shape)

a 1 × 1 matrix expression the matrix pipeline (names, sharing, printers) handles like
any other value.
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import Identity, OneMatrix, Trace, Transpose

from symattn.errors import SymattnError
from symattn.lang.algebra import factors, hadamard_product, product, total, transpose
from symattn.lang.graph import rewrite
from symattn.lang.ops import SumEntries


def is_scalar_input(x: Basic) -> bool:
    """A trainable scalar: a SymPy Symbol that is no dimension (not an integer)."""
    return isinstance(x, sp.Symbol) and not x.is_integer


def entry_sum(a: MatrixExpr, b: MatrixExpr) -> MatrixExpr:
    """tr(Aᵀ B) = 𝟏ᵀ (A ⊙ B) 𝟏, a 1 × 1 matrix."""
    rows, cols = a.shape
    return product(OneMatrix(1, rows), hadamard_product(a, b), OneMatrix(cols, 1))


def trace_as_entry_sum(trace: Trace) -> MatrixExpr:
    """tr(c L₁ … L_k) as c 𝟏ᵀ (A ⊙ B) 𝟏 with A = L_iᵀ, B = L_{i+1} … L_k L₁ … L_{i−1} (a cyclic shift).

    The factor split off is the first transposed one (Ȳᵀ in tr(Ȳᵀ S)), else the first (tr(G S) with G = (A ⊙ B)ᵀ
    written out); the trace of one matrix is 𝟏ᵀ (M ⊙ I) 𝟏. Never the product's diagonal through the product.
    """
    coeff, mats = factors(trace.arg)
    if len(mats) > 1:
        i = next((i for i, m in enumerate(mats) if isinstance(m, Transpose)), 0)
        rest = product(*mats[i + 1 :], *mats[:i])
        return product(coeff, entry_sum(transpose(mats[i]), rest))
    body = trace.arg
    return entry_sum(body, Identity(body.shape[0]))


def as_matrix(gradient: Basic) -> MatrixExpr:
    """A scalar gradient (sums and scalar multiples of traces) as a 1 × 1 matrix expression."""
    if isinstance(gradient, Trace):
        return trace_as_entry_sum(gradient)
    if gradient == 0:
        return sp.ZeroMatrix(1, 1)
    if isinstance(gradient, sp.Add):
        return total(*(as_matrix(t) for t in gradient.args))
    if isinstance(gradient, sp.Mul):
        # a trace itself first: (2d + 2 tr(C)) tr(Ḡᵀ B) is tr(Ḡᵀ B) times a coefficient, not a sum with a term 2d
        traced = sorted((a for a in gradient.args if a.has(Trace)), key=lambda a: not isinstance(a, Trace))
        if traced:  # tr(A) tr(Ḡᵀ B): one trace as the matrix, the others (per-batch scalars) its coefficient
            rest = sp.Mul(*(a for a in gradient.args if a is not traced[0]))
            return product(rest, as_matrix(traced[0]))
    raise SymattnError(f"a scalar gradient that is not linear in traces of matrices: {gradient}")


def entry_sums(gradient: Basic) -> Basic:
    """A scalar gradient with each trace tr(Aᵀ B) written as sum(A ⊙ B) (printed 𝟏ᵀ(A ⊙ B)𝟏)."""

    def as_sum(node: Basic) -> Basic | None:
        if not isinstance(node, Trace):
            return None
        coeff, mats = factors(trace_as_entry_sum(node))
        if len(mats) == 3 and isinstance(mats[0], OneMatrix) and isinstance(mats[2], OneMatrix):
            return coeff * SumEntries(mats[1])  # 𝟏ᵀ (A ⊙ B) 𝟏
        return coeff * SumEntries(product(*mats))  # a 1 × 1 trace: its one entry

    return rewrite(gradient, as_sum) if gradient.has(Trace) else gradient
