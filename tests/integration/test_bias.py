"""Projection biases b_Q, b_K, b_V, b_O in mha (Q W_Q + 𝟏 b_Q, …): derived, printed, verified, generated,
and matched against torch.nn.MultiheadAttention(bias=True) in float64, outputs and every gradient."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symattn as sa

torch = pytest.importorskip("torch", reason="torch is the reference for the generated modules")

from mha_reference import max_error, reference_gradients, reference_mha  # noqa: E402
from symattn.generated import mha_numpy, mha_torch  # noqa: E402

B, N, M, H, D_K = 3, 4, 5, 3, 2
D = H * D_K
NAMES = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")


def _tokens(seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, r, D, generator=gen, dtype=torch.float64, requires_grad=True) for r in (N, M, M)]


def _call(q, k, v, w):
    biases = {name: w[name] for name in NAMES[4:]}
    return mha_torch.forward(q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], num_heads=H, **biases)


def test_mha_with_biases_matches_nn_multihead_attention():
    ref, w = reference_mha(D, H, seed=4)
    q, k, v = _tokens()
    y = _call(q, k, v, w)
    y_ref, _ = ref(q, k, v, need_weights=False)
    assert max_error(y, y_ref) < 1e-10
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, [q, k, v, *(w[n] for n in NAMES)], g)
    params = [ref.in_proj_weight, ref.in_proj_bias, ref.out_proj.weight, ref.out_proj.bias]
    expected = torch.autograd.grad(y_ref, [q, k, v, *params], g)
    want = reference_gradients(ref, expected[3:])
    for a, b in zip(got[:3], expected[:3]):
        assert max_error(a, b) < 1e-10
    for name, a in zip(NAMES, got[3:]):
        assert max_error(a, want[name]) < 1e-10, name


def test_bias_gradients_are_column_sums_over_tokens_and_batch():
    _, w = reference_mha(D, H, seed=5)
    q, k, v = _tokens()
    y = _call(q, k, v, w)
    g = torch.randn_like(y)
    (db_o,) = torch.autograd.grad(y, [w["b_O"]], g)
    assert torch.allclose(db_o, g.sum(dim=(0, 1))[None], rtol=1e-12, atol=1e-12)


def test_numpy_biases_match_torch_and_finite_differences(rng):
    _, w = reference_mha(D, H, seed=6)
    q, k, v = _tokens()
    y = _call(q, k, v, w)
    g = torch.randn_like(y)
    expected = dict(zip(NAMES, torch.autograd.grad(y, [w[n] for n in NAMES], g)))
    arrays = {name: x.detach().numpy() for name, x in w.items()}
    tokens = [x.detach().numpy() for x in (q, k, v)]
    out, saved = mha_numpy.forward(*tokens, num_heads=H, **{n: arrays[n] for n in NAMES})
    grads = mha_numpy.backward(saved, g.numpy())
    assert np.max(np.abs(out - y.detach().numpy())) < 1e-10
    assert set(grads) == {"Q", "K", "V", *NAMES}
    for name in NAMES:
        assert np.max(np.abs(grads[name] - expected[name].numpy())) < 1e-10, name
    direction, eps = rng.normal(size=(1, D)), 1e-6

    def f(sign: float) -> float:
        moved = {**arrays, "b_Q": arrays["b_Q"] + sign * eps * direction}
        return float(np.sum(g.numpy() * mha_numpy.forward(*tokens, num_heads=H, **moved)[0]))

    assert abs((f(1) - f(-1)) / (2 * eps) - np.sum(grads["b_Q"] * direction)) < 1e-6


def test_without_biases_the_gradients_are_the_seven_of_the_contract():
    _, w = reference_mha(D, H)
    tokens = [x.detach().numpy() for x in _tokens()]
    weights = [w[n].detach().numpy() for n in NAMES[:4]]
    out, saved = mha_numpy.forward(*tokens, *weights, num_heads=H)
    assert set(mha_numpy.backward(saved, np.ones(out.shape))) == {"Q", "K", "V", "W_Q", "W_K", "W_V", "W_O"}


def test_gradcheck_with_some_biases():
    gen = torch.Generator().manual_seed(8)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    q, k, v = rand(3, 4), rand(5, 4), rand(5, 4)
    w_q, w_k, w_v, w_o = (rand(4, 4) for _ in range(4))
    b_k, b_o = rand(1, 4), rand(1, 4)

    def f(*args):
        return mha_torch.forward(*args[:7], num_heads=2, b_K=args[7], b_O=args[8])

    assert torch.autograd.gradcheck(f, (q, k, v, w_q, w_k, w_v, w_o, b_k, b_o))


def test_module_with_bias_holds_zero_biases_and_matches_the_function():
    layer = mha_torch.MultiHeadAttention(D, num_heads=H, bias=True, dtype=torch.float64)
    assert all(torch.equal(getattr(layer, n), torch.zeros(1, D, dtype=torch.float64)) for n in NAMES[4:])
    assert mha_torch.MultiHeadAttention(D, num_heads=H).b_Q is None
    assert len(list(layer.parameters())) == 8
    with torch.no_grad():
        layer.b_O.normal_()
    q, k, v = (x.detach() for x in _tokens())
    expected = _call(q, k, v, {n: getattr(layer, n) for n in NAMES})
    assert torch.equal(layer(q, k, v), expected)


def test_bias_derivation_verifies_and_reads_column_sums():
    d = sa.derive("mha", num_heads=2, bias=True)
    assert d.verify(["b_Q", "b_V", "b_O"]).ok
    s = d.spec
    g = sp.MatrixSymbol("G", *s.output.shape)
    n, d_model = s.output.shape
    assert sp.simplify(d.gradients["b_O"] - sp.OneMatrix(1, n) * g) == sp.ZeroMatrix(1, d_model)
    assert s.input_names[-4:] == ("b_Q", "b_K", "b_V", "b_O")
    assert sa.spec("mha").input_names == ("Q", "K", "V", "W_Q", "W_K", "W_V", "W_O")
