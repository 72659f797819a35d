"""f₂ = Σ_i tr(V_iᵀ ∂tr(Gᵀ Y)/∂x_i) as a spec: its inputs, and its value against the first gradients."""

from __future__ import annotations

import numpy as np
import pytest

import symattn as sa
from symattn.errors import SymattnError
from symattn.specs.second_order import second_order_spec


def test_inputs_are_the_spec_s_then_g_then_one_direction_each():
    so = second_order_spec(sa.spec("self_attention"))
    assert so.spec.input_names == ("X", "W_Q", "W_K", "W_V", "G_out", "X_v", "W_Q_v", "W_K_v", "W_V_v")
    assert dict(so.directions) == {"X": "X_v", "W_Q": "W_Q_v", "W_K": "W_K_v", "W_V": "W_V_v"}
    assert so.spec.output.shape == (1, 1)


def test_f2_is_the_inner_product_of_the_directions_with_the_first_gradients():
    # f₂(x, G, V) = Σ_i <V_i, g_i(x, G)>, g_i from sa.grad of the spec's output
    s = sa.spec("attention")
    so = second_order_spec(s)
    rng = np.random.default_rng(0)
    n, m, d_k, d_v = 3, 4, 2, 5
    shapes = {"Q": (n, d_k), "K": (m, d_k), "V": (m, d_v), "G_out": (n, d_v)}
    values = {k: rng.standard_normal(v) for k, v in shapes.items()}
    values |= {f"{k}_v": rng.standard_normal(shapes[k]) for k in ("Q", "K", "V")}
    symbols = {str(x.name): x for x in so.spec.inputs}
    f2 = sa.lambdify(list(symbols.values()), so.spec.output)(*(values[k] for k in symbols))
    grads = sa.grad(s.output, list(s.inputs), cotangent=symbols["G_out"])
    want = 0.0
    for x in s.inputs:
        g = sa.lambdify(list(symbols.values()), grads[x])(*(values[k] for k in symbols))
        want += float(np.sum(values[f"{x.name}_v"] * g))
    assert float(np.asarray(f2).reshape(())) == pytest.approx(want, rel=1e-12)


def test_an_unknown_input_is_named():
    with pytest.raises(SymattnError, match="no input 'X'"):
        second_order_spec(sa.spec("attention"), ["X"])


def test_derive_order_2_verifies(capsys):
    from symattn.cli import main

    assert main(["derive", "attention", "--order", "2", "--wrt", "K", "--verify"]) == 0
    assert "all equalities agree" in capsys.readouterr().out
