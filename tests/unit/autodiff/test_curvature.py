"""The rules that make LayerNorm and GELU twice differentiable: GELU′ (exact and tanh forms) and rstd.

Each node's VJP rule (read off df = tr(Gᵀ dY)) and JVP rule (dY) are checked against central
differences of the node's own value, evaluated by lambdify in float64: ⟨Ā, D⟩ = ⟨G, dY[D]⟩ =
(⟨G, Y(A + εD)⟩ − ⟨G, Y(A − εD)⟩) / 2ε.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from symattn.autodiff.differentials import differential
from symattn.autodiff.vjp import vjp_rule
from symattn.lang.ops import GeluGrad, GeluTanhGrad, RowInvStd
from symattn.numeric.lambdify import lambdify

A = sp.MatrixSymbol("A", 3, 5)
NODES = {
    "GELU′": GeluGrad(A),
    "GELU_tanh′": GeluTanhGrad(A),
    "rstd": RowInvStd(A, sp.Rational(1, 100)),
}


@pytest.mark.parametrize("name", list(NODES))
def test_the_vjp_and_jvp_rules_match_central_differences(name):
    node = NODES[name]
    rng = np.random.default_rng(0)
    a, direction = rng.standard_normal(A.shape), rng.standard_normal(A.shape)
    g = rng.standard_normal(node.shape)
    G, D = sp.MatrixSymbol("G", *node.shape), sp.MatrixSymbol("D", *A.shape)
    value = lambdify([A], node)
    h = 1e-6
    expected = np.sum(g * (value(a + h * direction) - value(a - h * direction))) / (2 * h)

    ((arg, cotangent),) = vjp_rule(node)(node, G)
    assert arg == A
    vjp = np.sum(lambdify([A, G], cotangent)(a, g) * direction)
    jvp = np.sum(g * lambdify([A, D], differential(node, {A: D}))(a, direction))
    for got in (vjp, jvp):
        assert abs(got - expected) <= 1e-7 * max(1.0, abs(expected)), (name, got, expected)
