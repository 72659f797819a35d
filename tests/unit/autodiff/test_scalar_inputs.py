"""Trainable scalars: a SymPy Symbol in wrt gets its gradient, d(τS) = dτ·S + τ dS, so ∂f/∂τ = tr(Gᵀ ∂Y/∂τ)."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symattn as sa

n, d = sp.symbols("n d", positive=True, integer=True)
X, G = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("G", n, d)
tau, cap = sp.Symbol("tau", real=True), sp.Symbol("cap", positive=True)

CASES = {
    "temperature": sa.softmax(tau * X * X.T / sp.sqrt(d)) * X,
    "softcap": sa.softmax(cap * sa.tanh(X * X.T / cap)) * X,
    "scaled sum": tau**2 * X + sp.exp(tau) * sa.sigmoid(X),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scalar_gradient_matches_central_differences(name, rng):
    # ∂/∂s tr(Gᵀ Y(s)) ≈ (tr(Gᵀ Y(s + h)) − tr(Gᵀ Y(s − h))) / 2h
    y = CASES[name]
    (s,) = y.free_symbols & {tau, cap}
    grads = sa.grad(y, [X, s], cotangent=G)
    assert not isinstance(grads[s], sp.MatrixExpr)
    value = sa.lambdify([X, s], y)
    gradient = sa.lambdify([X, G, s], grads[s])
    x, g, point, h = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 3)), 1.3, 1e-6
    numeric = (np.sum(g * value(x, point + h)) - np.sum(g * value(x, point - h))) / (2 * h)
    assert np.sum(gradient(x, g, point)) == pytest.approx(numeric, rel=1e-7, abs=1e-9)


def test_a_scalar_the_expression_does_not_use_gets_zero():
    assert sa.grad(X * X.T, [tau])[tau] == 0
