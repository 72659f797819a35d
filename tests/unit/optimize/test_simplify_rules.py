"""Each rewrite rule fires on its pattern and both sides agree on random matrices."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import (
    HadamardProduct,
    Identity,
    MatAdd,
    MatMul,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)

import symattn as sa
from symattn.lang.ops import RowSoftmax, RowSum, SumEntries
from symattn.optimize import rewrites
from symattn.optimize.cost import flops_value
from symattn.optimize.rewrites import COST_REWRITES, REWRITES
from symattn.optimize.simplify import simplify

n, m, k = (sp.Symbol(s, positive=True, integer=True) for s in ("n", "m", "k"))
A, A2, A3 = (MatrixSymbol(s, n, k) for s in ("A", "A2", "A3"))
B = MatrixSymbol("B", m, k)
C, C2 = MatrixSymbol("C", n, m), MatrixSymbol("C2", n, m)
E, E2 = MatrixSymbol("E", k, m), MatrixSymbol("E2", k, m)
x = MatrixSymbol("x", n, 1)
c = 1 / sp.sqrt(k)

# rule → an expression it rewrites at the root
CASES = {
    "transpose_of_transpose": Transpose(Transpose(A)),  # (Aᵀ)ᵀ = A
    "transpose_of_constant": HadamardProduct(C, Transpose(OneMatrix(m, n))).args[1],  # 𝟏ᵀ = 𝟏
    "fewer_transposes": Transpose(MatMul(A, Transpose(B))),  # (A Bᵀ)ᵀ = B Aᵀ
    "flatten_product": MatMul(2, MatMul(A, Transpose(B)), MatMul(3, B)),  # 2 (A Bᵀ)(3 B) = 6 A Bᵀ B
    "unit_factors": MatMul(1, A, Identity(k)),  # 1 · A I = A
    "flatten_entrywise": MatAdd(MatAdd(A, A2), A3),  # (A + A2) + A3 = A + A2 + A3
    "zero_terms": MatAdd(A, ZeroMatrix(n, k)),  # A + 0 = A
    "collect_like_terms": MatAdd(MatMul(2, A), MatMul(3, A), A2),  # 2A + 3A + A2 = 5A + A2
    "common_scalar_out": MatAdd(MatMul(c, A), MatMul(-c, A2)),  # cA − cA2 = c(A − A2)
    "sort_commutative": HadamardProduct(*sorted([A, A2], key=sp.default_sort_key, reverse=True)),  # A2 ⊙ A = A ⊙ A2
    "hadamard_with_ones": HadamardProduct(A, OneMatrix(n, k)),  # A ⊙ 𝟏𝟏ᵀ = A
    "hadamard_with_zero": HadamardProduct(A, ZeroMatrix(n, k)),  # A ⊙ 0 = 0
    "hadamard_scalar_out": HadamardProduct(MatMul(3, A), MatMul(c, A2)),  # 3A ⊙ cA2 = 3c (A ⊙ A2)
    "product_with_ones": MatMul(HadamardProduct(C, C2), OneMatrix(m, m)),  # (G ⊙ P) 𝟏𝟏ᵀ = rowsum(G ⊙ P) 𝟏ᵀ
    "ones_times_ones": MatMul(x, OneMatrix(1, k), OneMatrix(k, m)),  # x 𝟏_{1×k} 𝟏_{k×m} = k x 𝟏_{1×m}
    "rowsum_of_column": RowSum(x),  # rowsum(x) = x
    "rowsum_of_broadcast": RowSum(MatMul(2, x, OneMatrix(1, m))),  # rowsum(2 x 𝟏ᵀ) = 2 m x
    "rowsum_scalar_out": RowSum(MatMul(c, C)),  # rowsum(c C) = c rowsum(C)
    "rowsum_of_sum": RowSum(MatAdd(C, MatMul(x, OneMatrix(1, m)))),  # rowsum(C + x 𝟏ᵀ) = rowsum(C) + m x
    "rowsum_hadamard_transfer": RowSum(HadamardProduct(MatMul(A, Transpose(B)), C)),  # rowsum((A Bᵀ) ⊙ C)
    "rowsum_of_product": RowSum(MatMul(A, E)),  # rowsum(A E) = A rowsum(E)
    "sum_of_transpose": Trace(Transpose(MatMul(A, Transpose(A2)))),  # tr((A A2ᵀ)ᵀ) = tr(A A2ᵀ)
    "sum_of_product": SumEntries(MatMul(A, E)),  # sum(A E) = sum(A rowsum(E))
    "trace_of_product": Trace(MatMul(A, Transpose(A2))),  # tr(A A2ᵀ) = sum(A ⊙ A2)
    "factor_common_left": MatAdd(MatMul(A, E), MatMul(2, A, E2), C),  # A E + 2 A E2 + C = A (E + 2 E2) + C
    "factor_common_right": MatAdd(MatMul(C, B), MatMul(C2, B)),  # C B + C2 B = (C + C2) B
}
ALL_RULES = {rule.__name__: rule for rule in (*REWRITES, *COST_REWRITES)}


def evaluate(expr, rng: np.random.Generator, sizes=(3, 4, 2)) -> np.ndarray:
    """expr at n, m, k = sizes with every matrix symbol random (the same draw for both sides)."""
    symbols = sorted(expr.atoms(MatrixSymbol), key=lambda s: s.name)
    values = {n: sizes[0], m: sizes[1], k: sizes[2]}
    args = [
        np.random.default_rng(abs(hash(s.name)) % 2**32).standard_normal(
            tuple(int(sp.sympify(d).xreplace(values)) for d in s.shape)
        )
        for s in symbols
    ]
    dims = {"n": sizes[0], "m": sizes[1], "k": sizes[2]}
    value = sa.lambdify(symbols, expr, dims=dims)(*args)
    return np.broadcast_to(value, tuple(int(sp.sympify(d).xreplace(values)) for d in getattr(expr, "shape", ())))


def test_every_rule_has_a_case():
    assert set(CASES) == set(ALL_RULES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_preserves_value(name, rng):
    before = CASES[name]
    after = ALL_RULES[name](before)
    assert after is not None, f"{name} did not fire on {before}"
    assert after != before
    assert getattr(after, "shape", ()) == getattr(before, "shape", ())
    np.testing.assert_allclose(evaluate(after, rng), evaluate(before, rng), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_leaves_a_bare_symbol_alone(name):
    assert ALL_RULES[name](A) is None


@pytest.mark.parametrize("name", [r.__name__ for r in REWRITES])
def test_unconditional_rules_never_add_flops(name):
    before = CASES[name]
    assert flops_value(ALL_RULES[name](before)) <= flops_value(before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_simplify_preserves_value_and_never_costs_more(name, rng):
    before = CASES[name]
    after = simplify(before)
    np.testing.assert_allclose(evaluate(after, rng), evaluate(before, rng), rtol=1e-12, atol=1e-12)
    assert flops_value(after) <= flops_value(before)


def test_rowsum_transfer_finds_the_output_inside_a_softmax_gradient(rng):
    # rowsum((G Vᵀ) ⊙ P) = rowsum(G ⊙ (P V)), P = softmax(Q Kᵀ)
    q, key, v, g = MatrixSymbol("Q", n, k), MatrixSymbol("K", m, k), MatrixSymbol("V", m, k), MatrixSymbol("G", n, k)
    p = RowSoftmax(MatMul(q, Transpose(key)))
    before = RowSum(HadamardProduct(MatMul(g, Transpose(v)), p))
    after = rewrites.rowsum_hadamard_transfer(before)
    assert after == RowSum(HadamardProduct(g, MatMul(p, v)))
    np.testing.assert_allclose(evaluate(after, rng), evaluate(before, rng), rtol=1e-12)


def test_rowsum_transfer_is_kept_only_where_it_pays():
    # the softmax VJP C ⊙ (A Bᵀ − rowsum((A Bᵀ) ⊙ C) 𝟏ᵀ) needs A Bᵀ anyway: moving the row sum onto
    # C B costs a new n·m·k product, unless C B is given (the forward output O = P V)
    dp = MatMul(A, Transpose(B))
    vjp = HadamardProduct(C, MatAdd(dp, MatMul(-1, RowSum(HadamardProduct(dp, C)), OneMatrix(1, m))))
    given = MatMul(C, B)
    assert not row_sums_of(simplify(vjp), {A, given})
    simplified = simplify(vjp, given=[given])
    assert row_sums_of(simplified, {A, given})
    assert flops_value(simplified, given=[given]) < flops_value(vjp, given=[given])


def row_sums_of(expr, factors: set) -> list:
    """The nodes rowsum(F₁ ⊙ F₂ ⊙ …) in expr whose Hadamard factors are exactly the given ones."""
    return [
        s
        for s in sp.preorder_traversal(expr)
        if isinstance(s, RowSum) and isinstance(s.arg, HadamardProduct) and set(s.arg.args) == factors
    ]


def test_fewer_transposes_pulls_a_transpose_out_of_a_hadamard_product():
    # Aᵀ ⊙ A2ᵀ = (A ⊙ A2)ᵀ
    assert rewrites.fewer_transposes(HadamardProduct(Transpose(A), Transpose(A2))) == Transpose(HadamardProduct(A, A2))


def test_transposed_pushes_through_and_cancels():
    # (A Bᵀ + C2 B A2ᵀ... ) kept simple: (c A Bᵀ)ᵀ = c B Aᵀ
    assert rewrites.transposed(MatMul(c, A, Transpose(B))) == MatMul(c, B, Transpose(A))
    assert rewrites.transposed(OneMatrix(n, m)) == OneMatrix(m, n)
