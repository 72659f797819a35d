"""A float additive attn_mask is an input like any other: it receives its gradient.

∂f/∂attn_mask = ∂f/∂A (A = scale·Q Kᵀ + M), summed over the axes the mask was broadcast along
(batch, heads), as torch autograd sums them; torch modules give it when the mask requires grad,
NumPy backwards under "attn_mask". Boolean masks stay constants.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch autograd is the reference")

from mha_reference import max_error, reference_mha  # noqa: E402
from symattn.generated import (  # noqa: E402
    attention_numpy,
    attention_torch,
    mha_numpy,
    mha_torch,
    transformer_block_torch,
)

B, N, M, H, D_K = 2, 5, 6, 2, 3
D = H * D_K
TOL = 1e-10
F64 = torch.float64
SHAPES = {"shared": (N, M), "batched": (B, N, M)}


def _bias(shape, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64, requires_grad=True)


def _future():
    return torch.zeros(N, M, dtype=F64).masked_fill(torch.ones(N, M, dtype=torch.bool).triu(1), -torch.inf)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_attention_mask_gradient_matches_autograd(shape, causal):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, r, c, generator=gen, dtype=F64, requires_grad=True) for r, c in ((N, 4), (M, 4), (M, 3)))
    bias = _bias(SHAPES[shape])
    scores = 0.7 * q @ k.mT + bias + (_future() if causal else 0)
    y_ref = torch.softmax(scores, dim=-1) @ v
    g = torch.randn_like(y_ref)
    want = torch.autograd.grad(y_ref, [q, k, v, bias], g)
    y = attention_torch.forward(q, k, v, scale=0.7, attn_mask=bias, causal=causal)
    got = torch.autograd.grad(y, [q, k, v, bias], g)
    for a, b in zip(got, want):
        assert max_error(a, b) < TOL
    arrays = [x.detach().numpy() for x in (q, k, v)]
    _, saved = attention_numpy.forward(*arrays, scale=0.7, attn_mask=bias.detach().numpy(), causal=causal)
    grads = attention_numpy.backward(saved, g.numpy())
    assert grads["attn_mask"].shape == SHAPES[shape]
    np.testing.assert_allclose(grads["attn_mask"], want[3].numpy(), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mha_mask_gradient_matches_nn_multihead_attention(shape):
    ref, w = reference_mha(D, H)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, r, D, generator=gen, dtype=F64, requires_grad=True) for r in (N, M, M))
    bias = _bias(SHAPES[shape])
    theirs = bias if shape == "shared" else bias.repeat_interleave(H, dim=0)  # nn.MHA: (B·H, n, m)
    y_ref, _ = ref(q, k, v, need_weights=False, attn_mask=theirs)
    g = torch.randn_like(y_ref)
    (want,) = torch.autograd.grad(y_ref, [bias], g)
    biases = {name: w[name] for name in ("b_Q", "b_K", "b_V", "b_O")}
    weights = [w[name] for name in ("W_Q", "W_K", "W_V", "W_O")]
    y = mha_torch.forward(q, k, v, *weights, num_heads=H, attn_mask=bias, **biases)
    (got,) = torch.autograd.grad(y, [bias], g)
    assert max_error(got, want) < TOL
    as_np = {name: t.detach().numpy() for name, t in w.items()}
    arrays = [x.detach().numpy() for x in (q, k, v)]
    _, saved = mha_numpy.forward(*arrays, num_heads=H, attn_mask=bias.detach().numpy(), **as_np)
    grads = mha_numpy.backward(saved, g.numpy())
    np.testing.assert_allclose(grads["attn_mask"], want.numpy(), rtol=TOL, atol=TOL)


def test_transformer_block_mask_gradient_passes_gradcheck():
    gen = torch.Generator().manual_seed(2)
    d_ff, n = 5, 3
    shapes = {"X": (2, n, 4), "W_Q": (4, 4), "W_K": (4, 4), "W_V": (4, 4), "W_O": (4, 4), "gamma_1": (1, 4)}
    shapes |= {"beta_1": (1, 4), "gamma_2": (1, 4), "beta_2": (1, 4), "W_1": (4, d_ff), "W_2": (d_ff, 4)}
    inputs = {name: torch.randn(*s, generator=gen, dtype=F64) for name, s in shapes.items()}
    bias = torch.randn(n, n, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda m: transformer_block_torch.forward(**inputs, num_heads=2, attn_mask=m, causal=True), (bias,)
    )


def test_a_bool_mask_stays_a_constant_and_a_mask_without_grad_gets_none():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((N, 4)), rng.standard_normal((M, 4)), rng.standard_normal((M, 3))
    _, saved = attention_numpy.forward(q, k, v, attn_mask=rng.standard_normal((N, M)) < -1.5)
    assert set(attention_numpy.backward(saved, np.ones((N, 3)))) == {"Q", "K", "V"}
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    fixed = torch.randn(N, M, dtype=F64)  # a float mask that does not require grad: no gradient, no error
    attention_torch.forward(*leaves, attn_mask=fixed).sum().backward()
    assert fixed.grad is None and all(t.grad is not None for t in leaves)


def test_memory_efficient_torch_modules_refuse_a_mask_that_requires_grad():
    # blocks of query rows give the mask no gradient: a clear error, never a silent None
    from symattn.generated import attention_torch_memeff, mha_torch_memeff

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, r, D, generator=gen, dtype=F64) for r in (N, M, M))
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        attention_torch_memeff.forward(q, k, v, attn_mask=_bias((N, M)))
    weights = [torch.randn(D, D, generator=gen, dtype=F64) for _ in range(4)]
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        mha_torch_memeff.forward(q, k, v, *weights, num_heads=H, attn_mask=_bias((N, M)))
    assert attention_torch_memeff.forward(q, k, v, attn_mask=_bias((N, M)).detach()).shape == (B, N, D)
