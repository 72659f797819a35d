"""The cost model: FLOPs of nodes and DAGs, matrix-chain order, peak temporaries, the spec report."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import BlockMatrix, HadamardProduct, MatAdd, MatMul, MatrixSlice, OneMatrix, Transpose

import symattn as sa
from symattn.cli import main
from symattn.codegen.report.cost_report import cost_report
from symattn.lang.ops import Exp, RowSoftmax, RowSum, SplitHeads
from symattn.optimize.cost import (
    TYPICAL_SIZES,
    chain_order,
    flops,
    flops_value,
    largest_temporaries,
    order_products,
    peak_bytes,
    size_function,
)

n, m, k, h = (sp.Symbol(s, positive=True, integer=True) for s in ("n", "m", "k", "H"))
A, B = MatrixSymbol("A", n, k), MatrixSymbol("B", k, m)
C = MatrixSymbol("C", m, k)


def test_product_costs_two_flops_per_multiply_add():
    # (n × k)(k × m): n·m entries, each k multiplies and k adds
    assert flops(MatMul(A, B)) == 2 * n * k * m


def test_entrywise_nodes_cost_one_flop_per_entry_and_softmax_five():
    ab = MatMul(A, B)
    assert flops(HadamardProduct(ab, ab)) - flops(ab) == n * m
    assert flops(MatAdd(ab, ab, ab)) - flops(ab) == 2 * n * m
    assert flops(RowSoftmax(ab)) - flops(ab) == 5 * n * m
    assert flops(RowSum(ab)) - flops(ab) == n * m


def test_shared_subexpressions_count_once_and_transposes_are_free():
    ab = MatMul(A, B)
    assert flops([ab, ab, Transpose(ab)]) == flops(ab)
    assert flops(HadamardProduct(ab, ab)) == flops(ab) + n * m
    assert flops(ab, given=[ab]) == 0
    assert flops(MatMul(ab, C), given=[ab]) == 2 * n * m * k


def test_broadcast_and_row_sum_through_ones_are_cheap():
    x = MatrixSymbol("x", n, 1)
    assert flops(MatMul(x, OneMatrix(1, m))) == 0  # x 𝟏ᵀ: a broadcast
    assert flops(MatMul(MatMul(A, B), OneMatrix(m, 1))) == 2 * n * k * m + n * m  # (A B) 𝟏: a row sum


def test_per_head_nodes_count_once_per_head():
    x = MatrixSymbol("X", n, h * k)
    y = MatrixSymbol("Y", m, h * k)
    s = MatMul(SplitHeads(x, h), Transpose(SplitHeads(y, h)))
    assert sp.expand(flops(s)) == 2 * h * n * m * k


def test_chain_order_picks_the_cheapest_parenthesisation():
    # (10×100)(100×5)(5×50): (A B) C costs 2·(5000 + 2500), A (B C) 2·(25000 + 50000)
    a, b, c = MatrixSymbol("a", 10, 100), MatrixSymbol("b", 100, 5), MatrixSymbol("c", 5, 50)
    assert chain_order([a, b, c], size_function(None)) == MatMul(MatMul(a, b), c)
    assert flops(MatMul(a, b, c)) == 2 * (10 * 100 * 5 + 10 * 5 * 50)
    # with symbolic sizes the decision is taken at the typical sizes: X W_Q W_Kᵀ Xᵀ = (X W_Q)(X W_K)ᵀ
    d_model, d_k = sp.Symbol("d_model", positive=True, integer=True), sp.Symbol("d_k", positive=True, integer=True)
    x, wq, wk = MatrixSymbol("X", n, d_model), MatrixSymbol("W_Q", d_model, d_k), MatrixSymbol("W_K", d_model, d_k)
    ordered = order_products(MatMul(x, wq, Transpose(wk), Transpose(x)))
    assert ordered == MatMul(MatMul(x, wq), MatMul(Transpose(wk), Transpose(x)))


def test_order_products_puts_the_scalar_on_the_smaller_operand():
    d_k = sp.Symbol("d_k", positive=True, integer=True)
    q, key = MatrixSymbol("Q", n, d_k), MatrixSymbol("K", m, d_k)
    scale = 1 / sp.sqrt(d_k)
    ordered = order_products(MatMul(scale, q, Transpose(key)))
    assert ordered == MatMul(MatMul(scale, q), Transpose(key))
    assert flops(ordered) == 2 * n * m * d_k + n * d_k


def test_ordered_products_evaluate_to_the_same_value(rng):
    a, b, c = MatrixSymbol("a", n, k), MatrixSymbol("b", k, m), MatrixSymbol("c", m, 1)
    expr = MatMul(sp.Rational(1, 3), a, b, c)
    ordered = order_products(expr)
    assert ordered != expr
    values = [rng.standard_normal(s) for s in ((5, 3), (3, 7), (7, 1))]
    np.testing.assert_allclose(sa.lambdify([a, b, c], ordered)(*values), sa.lambdify([a, b, c], expr)(*values))


def test_peak_bytes_frees_values_after_their_last_use():
    # (A B) C: A B (n × m) is dead once (A B) C (n × k) exists, but both are live while it is computed
    ab = MatMul(A, B)
    sizes = {"n": 10, "m": 20, "k": 5}
    assert peak_bytes(MatMul(ab, C), sizes=sizes, itemsize=8) == 8 * (10 * 20 + 10 * 5)
    assert peak_bytes(Transpose(A), sizes=sizes) == 0  # a view of an input
    assert peak_bytes([ab, MatMul(ab, C)], sizes=sizes, itemsize=1) == 10 * 20 + 10 * 5


def test_largest_temporaries_are_listed_biggest_first():
    ab = MatMul(A, B)
    (node, entries), *_ = largest_temporaries(MatMul(ab, C))
    assert node == ab and entries == n * m


def test_flops_value_evaluates_at_the_typical_sizes():
    value = flops_value(MatMul(A, B))
    assert value == 2 * TYPICAL_SIZES["n"] * TYPICAL_SIZES["m"] * 64  # k is not in the table: 64


def test_attention_report_meets_twelve_n_squared_d():
    report = cost_report("attention")
    n_, m_, dk, dv, d = (sp.Symbol(s, positive=True, integer=True) for s in ("n", "m", "d_k", "d_v", "d"))
    total = sp.expand((report.forward + report.backward).xreplace({m_: n_, dk: d, dv: d}))
    assert total.coeff(n_**2 * d) == 12
    assert sp.Poly(total - 12 * n_**2 * d, n_, d).total_degree() <= 2
    assert sp.expand(report.backward_derived - report.backward).xreplace({m_: n_, dk: d, dv: d}).coeff(n_**2 * d) == 2
    row = next(r for r in report.rows if "n=512" in r["sizes"])
    assert row["backward"] < row["backward_derived"]
    assert row["forward_peak"] > 0 and row["backward_peak"] >= 512 * 512 * 4


def test_every_spec_has_a_cost_report_whose_figures_agree():
    for name in sa.specs():
        report = cost_report(name)
        # simplifying never costs more than the derivation as it came out of the engine
        for row in report.rows:
            assert 0 < row["backward"] <= row["backward_derived"], (name, row)
            assert row["forward"] > 0 and row["forward_peak"] > 0 and row["backward_peak"] > 0, (name, row)
            if row["generated_backward"] is not None:  # the schedule's count, where the report has one
                assert abs(row["generated_backward"] - row["backward"]) <= 0.05 * row["backward"], (name, row)
        if report.generated_forward is not None:  # the generated forward is the simplified one, or cheaper
            at = {symbol: 64 for symbol in report.forward.free_symbols | report.generated_forward.free_symbols}
            generated, simplified = report.generated_forward.xreplace(at), report.forward.xreplace(at)
            assert 0.9 * simplified <= generated <= simplified, (name, generated, simplified)
        text = report.text()
        for figure in (report.forward, report.backward, report.backward_derived):
            assert str(figure) in text, (name, figure)


def test_cli_derive_cost_prints_the_report(capsys):
    assert main(["derive", "attention", "--cost"]) == 0
    out = capsys.readouterr().out
    assert "forward + backward  6*d_k*m*n" in out
    assert "n=4096" in out


def test_generated_schedule_costs_twelve_n_squared_d():
    pytest.importorskip("symattn.codegen.schedule.build", reason="code generation is not part of this checkout")
    report = cost_report("attention")
    n_, m_, dk, dv, d = (sp.Symbol(s, positive=True, integer=True) for s in ("n", "m", "d_k", "d_v", "d"))
    total = sp.expand((report.generated_forward + report.generated_backward).xreplace({m_: n_, dk: d, dv: d}))
    assert total.coeff(n_**2 * d) == 12
    assert sp.Poly(total - 12 * n_**2 * d, n_, d).total_degree() <= 2


def test_entrywise_nodes_write_over_an_argument_that_dies_there():
    # exp(A B): the product's buffer is reused, so one n × m buffer, not two
    ab = MatMul(A, B)
    sizes = {"n": 10, "m": 20, "k": 5}
    assert peak_bytes(Exp(ab), sizes=sizes, itemsize=1) == 10 * 20
    assert peak_bytes(Exp(ab), sizes=sizes, itemsize=1, in_place=False) == 2 * 10 * 20
    # A B stays live when something else still reads it: no reuse
    assert peak_bytes([Exp(ab), ab], sizes=sizes, itemsize=1) == 2 * 10 * 20


def test_a_broadcast_column_allocates_nothing():
    # rowsum(A B) 𝟏ᵀ is a broadcast view of the n × 1 row sums
    ab = MatMul(A, B)
    broadcast = MatMul(RowSum(ab), OneMatrix(1, m))
    sizes = {"n": 10, "m": 20, "k": 5}
    assert peak_bytes(MatAdd(ab, broadcast), sizes=sizes, itemsize=1) == 10 * 20 + 10


def test_block_matrices_move_entries_and_slices_are_views():
    # [A | A2] costs no FLOPs (a copy of n·2k entries); a slice of it is a view
    a2 = MatrixSymbol("A2", n, k)
    block = BlockMatrix([[A, a2]])
    sizes = {"n": 10, "m": 20, "k": 5}
    assert flops(block) == 0
    assert peak_bytes(block, sizes=sizes, itemsize=1) == 10 * 2 * 5
    assert flops(MatMul(MatrixSlice(block, (0, n, 1), (0, k, 1)), B)) == 2 * n * k * m


def test_a_scalar_lands_on_one_operand_of_a_square(rng):
    # (3/2) B B: the scalar scales one factor, not both copies of B
    b = MatrixSymbol("B", n, n)
    ordered = order_products(MatMul(sp.Rational(3, 2), b, b))
    value = rng.standard_normal((4, 4))
    np.testing.assert_allclose(sa.lambdify([b], ordered)(value), 1.5 * value @ value)
