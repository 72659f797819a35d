"""Simplified gradients of the built-in specs: still right, cheaper, FlashAttention's D found."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul, OneMatrix, Transpose

import symattn as sa
from symattn.lang.ops import Exp, RowSoftmax, RowSum
from symattn.numeric.verify import random_dims, vjp_error
from symattn.optimize.cost import flops, flops_value, subexpressions
from symattn.optimize.simplify import simplify, simplify_all

SPECS = [("attention", {}), ("self_attention", {}), ("mha", {}), ("mha", {"num_heads": 2})]


def row_sums_of(expr, factor) -> list:
    """rowsum(F ⊙ factor) nodes in expr."""
    return [
        s
        for s in subexpressions([expr])
        if isinstance(s, RowSum) and isinstance(s.arg, HadamardProduct) and factor in s.arg.args
    ]


@pytest.fixture(scope="module")
def simplified() -> dict:
    """(derivation, simplified forward, {name: simplified gradient}) per spec, simplified jointly."""
    out = {}
    for name, options in SPECS:
        d = sa.derive(name, **options)
        forward, *grads = simplify_all([d.spec.output, *d.gradients.values()])
        out[(name, tuple(options.items()))] = (d, forward, dict(zip(d.gradients, grads)))
    return out


@pytest.mark.parametrize(("name", "options"), SPECS)
def test_simplified_gradients_pass_the_vjp_check(name, options, simplified, rng):
    d, _, grads = simplified[(name, tuple(options.items()))]
    fixed = {"H": 2} if name == "mha" and not options else None
    dims = random_dims([d.spec.output], rng, fixed=fixed)
    for wrt, gradient in grads.items():
        error = vjp_error(d.spec.output, d.spec.input(wrt), gradient, dims, rng)
        assert error < 1e-6, f"{name} d{wrt}: {error}"


@pytest.mark.parametrize(("name", "options"), SPECS)
def test_each_gradient_simplified_alone_passes_the_vjp_check(name, options, rng):
    d = sa.derive(name, **options)
    fixed = {"H": 2} if name == "mha" and not options else None
    dims = random_dims([d.spec.output], rng, fixed=fixed)
    for wrt, gradient in d.gradients.items():
        for given in ((), (d.spec.output,)):
            simple = simplify(gradient, given=given)
            assert vjp_error(d.spec.output, d.spec.input(wrt), simple, dims, rng) < 1e-6
            # together with the forward it is given (simplified alongside it), it costs no more
            together = simplify_all([*given, gradient])
            assert flops_value(together) <= flops_value([*given, gradient])


@pytest.mark.parametrize(("name", "options"), SPECS)
def test_simplified_spec_costs_fewer_flops(name, options, simplified):
    d, forward, grads = simplified[(name, tuple(options.items()))]
    derived = flops_value([d.spec.output, *d.gradients.values()])
    assert flops_value([forward, *grads.values()]) < derived


@pytest.mark.parametrize(("name", "options"), SPECS)
def test_rowsum_of_dp_times_p_becomes_rowsum_of_do_times_o(name, options, simplified):
    # rowsum(dP ⊙ P) = rowsum(dO ⊙ O): every row sum left in the backward runs over an n × d_v product
    # with the forward's (per-head) output O, never over an n × m matrix
    _, forward, grads = simplified[(name, tuple(options.items()))]
    o = next(s for s in subexpressions([forward]) if isinstance(s, MatMul) and isinstance(s.args[0], RowSoftmax))
    for wrt in ("Q", "K", "X"):
        if wrt in grads:
            sums = [s for s in subexpressions([grads[wrt]]) if isinstance(s, RowSum)]
            assert sums and sums == row_sums_of(grads[wrt], o), f"{name} d{wrt}: {sums}"


def test_attention_gradient_simplified_with_the_forward_given_uses_o():
    d = sa.derive("attention")
    output = simplify(d.spec.output)
    dq = simplify(d.gradients["Q"], given=[d.spec.output])
    sums = [s for s in subexpressions([dq]) if isinstance(s, RowSum)]
    assert len(sums) == 1 and set(sums[0].arg.args) == {MatrixSymbol("G", *output.shape), output}
    # n·d_v work for the row sum instead of n·m, and one n·m·d_v product fewer for Q and K together
    assert flops_value(dq, given=[output]) < flops_value(d.gradients["Q"], given=[d.spec.output])


def test_attention_forward_and_backward_cost_twelve_n_squared_d():
    d = sa.derive("attention")
    exprs = simplify_all([d.spec.output, *d.gradients.values()])
    n, dk, dv, m = sp.symbols("n d_k d_v m", positive=True, integer=True)
    dd = sp.Symbol("d", positive=True, integer=True)
    total = sp.expand(flops(exprs).xreplace({m: n, dk: dd, dv: dd}))
    assert sp.Poly(total, n, dd).coeff_monomial(n**2 * dd) == 12
    assert sp.degree(total - 12 * n**2 * dd, n) <= 2 and sp.Poly(total - 12 * n**2 * dd, n, dd).total_degree() <= 2


def test_k_gradient_reuses_the_q_gradients_ds():
    # dK = c dSᵀ Q shares dS = P ⊙ (dP − D 𝟏ᵀ) with dQ = c dS K
    d = sa.derive("attention")
    _, dq, dk, _ = simplify_all([d.spec.output, *d.gradients.values()])
    shared = set(subexpressions([dq])) & {t.arg for t in subexpressions([dk]) if isinstance(t, Transpose)}
    assert any(isinstance(s, HadamardProduct) for s in shared)


def test_simplify_is_idempotent_on_spec_gradients(simplified):
    for d, forward, grads in simplified.values():
        exprs = [forward, *grads.values()]
        assert simplify_all(exprs) == exprs, d.spec.name


# Random expressions: simplification keeps the value and never adds FLOPs.

N = sp.Symbol("n", positive=True, integer=True)
LEAVES = [MatrixSymbol(s, N, N) for s in ("A", "B", "C")]


def random_expression(rng: np.random.Generator, depth: int):
    if depth == 0 or rng.random() < 0.2:
        leaf = LEAVES[rng.integers(len(LEAVES))]
        return Transpose(leaf) if rng.random() < 0.3 else leaf
    a, b = random_expression(rng, depth - 1), random_expression(rng, depth - 1)
    kind = rng.integers(8)
    return [
        lambda: MatMul(a, b),
        lambda: MatAdd(a, b),
        lambda: HadamardProduct(a, b),
        lambda: Transpose(a),
        lambda: MatMul(sp.Rational(int(rng.integers(1, 4)), 2), a),
        lambda: MatMul(RowSum(HadamardProduct(a, b)), OneMatrix(1, N)),
        lambda: HadamardProduct(Exp(HadamardProduct(a, MatMul(sp.Rational(1, 10), b))), OneMatrix(N, N)),
        lambda: MatMul(a, OneMatrix(N, N)),
    ][kind]()


@pytest.mark.parametrize("seed", range(40))
def test_random_expressions_keep_their_value_and_cost(seed):
    rng = np.random.default_rng(seed)
    expr = random_expression(rng, 4)
    simple = simplify(expr)
    f, g = sa.lambdify(LEAVES, expr), sa.lambdify(LEAVES, simple)
    values = [rng.standard_normal((4, 4)) for _ in LEAVES]
    expected = np.broadcast_to(f(*values), (4, 4))
    np.testing.assert_allclose(np.broadcast_to(g(*values), (4, 4)), expected, rtol=1e-10, atol=1e-10)
    assert flops_value(simple) <= flops_value(expr)


def test_a_sharing_spelled_out_in_the_input_is_never_lost():
    # (A B) C + (A B) D computes A B once; flattening to A B C + A B D must not make it costlier
    a, b = MatrixSymbol("A", N, 3 * N), MatrixSymbol("B", 3 * N, N)
    c, d = MatrixSymbol("C", N, 1), MatrixSymbol("D", N, 1)
    ab = MatMul(a, b)
    expr = MatAdd(MatMul(ab, c), MatMul(ab, d))
    assert flops_value(simplify(expr)) <= flops_value(expr)


def test_scalar_expressions_are_simplified_inside_sums_and_products(rng):
    # 2 tr(A B Aᵀ) + sum(A B) = 2 sum(A ⊙ A Bᵀ) + sum(A rowsum(B)): one n³ product instead of three
    a, b = LEAVES[0], LEAVES[1]
    expr = 2 * sp.Trace(MatMul(a, b, Transpose(a))) + sa.sum(MatMul(a, b))
    simple = simplify(expr)
    assert flops_value(simple) < flops_value(expr)
    values = [rng.standard_normal((5, 5)) for _ in LEAVES]
    expected = sa.lambdify(LEAVES, expr)(*values)
    np.testing.assert_allclose(sa.lambdify(LEAVES, simple)(*values), expected, rtol=1e-12)
