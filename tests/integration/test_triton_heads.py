"""The Triton module of the built-in mha under Triton's interpreter (CPU float32 tensors, partial blocks): heads split
from d_model = H·d_k, grouped-query heads, optional biases, the mask in its position or by attn_mask, and
key_padding_mask; forward, every gradient and jvp against an independent eager float64 forward, and the interface of
the generated torch module."""

from __future__ import annotations

import math

import pytest
from triton_rendered import M, N, attend, compare, torch, triton_module

B, D_K = 2, 8


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    return triton_module("mha", tmp_path_factory.mktemp("triton_heads"))


def _split(x, heads):
    """(B, rows, heads·d_k) → (B, heads, rows, d_k)."""
    return x.view(*x.shape[:-1], heads, D_K).transpose(-2, -3)


def _eager(x: dict, heads: int, kv_heads: int, additive, causal: bool):
    """Concat(head_1 … head_H) W_O (+ b_O), head h = softmax((Q W_Q)_h (K W_K)_g ᵀ / √d_k + M) (V W_V)_g with
    g = ⌊h / (H / H_kv)⌋, written from the formula (float64)."""

    def project(name, rows_heads):
        y = x[name] @ x[f"W_{name}"] + x.get(f"b_{name}", 0.0)
        return _split(y, rows_heads)

    q = project("Q", heads)
    k, v = (project(name, kv_heads).repeat_interleave(heads // kv_heads, dim=-3) for name in ("K", "V"))
    out = attend(q @ k.mT / math.sqrt(D_K) + additive, v, causal)
    return out.transpose(-2, -3).reshape(B, N, heads * D_K) @ x["W_O"] + x.get("b_O", 0.0)


def _inputs(heads: int, kv_heads: int, bias: bool, generator) -> dict:
    d_model, d_kv = heads * D_K, kv_heads * D_K
    shapes = {"Q": (B, N, d_model), "K": (B, M, d_model), "V": (B, M, d_model)}
    shapes |= {"W_Q": (d_model, d_model), "W_K": (d_model, d_kv), "W_V": (d_model, d_kv), "W_O": (d_model, d_model)}
    if bias:
        shapes |= {"b_Q": (d_model,), "b_K": (d_kv,), "b_V": (d_kv,), "b_O": (d_model,)}  # 1-D, as torch holds them
    return {
        k: (torch.randn(s, generator=generator) / (2 if k[0] in "Wb" else 1)).requires_grad_()
        for k, s in shapes.items()
    }


@pytest.mark.parametrize(
    "heads, kv_heads, bias, masks, causal",
    [(4, 2, True, "attn_mask+padding", False), (2, 2, False, "float M", True)],
    ids=["gqa-bias-bool-padding", "float-mask-causal"],
)
def test_mha_matches_an_eager_multi_head_forward(heads, kv_heads, bias, masks, causal, mha):
    generator = torch.Generator().manual_seed(31)
    inputs = _inputs(heads, kv_heads, bias, generator)
    if masks == "float M":
        given = {"M": torch.randn((B, 1, N, M), generator=generator)}  # torch's layout: a heads axis of size 1
        additive = given["M"]
    else:
        attn_mask = torch.rand((B, N, M), generator=generator) < 0.2
        padding = torch.zeros((B, M), dtype=torch.bool)
        padding[:, -5:] = True
        given = {"attn_mask": attn_mask, "key_padding_mask": padding}
        hidden = attn_mask | padding[:, None, :]
        hidden[..., 0] = False  # a key for every row: no row all masked
        given["attn_mask"] = hidden & ~padding[:, None, :]
        additive = torch.zeros(hidden.shape).masked_fill(hidden, -math.inf).unsqueeze(1)
    options = {"num_heads": heads, "num_kv_heads": kv_heads, "causal": causal}
    out = mha.forward(*inputs.values(), **given, **options)
    cotangent = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, list(inputs.values()), cotangent)
    double = {k: x.detach().double().requires_grad_() for k, x in inputs.items()}
    want = _eager(double, heads, kv_heads, additive.double(), causal)
    compare(out, want, "mha forward")
    for name, got, expected in zip(inputs, grads, torch.autograd.grad(want, list(double.values()), cotangent.double())):
        assert got.shape == inputs[name].shape
        # db_K is identically zero (softmax is shift-invariant): a sum of B·m roundoffs, to a looser bound
        compare(got, expected, f"mha d{name}", rtol=5e-4 if name == "b_K" else 5e-5)
    tangents = {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items()}
    primal, tangent = mha.jvp(
        *(x.detach() for x in inputs.values() if x.dim() > 1), tangents, **_keyword_rows(inputs), **given, **options
    )
    names = list(double)
    _, want_tangent = torch.func.jvp(
        lambda *xs: _eager(dict(zip(names, xs)), heads, kv_heads, additive.double(), causal),
        tuple(x.detach() for x in double.values()),
        tuple(tangents[k].double() for k in names),
    )
    assert torch.equal(primal, out.detach())
    compare(tangent, want_tangent, "mha jvp tangent", rtol=5e-5)


def _keyword_rows(inputs: dict) -> dict:
    """jvp takes the biases by keyword."""
    return {k: x.detach() for k, x in inputs.items() if k.startswith("b_")}


def test_mha_takes_the_torch_modules_arguments(mha):
    """The same call as the generated torch module's gives the same output; bad head counts are one-line errors."""
    from symattn.generated import mha_torch

    generator = torch.Generator().manual_seed(37)
    inputs = _inputs(4, 1, False, generator)
    padding = torch.rand((B, M), generator=generator) < 0.3
    padding[:, 0] = False
    ours = mha.forward(*inputs.values(), num_heads=4, num_kv_heads=1, key_padding_mask=padding)
    theirs = mha_torch.forward(*inputs.values(), num_heads=4, num_kv_heads=1, key_padding_mask=padding)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    with pytest.raises(ValueError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        mha.forward(*inputs.values(), num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="H\\*d_k = 32 is not a multiple of 5"):
        mha.forward(*inputs.values(), num_heads=5)
    with pytest.raises(TypeError, match="M and attn_mask are the same mask"):
        mha.forward(*inputs.values(), M=torch.zeros(N, M), attn_mask=torch.zeros(N, M), num_heads=4, num_kv_heads=1)


def test_a_transformer_block_around_the_core_matches_the_torch_module(tmp_path):
    """transformer_block (LayerNorms, heads, a GELU MLP and residuals around the one core, all torch code): forward,
    every gradient and jvp as the generated torch module gives them, with a key padding mask, causal."""
    from symattn.generated import transformer_block_torch as theirs

    heads, d_model, d_ff = 2, 2 * D_K, 24
    generator = torch.Generator().manual_seed(41)
    shapes = {"X": (B, N, d_model), **{f"W_{p}": (d_model, d_model) for p in "QKVO"}}
    shapes |= {name: (1, d_model) for name in ("gamma_1", "beta_1", "gamma_2", "beta_2")}
    shapes |= {"W_1": (d_model, d_ff), "W_2": (d_ff, d_model), "b_1": (1, d_ff)}
    inputs = {k: (torch.randn(s, generator=generator) / 2).requires_grad_() for k, s in shapes.items()}
    padding = torch.zeros((B, N), dtype=torch.bool)
    padding[:, -4:] = True
    ours = triton_module("transformer_block", tmp_path)
    given = {"b_1": inputs.pop("b_1"), "num_heads": heads, "key_padding_mask": padding, "causal": True}
    out, want = (module.forward(*inputs.values(), **given) for module in (ours, theirs))
    cotangent = torch.randn(out.shape, generator=generator)
    leaves = [*inputs.values(), given["b_1"]]
    for got, expected in zip(
        (out, *torch.autograd.grad(out, leaves, cotangent)), (want, *torch.autograd.grad(want, leaves, cotangent))
    ):
        assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    tangents = {k: torch.randn(x.shape, generator=generator) for k, x in (*inputs.items(), ("b_1", given["b_1"]))}
    plain = {k: x.detach() for k, x in inputs.items()}
    keywords = given | {"b_1": given["b_1"].detach()}
    _, tangent = ours.jvp(*plain.values(), tangents, **keywords)
    names = list(plain)
    _, want_tangent = torch.func.jvp(
        lambda *xs: theirs.forward(*xs[:-1], **(given | {"b_1": xs[-1]})),
        (*plain.values(), keywords["b_1"]),
        tuple(tangents[k] for k in [*names, "b_1"]),
    )
    assert (tangent - want_tangent).abs().max() <= 1e-4 * want_tangent.abs().max()


def test_a_mask_broadcast_over_the_heads_is_read_where_it_is(mha):
    """A (B, 1, n, m) mask (or a (B, 1, 1, m) key padding row) over H heads: the kernels' view of it keeps stride 0 on
    the heads (and the rows): no B·H·n·m copy."""
    mask = torch.zeros(B, 1, N, M)
    tile = mha._tile(mask, (B, 4), N, M)
    assert tile.shape == (B, 4, N, M) and tile.stride()[1] == 0 and tile.data_ptr() == mask.data_ptr()
    padding = torch.zeros(B, 1, 1, M)
    assert mha._tile(padding, (B, 4), N, M).stride()[1:3] == (0, 0)
