"""A sum of products of one large result as one product of concatenations (``passes.stack_products``), and
rowsum(X ⊙ Y) as one row-wise dot product in NumPy: equal values, and each made only where it pays."""

from __future__ import annotations

import numpy as np
import sympy as sp
from sympy import MatrixSymbol

import symattn as sa
from symattn.codegen.backends.jax.backend import JaxMatrixPrinter
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.schedule.dag import Assignment
from symattn.codegen.schedule.passes import stack_products
from symattn.lang.ops import RowSum, SplitHeads
from symattn.numeric.low_precision import row_dot

n, m, d, e = sp.symbols("n m d_k d_model", positive=True, integer=True)  # typical sizes: n, m long; d_k short
c = sp.Symbol("scale", positive=True)
Q, dQ, M = MatrixSymbol("Q", n, d), MatrixSymbol("Q_t", n, d), MatrixSymbol("M", n, m)
K, dK = MatrixSymbol("K", m, d), MatrixSymbol("K_t", m, d)
dA = MatrixSymbol("dA", n, m)


def evaluate(expr, **values):
    """expr at the given arrays (by name), its symbols of symbolic shapes as they are."""
    symbols = {str(x.name): x for x in expr.atoms(MatrixSymbol)}
    return sa.lambdify([symbols[k] for k in values], expr)(*values.values())


def written_out(assignments):
    """The last value with the concatenations before it substituted."""
    *named, last = assignments
    return last.value.xreplace({a.target: a.value for a in named})


def test_two_products_of_an_n_by_m_result_become_one_of_concatenations(rng):
    # c·Q K̇ᵀ + c·Q̇ Kᵀ + M = c·[Q | Q̇] [K̇ | K]ᵀ + M
    value = c * Q * dK.T + c * dQ * K.T + M
    out = stack_products([Assignment(dA, value)], frozenset(), set())
    assert [type(a.value).__name__ for a in out[:2]] == ["BlockMatrix", "BlockMatrix"]
    assert [str(a.target) for a in out[:2]] == ["Q_Q_t", "K_t_K"]
    shapes = {"Q": (5, 3), "Q_t": (5, 3), "K": (4, 3), "K_t": (4, 3), "M": (5, 4)}
    named = {k: rng.standard_normal(s) for k, s in shapes.items()}
    got = evaluate(written_out(out).subs(c, 0.7), **named)
    want = evaluate(value.subs(c, 0.7), **named)
    np.testing.assert_allclose(got, want, rtol=1e-13)


def test_different_scalars_go_with_their_blocks(rng):
    # 2·Q K̇ᵀ − 3·Q̇ Kᵀ = [2Q | −3Q̇] [K̇ | K]ᵀ
    value = 2 * Q * dK.T - 3 * dQ * K.T
    out = stack_products([Assignment(dA, value)], frozenset(), set())
    assert len(out) == 3
    shapes = {"Q": (5, 3), "Q_t": (5, 3), "K": (4, 3), "K_t": (4, 3)}
    named = {k: rng.standard_normal(s) for k, s in shapes.items()}
    np.testing.assert_allclose(evaluate(written_out(out), **named), evaluate(value, **named), rtol=1e-13)


def test_products_whose_operands_outweigh_the_result_stay_a_sum():
    # Q Ẇ + Q̇ W (n × d_model from n × d_model operands): the concatenations would copy more than the add reads
    x, dx = MatrixSymbol("X", n, e), MatrixSymbol("X_t", n, e)
    w, dw = MatrixSymbol("W", e, e), MatrixSymbol("W_t", e, e)
    value = x * dw + dx * w
    target = MatrixSymbol("dY", n, e)
    assert stack_products([Assignment(target, value)], frozenset({"W", "W_t"}), set()) == [Assignment(target, value)]


def test_operands_with_different_leading_axes_are_not_joined():
    # Q_h has a heads axis, Q̇ (no split) has none: they cannot be concatenated
    h = sp.Symbol("H", positive=True, integer=True)
    x = MatrixSymbol("X", n, h * d)
    q_h = MatrixSymbol("Q_h", n, d)
    earlier = (Assignment(q_h, SplitHeads(x, h)),)
    value = c * q_h * dK.T + c * dQ * K.T
    out = stack_products([Assignment(dA, value)], frozenset(), set(), earlier)
    assert out == [Assignment(dA, value)]


def test_a_row_sum_of_an_entrywise_product_is_one_row_dot_in_numpy_only():
    p = MatrixSymbol("P", n, m)
    value = RowSum(sp.HadamardProduct(dA, p))
    assert GeneratedNumPyPrinter().doprint(value) == "row_dot(dA, P)"  # the runtime's: np.vecdot, float32 for float16
    assert "np.vecdot(a, b)" in GeneratedNumPyPrinter.runtime["row_dot"]
    assert "vecdot" not in JaxMatrixPrinter().doprint(value) + JaxMatrixPrinter.runtime["row_dot"]


def test_the_row_dot_keeps_the_value(rng):
    p = MatrixSymbol("P", 5, 4)
    x = MatrixSymbol("dA", 5, 4)
    a, b = rng.standard_normal((2, 3, 5, 4))
    text = GeneratedNumPyPrinter().doprint(RowSum(sp.HadamardProduct(x, p)))
    namespace = {"np": np, "row_dot": row_dot, "dA": a, "P": b}
    np.testing.assert_allclose(eval(text, namespace), (a * b).sum(-1, keepdims=True), rtol=1e-13)
