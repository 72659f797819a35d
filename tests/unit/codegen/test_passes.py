"""The schedule passes added for user specs: each returns equal values, and does what its docstring says."""

from __future__ import annotations

import numpy as np
import sympy as sp
from sympy import MatrixSymbol, OneMatrix

import symattn as sa
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.schedule.build import schedule_spec
from symattn.codegen.schedule.dag import Assignment
from symattn.codegen.schedule.naming import name_row_sums, save_entrywise_outputs
from symattn.codegen.schedule.passes import hoist_hadamard_scalars
from symattn.lang.graph import nodes
from symattn.numeric.low_precision import narrow_matmul
from symattn.specs import dim

n, m = 4, 3
X, Y = MatrixSymbol("X", n, m), MatrixSymbol("Y", n, m)


def evaluate(expr, **values):
    return sa.lambdify([sp.MatrixSymbol(k, *v.shape) for k, v in values.items()], expr)(*values.values())


def test_hoisted_scalars_give_the_same_value(rng):
    # (a X) ⊙ (b Y) = (a b)(X ⊙ Y);  c (d X) = (c d) X
    value = sp.Rational(1, 3) * sp.HadamardProduct(5 * X, -2 * Y)
    (hoisted,) = hoist_hadamard_scalars([Assignment(MatrixSymbol("Z", n, m), value)])
    coeff = hoisted.value.args[0]
    assert coeff == sp.Rational(-10, 3) and isinstance(hoisted.value.args[1], sp.HadamardProduct)
    x, y = rng.standard_normal((n, m)), rng.standard_normal((n, m))
    np.testing.assert_allclose(evaluate(hoisted.value, X=x, Y=y), evaluate(value, X=x, Y=y), rtol=1e-14)


def test_an_entrywise_node_the_backward_reads_becomes_a_forward_value():
    # A = 30 tanh(S/30), dS = dA ⊙ (𝟏𝟏ᵀ − tanh(S/30)^∘2) → T = tanh(S/30), A = 30 T, dS = dA ⊙ (𝟏𝟏ᵀ − T^∘2)
    s, a, d_a = MatrixSymbol("S", n, n), MatrixSymbol("A", n, n), MatrixSymbol("dA", n, n)
    t = sa.tanh(s / 30)
    forward = [Assignment(a, 30 * t)]
    backward = [Assignment(MatrixSymbol("dS", n, n), sp.HadamardProduct(d_a, OneMatrix(n, n) - sp.HadamardPower(t, 2)))]
    forward, backward = save_entrywise_outputs(forward, backward)
    assert [str(f.target) for f in forward] == ["T", "A"] and forward[0].value == t
    assert not backward[0].value.has(sa.tanh(s / 30))
    assert MatrixSymbol("T", n, n) in backward[0].value.atoms(MatrixSymbol)


def test_row_sums_are_never_named_after_a_value_in_use():
    rowsum = sa.rowsum(sp.HadamardProduct(X, Y))
    values = [Assignment(MatrixSymbol("Z", n, m), X - rowsum * OneMatrix(1, m))]
    named = name_row_sums(values, frozenset({"D"}))
    assert str(named[0].target) == "D1"
    assert str(name_row_sums(values)[0].target) == "D"


def test_ones_in_a_sum_print_as_a_scalar_in_the_inputs_dtype():
    printer = GeneratedNumPyPrinter()
    text = printer.doprint(OneMatrix(n, m) - sp.HadamardPower(X, 2))
    assert "ones" not in text and text.startswith("1 - ")
    assert "dtype=dtype" in printer.doprint(OneMatrix(n, m) * MatrixSymbol("W", m, m))


def test_softcapped_schedule_saves_the_tanh_output_not_the_scores():
    d, d_k = dim("n"), dim("d_k")
    q, k, v = MatrixSymbol("Q", d, d_k), MatrixSymbol("K", d, d_k), MatrixSymbol("V", d, d_k)
    s = q * k.T
    a = 30 * sa.tanh(s / (30 * sp.sqrt(d_k)))
    p = sa.softmax(a)
    spec = sa.Spec("softcap", "softcap", (q, k, v), p * v, (("S", s), ("A", a), ("P", p)))
    sched = schedule_spec(spec)
    saved = {str(getattr(x, "name", x)) for x in sched.saved}
    assert {"T", "P"} <= saved and "S" not in saved
    assert not any(b.value.has(sa.tanh(s / (30 * sp.sqrt(d_k)))) for b in sched.backward)


def test_products_print_in_the_cheapest_order_and_ones_as_sums(rng):
    # φ(Q) φ(K)ᵀ V: φ(Q) (φ(K)ᵀ V) costs n·d², (φ(Q) φ(K)ᵀ) V n²·d, which is less depends on n and d: ordered at
    # call time; A Bᵀ 𝟏𝟏ᵀ = A (Bᵀ 𝟏) 𝟏ᵀ, no n × d ones array
    size, d = dim("n"), dim("d_k")
    a, b, v = MatrixSymbol("A", size, d), MatrixSymbol("B", size, d), MatrixSymbol("V", size, d)
    printer = GeneratedNumPyPrinter()
    assert printer.doprint(a * b.T * v) == "chain(A, B.mT, V)"
    text = printer.doprint(a * b.T * OneMatrix(size, d))
    assert "ones" not in text and "B.mT.sum(axis=-1, keepdims=True)" in text
    x, y = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    namespace = {"np": np, "narrow_matmul": narrow_matmul, "A": x, "B": y, "d_k": 3}
    np.testing.assert_allclose(eval(text, namespace), x @ y.T @ np.ones((5, 3)), rtol=1e-13)


def test_reassociated_products_keep_their_value_and_take_the_cheap_order(rng):
    # A Bᵀ V = A (Bᵀ V) when n ≫ d: the nested product is what the value holds afterwards
    from symattn.codegen.schedule.passes import reassociate_products

    size, d = dim("n"), dim("d_k")
    a, b, v = MatrixSymbol("A", size, d), MatrixSymbol("B", size, d), MatrixSymbol("V", size, d)
    value = 3 * a * b.T * v
    (out,) = reassociate_products([Assignment(MatrixSymbol("Z", size, d), value)])
    assert sp.MatMul(b.T, v) in sp.preorder_traversal(out.value)
    x, y, z = (rng.standard_normal((5, 3)) for _ in range(3))
    got = sa.lambdify([a, b, v], out.value)(x, y, z)
    np.testing.assert_allclose(got, 3 * x @ y.T @ z, rtol=1e-13)


def test_one_entrywise_value_spelled_two_ways_is_computed_once():
    """Differential attention's dQ₁ and dK₁ both read (dD − D₃) ⊙ P₁; names put in by substitution left the
    sums in different orders (dD + t₁, t₁ + dD), so it was computed twice (and −D₃𝟏ᵀ materialised as t₁).
    Sorted before sharing, no two n × n entrywise products or sums of the backward are equal up to order."""
    from symattn.optimize.rewrites import sort_commutative
    from symattn.optimize.simplify import rewrite
    from symattn.specs.files import load_spec_file

    sched = schedule_spec(load_spec_file("examples/specs/differential_attention.py"))
    n = dim("n")
    square = [
        e
        for e in nodes(*(a.value for a in sched.backward))
        if isinstance(e, (sp.HadamardProduct, sp.MatAdd)) and e.shape == (n, n)
    ]
    canonical = [rewrite(e, (sort_commutative,)) for e in square]
    assert len(set(canonical)) == len(canonical)


def test_a_scaled_cotangent_read_only_by_products_is_never_an_array():
    """Temperature's S has the cotangent dS = τ dA, read by dK = dSᵀ Q and dQ = dS K: the VJP of S = Q Kᵀ runs
    on dA and τ multiplies its products, where the printer puts it on the n × d_k factor (dK = dAᵀ (τ Q))."""
    from symattn.specs.files import load_spec_file

    sched = schedule_spec(load_spec_file("examples/specs/temperature_attention.py"))
    values = {str(a.target): a.value for a in sched.backward}
    assert "dS" not in values and "dA" in values
    n = dim("n")
    square = [e for e in nodes(*values.values()) if getattr(e, "shape", None) == (n, n)]
    assert not [e for e in square if isinstance(e, sp.MatMul) and len([f for f in e.args if f.is_Matrix]) == 1]


def test_a_scaled_cotangent_runs_the_vjps_unscaled():
    """D = P₁ − λ P₂ gives P₂ the cotangent −λ dD. VJPs are linear in the cotangent, so P₂'s softmax VJP runs on
    dD and −λ multiplies what it gives: dQ₂ and dK₂ read one (dD − D₁𝟏ᵀ) ⊙ P₂, and no n × n value is a scalar
    multiple (the scalar lands on the n × d_k factor)."""
    from symattn.specs.files import load_spec_file

    sched = schedule_spec(load_spec_file("examples/specs/differential_attention.py"))
    n = dim("n")
    square = [e for e in nodes(*(a.value for a in sched.backward)) if getattr(e, "shape", None) == (n, n)]
    assert not [e for e in square if isinstance(e, sp.MatMul) and len([f for f in e.args if f.is_Matrix]) == 1]
    entrywise = [e for e in square if isinstance(e, sp.HadamardProduct)]
    assert len(entrywise) == 4  # P₁ ⊙ dD, P₁ ⊙ (dD − D₂𝟏ᵀ), P₂ ⊙ dD, P₂ ⊙ (dD − D₁𝟏ᵀ)


def test_no_backward_line_only_renames_a_value():
    """t = X (a shared value renamed D₁, f₂'s cotangent of G_X that is the direction X_v) is read as X: the only
    lines of the form t = X left are outputs, returned under their own names (dB = dA)."""
    from symattn.codegen.emit.second_order import second_order_schedule
    from symattn.codegen.schedule.build import schedule
    from symattn.codegen.schedule.passes import inline_aliases

    for first in (schedule("attention"), schedule("mha", extended=True)):
        _, second = second_order_schedule(first)
        for sched in (first, second):
            outputs = {t for _, t in (*sched.gradients, *sched.constant_gradients)}
            renames = [a for a in sched.backward if isinstance(a.value, MatrixSymbol) and a.target not in outputs]
            assert not renames, renames
    n = dim("n")
    X, Y, t, out = (MatrixSymbol(s, n, n) for s in ("X", "Y", "t", "out"))
    inlined = inline_aliases([Assignment(t, X.T), Assignment(out, t.T * Y + t)], {out})
    assert inlined == [Assignment(out, X * Y + X.T)]
