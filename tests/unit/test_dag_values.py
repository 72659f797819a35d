"""DagValues: values and differentials of expression DAGs node by node (issue 11: linear --verify)."""

from __future__ import annotations

import numpy as np
import sympy as sp

import symattn as sa
from symattn.autodiff.differentials import Differential
from symattn.lang.algebra import product, total
from symattn.numeric.dag import DagValues
from symattn.numeric.lambdify import lambdify


def _stack(layers: int):
    n, g = sp.Symbol("n"), sp.Symbol("g")
    x = sp.MatrixSymbol("X", n, g)
    y, weights = x, []
    for i in range(layers):
        w = sp.MatrixSymbol(f"W_{i}", g, g)
        weights.append(w)
        y = total(y, product(sa.softmax(product(y, sp.Transpose(y))), sa.tanh(product(y, w))))
    return x, weights, y


def test_values_match_the_compiled_tree():
    x, weights, y = _stack(3)
    rng = np.random.default_rng(1)
    values = {x: rng.standard_normal((4, 3)), **{w: rng.standard_normal((3, 3)) for w in weights}}
    expected = lambdify([x, *weights], y)(*values.values())
    got = DagValues(values, {"n": 4, "g": 3}).value(y)
    assert np.allclose(got, expected, rtol=1e-13, atol=1e-13)


def test_differential_matches_a_central_difference():
    x, weights, y = _stack(3)
    rng = np.random.default_rng(2)
    values = {x: rng.standard_normal((4, 3)), **{w: rng.standard_normal((3, 3)) for w in weights}}
    dw = sp.MatrixSymbol("dW", 3, 3)
    direction = rng.standard_normal((3, 3))
    dims = {"n": 4, "g": 3}
    got = DagValues({**values, dw: direction}, dims, {weights[0]: dw}).value(Differential(y))
    eps = 1e-6

    def at(sign: float) -> np.ndarray:
        return DagValues({**values, weights[0]: values[weights[0]] + sign * eps * direction}, dims).value(y)

    assert np.allclose(got, (at(1.0) - at(-1.0)) / (2 * eps), rtol=1e-6, atol=1e-7)


def test_a_constant_has_a_zero_differential():
    x, weights, _ = _stack(1)
    dx = sp.MatrixSymbol("dX", 4, 3)
    values = {x: np.ones((4, 3)), weights[0]: np.ones((3, 3)), dx: np.ones((4, 3))}
    assert not np.any(DagValues(values, {"n": 4, "g": 3}, {x: dx}).value(Differential(weights[0])))
