"""Grouped-query and multi-query attention (num_kv_heads): the RepeatHeads / SumGroups nodes, the mha spec
with W_K, W_V of d_model × H_kv·d_k, and the generated modules against
scaled_dot_product_attention(..., enable_gqa=True) on the heads, in float64."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.errors import SymattnError
from symattn.lang.ops import RepeatHeads, SumGroups, split_heads

torch = pytest.importorskip("torch", reason="torch is the reference for the generated modules")

from mha_reference import max_error  # noqa: E402
from symattn.generated import mha_numpy, mha_torch  # noqa: E402

B, N, M, D_K = 2, 4, 5, 3


def _inputs(heads: int, kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d = heads * D_K

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    return [
        rand(B, N, d),
        rand(B, M, d),
        rand(B, M, d),
        rand(d, d),
        rand(d, kv_heads * D_K),
        rand(d, kv_heads * D_K),
        rand(d, d),
    ]


def _reference(q, k, v, w_q, w_k, w_v, w_o, heads, kv_heads, causal):
    """Projections, then SDPA with enable_gqa on the heads, then the output projection."""

    def split(x, h):
        return x.reshape(*x.shape[:-1], h, D_K).transpose(-2, -3)

    o = torch.nn.functional.scaled_dot_product_attention(
        split(q @ w_q, heads), split(k @ w_k, kv_heads), split(v @ w_v, kv_heads), is_causal=causal, enable_gqa=True
    )
    return o.transpose(-2, -3).reshape(*q.shape[:-1], heads * D_K) @ w_o


@pytest.mark.parametrize(("heads", "kv_heads", "causal"), [(4, 2, False), (4, 2, True), (3, 1, True), (2, 2, False)])
def test_gqa_matches_sdpa_with_enable_gqa(heads, kv_heads, causal):
    args = _inputs(heads, kv_heads)
    y = mha_torch.forward(*args, num_heads=heads, num_kv_heads=kv_heads, causal=causal)
    y_ref = _reference(*args, heads, kv_heads, causal)
    assert max_error(y, y_ref) < 1e-10
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, args, g), torch.autograd.grad(y_ref, args, g)):
        assert max_error(a, b) < 1e-10


def test_numpy_gqa_matches_torch():
    args = _inputs(4, 2, seed=1)
    y = mha_torch.forward(*args, num_heads=4, num_kv_heads=2)
    g = torch.randn_like(y)
    expected = torch.autograd.grad(y, args, g)
    out, saved = mha_numpy.forward(*(a.detach().numpy() for a in args), num_heads=4, num_kv_heads=2)
    grads = mha_numpy.backward(saved, g.numpy())
    assert np.max(np.abs(out - y.detach().numpy())) < 1e-10
    for name, want in zip(("Q", "K", "V", "W_Q", "W_K", "W_V", "W_O"), expected):
        assert grads[name].shape == want.shape and np.max(np.abs(grads[name] - want.numpy())) < 1e-10, name


def test_gqa_gradcheck_with_biases():
    gen = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    args = [rand(3, 4), rand(4, 4), rand(4, 4), rand(4, 4), rand(4, 2), rand(4, 2), rand(4, 4), rand(1, 2), rand(1, 2)]

    def f(q, k, v, w_q, w_k, w_v, w_o, b_k, b_v):
        return mha_torch.forward(
            q, k, v, w_q, w_k, w_v, w_o, num_heads=2, num_kv_heads=1, b_K=b_k, b_V=b_v, causal=True
        )

    assert torch.autograd.gradcheck(f, args)


def test_num_kv_heads_must_divide_num_heads():
    with pytest.raises(SymattnError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        sa.spec("mha", num_heads=4, num_kv_heads=3)
    with pytest.raises(SymattnError, match="num_kv_heads must be a positive integer"):
        sa.spec("mha", num_heads=4, num_kv_heads=0)
    args = [a.detach() for a in _inputs(4, 2)]
    with pytest.raises(ValueError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        mha_torch.forward(*args, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        mha_numpy.forward(*(a.numpy() for a in args), num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"W_K: expected shape \(H \* d_k, H_kv \* d_k\)"):
        mha_torch.forward(*args, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="does not divide"):
        mha_torch.MultiHeadAttention(12, num_heads=4, num_kv_heads=3)


def test_module_with_kv_heads_has_narrow_key_and_value_weights():
    layer = mha_torch.MultiHeadAttention(12, num_heads=4, num_kv_heads=2, dtype=torch.float64)
    assert layer.W_K.shape == (12, 6) and layer.W_V.shape == (12, 6) and layer.W_Q.shape == (12, 12)
    q = torch.randn(2, 3, 12, dtype=torch.float64)
    assert layer(q, q, q).shape == (2, 3, 12)


def test_gqa_derivation_verifies_and_prints_the_head_groups():
    d = sa.derive("mha", num_heads=4, num_kv_heads=2)
    d_k = sp.Symbol("d_k", positive=True, integer=True)
    assert d.spec.input("W_K").shape == (4 * d_k, 2 * d_k) and d.spec.input("W_Q").shape == (4 * d_k, 4 * d_k)
    assert d.verify(["W_K", "V"]).ok
    text = d.text("W_K")
    assert "Rep(" in text and "GroupSum(" in text
    assert r"\operatorname{GroupSum}" in d.latex("W_V")


def test_repeat_and_group_sum_are_adjoint_in_numpy_and_exact_backends(rng):
    n, k = sp.symbols("n k", positive=True, integer=True)
    a = sp.MatrixSymbol("A", n, 2 * k)
    g = sp.MatrixSymbol("G", n, k)
    rep = RepeatHeads(split_heads(a, 2), 2, 6)
    lhs = sa.lambdify([a, g], sa.sum(sp.HadamardProduct(g, rep)))
    x, y = rng.normal(size=(3, 4)), rng.normal(size=(6, 3, 2))
    repeated = np.repeat(np.swapaxes(x.reshape(3, 2, 2), 0, 1), 3, axis=0)
    assert np.allclose(np.sum(lhs(x, y)), np.sum(y * repeated))  # one sum per head, then over the heads
    back = sa.lambdify([g], SumGroups(g, 2, 6))(y)
    assert np.allclose(back, y.reshape(2, 3, 3, 2).sum(axis=1))
    exact = sa.lambdify([g], SumGroups(g, 2, 6), backend="exact")(np.arange(36).reshape(6, 3, 2).astype(object))
    assert exact.shape == (2, 3, 2) and exact[0, 0, 0] == 0 + 6 + 12
