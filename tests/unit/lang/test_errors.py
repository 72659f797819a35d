"""Bad input gets symattn's own errors, naming what was wrong; edge cases of grad's contract."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import HadamardProduct, MatrixSymbol, Trace, ZeroMatrix

import symattn as sa
from symattn.specs import dim

n, d = dim("n"), dim("d")
X = MatrixSymbol("X", n, d)
S = MatrixSymbol("S", n, n)
A = MatrixSymbol("A", n, n)
u, v = MatrixSymbol("u", n, 1), MatrixSymbol("v", n, 1)

UNSUPPORTED = [
    (Trace(sp.Inverse(S) * A), S, "Inverse"),
    (Trace(sp.DiagMatrix(u) * A), u, "DiagMatrix"),
    (sp.sin(Trace(S)), S, "sin"),
]


@pytest.mark.parametrize(("expr", "wrt", "name"), UNSUPPORTED, ids=[c[2] for c in UNSUPPORTED])
def test_an_unsupported_node_is_named_with_the_supported_ones(expr, wrt, name):
    with pytest.raises(sa.UnsupportedNodeError, match=name) as caught:
        sa.grad(expr, wrt)
    supported = str(caught.value).split("supported:")[1]
    for rule in ("MatMul", "MatAdd", "HadamardProduct", "RowSoftmax", "Trace", "Transpose", "Exp", "SplitHeads"):
        assert rule in supported


@pytest.mark.parametrize("power", [-1, sp.Rational(1, 2)])
def test_a_matrix_power_that_is_not_a_positive_integer_is_unsupported(power):
    with pytest.raises(sa.UnsupportedNodeError, match=r"MatPow|Inverse"):
        sa.grad(Trace(sp.MatPow(S, power) * A), S)


@pytest.mark.parametrize("run", [lambda e: sa.grad(e, X), lambda e: sa.lambdify([X], e)], ids=["grad", "lambdify"])
def test_x_times_x_with_x_not_square_names_both_shapes(run):
    # SymPy silently turns X*X into MatPow(X, 2) even when X is n × d.
    expr = X * X
    assert isinstance(expr, sp.MatPow)
    with pytest.raises(sa.ShapeMismatchError, match=r"X\*X.*: \(n, d\) and \(n, d\)"):
        run(expr)


@pytest.mark.parametrize("run", [lambda e: sa.grad(e, X), lambda e: sa.lambdify([X], e)], ids=["grad", "lambdify"])
def test_hadamard_of_x_and_its_transpose_names_both_shapes(run):
    # SymPy accepts HadamardProduct(X, Xᵀ) with symbolic n ≠ d.
    with pytest.raises(sa.ShapeMismatchError, match=r"\(n, d\).*\(d, n\)"):
        run(HadamardProduct(X, X.T))


def test_hadamard_constructor_checks_shapes():
    with pytest.raises(sa.ShapeMismatchError, match=r"\(n, d\).*\(n, n\)"):
        sa.hadamard(X, S)


@pytest.mark.parametrize(
    "expr",
    [Trace(X), sp.MatAdd(X, X.T), MatrixSymbol("Y", d, d) * X * X.T],
    ids=["trace of non-square", "sum of n×d and d×n", "product d×d by n×d"],
)
def test_other_shape_mismatches(expr):
    with pytest.raises(sa.ShapeMismatchError, match=r"\(n, d\)|\(d, d\)"):
        sa.grad(expr, X)


def test_heads_must_divide_the_columns():
    z = MatrixSymbol("Z", n, 5)
    with pytest.raises(sa.ShapeMismatchError, match="2 heads"):
        sa.grad(sa.split_heads(z, 2), z)


def test_a_symbol_absent_from_the_expression_gets_a_zero_matrix_of_its_shape():
    grads = sa.grad(Trace(S), [S, X])
    assert grads[X] == ZeroMatrix(n, d)
    assert grads[S] == sp.Identity(n)


@pytest.mark.parametrize("bad", [S * A, n, sp.Matrix([[1]])], ids=["product", "scalar symbol", "explicit matrix"])
def test_wrt_must_hold_matrix_symbols(bad):
    with pytest.raises(sa.SymattnError, match="MatrixSymbol"):
        sa.grad(Trace(S), [S, bad])


@pytest.mark.parametrize("cotangent", [MatrixSymbol("G", n, d), MatrixSymbol("G", d, n), sp.Integer(1)])
def test_a_cotangent_of_the_wrong_shape_is_refused(cotangent):
    with pytest.raises(sa.ShapeMismatchError, match=r"\(n, n\)"):
        sa.grad(S * A, S, cotangent=cotangent)


def test_a_scalar_expression_gives_the_gradient_of_itself():
    # tr(S A): d/dS = Aᵀ; sum(X): 𝟏𝟏ᵀ; uᵀv (a 1 × 1 product): d/du = v, d/dv = u.
    assert sa.grad(Trace(S * A), S)[S] == A.T
    assert sa.grad(sa.sum(X), X)[X] == sp.OneMatrix(n, d)
    assert sa.grad(u.T * v, [u, v]) == {u: v, v: u}


def test_lambdify_refuses_arrays_of_the_wrong_shape():
    y = MatrixSymbol("Y", d, n)
    f = sa.lambdify([X, y], X * y)
    with pytest.raises(sa.ShapeMismatchError, match="X, Y"):
        f(np.ones((2, 3)), np.ones((4, 2)))
    with pytest.raises(sa.ShapeMismatchError, match="at least 2 axes"):
        f(np.ones(3), np.ones((3, 2)))


def test_lambdify_refuses_a_missing_argument_and_an_unknown_backend():
    with pytest.raises(sa.SymattnError, match="X"):
        sa.lambdify([S], S * X)
    with pytest.raises(sa.SymattnError, match="jax"):
        sa.lambdify([X], X, backend="jax")


def test_a_bad_spec_option_is_a_symattn_error():
    with pytest.raises(sa.SymattnError, match="num_heads"):
        sa.spec("mha", num_heads=0)
    with pytest.raises(sa.SymattnError, match="mha"):
        sa.spec("mha", heads=2)
