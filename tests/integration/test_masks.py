"""Masks in the generated attention and mha modules: causal, additive float and boolean attn_mask,
key_padding_mask, against torch.nn.MultiheadAttention and scaled_dot_product_attention, in float64.

A row whose keys are all masked gives zeros and zero gradients (never NaN); a bad mask is a ValueError.
Each printed step of the masked derivations verifies.
"""

from __future__ import annotations

import numpy as np
import pytest

import symattn as sa

torch = pytest.importorskip("torch", reason="torch is the reference for the generated modules")

from mha_reference import max_error, reference_gradients, reference_mha  # noqa: E402
from symattn.generated import (  # noqa: E402
    attention_numpy,
    attention_numpy_memeff,
    attention_torch,
    attention_torch_memeff,
    mha_numpy,
    mha_numpy_memeff,
    mha_torch,
    mha_torch_memeff,
)

B, N, M, H, D_K = 2, 5, 6, 2, 3
D = H * D_K
TOL = 1e-10
F64 = torch.float64


def _masks(kind: str) -> tuple[dict, dict]:
    """(symattn's keywords, nn.MultiheadAttention's keywords) for one kind of mask; no row fully masked."""
    gen = torch.Generator().manual_seed(7)
    future = torch.ones(N, M, dtype=torch.bool).triu(1)
    padding = torch.zeros(B, M, dtype=torch.bool)
    padding[0, -2:] = True
    padding[1, 2] = True
    if kind == "causal":
        return {"causal": True}, {"attn_mask": future}
    if kind == "float":
        mask = torch.randn(N, M, generator=gen, dtype=F64)
        return {"attn_mask": mask}, {"attn_mask": mask}
    if kind == "bool":
        mask = torch.rand(N, M, generator=gen) < 0.4
        mask[:, 0] = False
        return {"attn_mask": mask}, {"attn_mask": mask}
    if kind == "padding":
        return {"key_padding_mask": padding}, {"key_padding_mask": padding}
    if kind == "causal+padding":
        combined = torch.zeros(N, M, dtype=F64).masked_fill(future, float("-inf"))
        return {"causal": True, "key_padding_mask": padding}, {
            "attn_mask": combined,
            "key_padding_mask": torch.zeros(B, M, dtype=F64).masked_fill(padding, float("-inf")),
        }
    raise AssertionError(kind)


def _tokens(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, r, D, generator=gen, dtype=F64, requires_grad=True) for r in (N, M, M)]


MHA_TORCH = {"standard": (mha_torch, {}), "memeff": (mha_torch_memeff, {"block_size": 2})}


@pytest.mark.parametrize("variant", sorted(MHA_TORCH))
@pytest.mark.parametrize("kind", ["causal", "float", "bool", "padding", "causal+padding"])
def test_mha_with_mask_and_biases_matches_nn_multihead_attention(kind, variant):
    ref, w = reference_mha(D, H)
    q, k, v = _tokens()
    ours, theirs = _masks(kind)
    module, extra = MHA_TORCH[variant]
    y = module.forward(q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], num_heads=H, **_biases(w), **ours, **extra)
    y_ref, _ = ref(q, k, v, need_weights=False, **theirs)
    assert max_error(y, y_ref) < TOL
    g = torch.randn_like(y)
    names = ["W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"]
    got = torch.autograd.grad(y, [q, k, v] + [w[n] for n in names], g)
    params = [ref.in_proj_weight, ref.in_proj_bias, ref.out_proj.weight, ref.out_proj.bias]
    expected = torch.autograd.grad(y_ref, [q, k, v, *params], g)
    want = reference_gradients(ref, expected[3:])
    for a, b in zip(got[:3], expected[:3]):
        assert max_error(a, b) < TOL
    for name, a in zip(names, got[3:]):
        assert max_error(a, want[name]) < TOL, name


def _biases(w: dict) -> dict:
    return {name: w[name] for name in ("b_Q", "b_K", "b_V", "b_O")}


@pytest.mark.parametrize("numpy_module", [mha_numpy, mha_numpy_memeff])
@pytest.mark.parametrize("kind", ["causal", "float", "bool", "padding"])
def test_numpy_mha_with_mask_matches_torch(kind, numpy_module):
    _, w = reference_mha(D, H)
    q, k, v = _tokens()
    ours, _ = _masks(kind)
    y = mha_torch.forward(q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], num_heads=H, **_biases(w), **ours)
    g = torch.randn_like(y)
    inputs = [q, k, v] + list(w.values())
    expected = torch.autograd.grad(y, inputs, g)
    as_np = {key: val.detach().numpy() for key, val in w.items()}
    masks = {key: val.numpy() if isinstance(val, torch.Tensor) else val for key, val in ours.items()}
    out, saved = numpy_module.forward(*(x.detach().numpy() for x in (q, k, v)), num_heads=H, **as_np, **masks)
    assert np.max(np.abs(out - y.detach().numpy())) < TOL
    grads = numpy_module.backward(saved, g.numpy())
    for name, want in zip(["Q", "K", "V", *w], expected):
        assert np.max(np.abs(grads[name] - want.numpy())) < TOL, name


@pytest.mark.parametrize("module", [attention_torch, attention_torch_memeff])
@pytest.mark.parametrize("kind", ["causal", "float", "bool", "padding"])
def test_attention_with_mask_matches_scaled_dot_product_attention(kind, module):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, N, 4, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(B, M, 4, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(B, M, 3, generator=gen, dtype=F64, requires_grad=True)
    ours, theirs = _masks(kind)
    if kind == "padding":  # SDPA has no key_padding_mask: the same mask as an additive (B, 1, m) one
        padding = ours["key_padding_mask"][:, None]
        theirs = {"attn_mask": torch.zeros(B, 1, M, dtype=F64).masked_fill(padding, -torch.inf)}
    if kind == "bool":  # SDPA's boolean masks mean True = allowed
        theirs = {"attn_mask": ~ours["attn_mask"]}
    if kind == "causal":
        theirs = {"is_causal": True}
    y = module.forward(q, k, v, scale=0.7, **ours)
    y_ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.7, **theirs)
    assert max_error(y, y_ref) < TOL
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [q, k, v], g), torch.autograd.grad(y_ref, [q, k, v], g)):
        assert max_error(a, b) < TOL


def test_numpy_attention_mask_matches_finite_differences(rng):
    q, k, v = rng.normal(size=(N, 3)), rng.normal(size=(M, 3)), rng.normal(size=(M, 2))
    mask = rng.normal(size=(N, M))
    g = rng.normal(size=(N, 2))
    _, saved = attention_numpy.forward(q, k, v, attn_mask=mask, causal=True)
    grads = attention_numpy.backward(saved, g)
    eps = 1e-6
    for name, x in (("Q", q), ("K", k), ("V", v)):
        dx = rng.normal(size=x.shape)

        def f(sign, name=name, x=x, dx=dx):
            args = {"Q": q, "K": k, "V": v, name: x + sign * eps * dx}
            return np.sum(g * attention_numpy.forward(*args.values(), attn_mask=mask, causal=True)[0])

        assert abs((f(1) - f(-1)) / (2 * eps) - np.sum(grads[name] * dx)) < 1e-7


def test_gradcheck_with_masks_and_biases():
    gen = torch.Generator().manual_seed(5)
    n, m, heads, d_k = 3, 4, 2, 2
    d = heads * d_k

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64, requires_grad=True)

    q, k, v = rand(2, n, d), rand(2, m, d), rand(2, m, d)
    weights = [rand(d, d) for _ in range(4)]
    biases = [rand(1, d) for _ in range(4)]
    mask = torch.randn(n, m, generator=gen, dtype=F64)
    padding = torch.tensor([[False, True, False, False], [False, False, False, True]])

    def f(q, k, v, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o):
        return mha_torch.forward(
            q, k, v, w_q, w_k, w_v, w_o, num_heads=heads, b_Q=b_q, b_K=b_k, b_V=b_v, b_O=b_o,
            attn_mask=mask, key_padding_mask=padding, causal=True,
        )  # fmt: skip

    assert torch.autograd.gradcheck(f, (q, k, v, *weights, *biases))

    def g(q, k, v, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o):
        return mha_torch_memeff.forward(
            q, k, v, w_q, w_k, w_v, w_o, num_heads=heads, b_Q=b_q, b_K=b_k, b_V=b_v, b_O=b_o,
            attn_mask=mask, key_padding_mask=padding, causal=True, block_size=2,
        )  # fmt: skip

    assert torch.autograd.gradcheck(g, (q, k, v, *weights, *biases))
    bool_mask = torch.tensor([[False, True, False, True]] * n)
    assert torch.autograd.gradcheck(lambda q, k, v: attention_torch.forward(q, k, v, attn_mask=bool_mask), (q, k, v))


@pytest.mark.parametrize(
    ("torch_module", "numpy_module"),
    [(attention_torch, attention_numpy), (attention_torch_memeff, attention_numpy_memeff)],
)
def test_fully_masked_rows_give_zeros_and_zero_gradients_never_nan(torch_module, numpy_module):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, N, 4, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(B, M, 4, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(B, M, 3, generator=gen, dtype=F64, requires_grad=True)
    mask = torch.zeros(N, M, dtype=torch.bool)
    mask[1] = True  # row 1 sees no key
    padding = torch.zeros(B, M, dtype=torch.bool)
    padding[1] = True  # batch element 1 has no key at all
    y = torch_module.forward(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert torch.isfinite(y).all()
    assert (y[:, 1] == 0).all() and (y[1] == 0).all()
    dq, dk, dv = torch.autograd.grad(y, [q, k, v], torch.randn_like(y))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, 1] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all() and (dv[1] == 0).all()
    out, saved = numpy_module.forward(
        *(x.detach().numpy() for x in (q, k, v)), attn_mask=mask.numpy(), key_padding_mask=padding.numpy()
    )
    grads = numpy_module.backward(saved, np.ones(out.shape))
    assert np.isfinite(out).all() and (out[:, 1] == 0).all() and (out[1] == 0).all()
    assert all(np.isfinite(g).all() for g in grads.values()) and (grads["Q"][1] == 0).all()


def test_mha_fully_masked_row_is_the_output_bias():
    _, w = reference_mha(D, H)
    q, k, v = _tokens()
    mask = torch.zeros(N, M, dtype=torch.bool)
    mask[0] = True
    y = mha_torch.forward(q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], num_heads=H, **_biases(w), attn_mask=mask)
    assert torch.allclose(y[:, 0], w["b_O"].expand(B, D), rtol=0, atol=0)
    grads = torch.autograd.grad(y, [q, *w.values()], torch.randn_like(y))
    assert all(torch.isfinite(g).all() for g in grads) and (grads[0][:, 0] == 0).all()


@pytest.mark.parametrize(
    ("keywords", "message", "numpy_message"),
    [
        ({"attn_mask": torch.zeros(N, M + 1)}, "attn_mask: expected a tensor of shape",
         r"attn_mask: expected shape \(n, m\)"),
        ({"attn_mask": torch.zeros(N, M, dtype=torch.int64)}, "attn_mask: expected a bool or floating-point", None),
        ({"key_padding_mask": torch.zeros(B, M)}, "key_padding_mask: expected a bool tensor", None),
        ({"key_padding_mask": torch.zeros(B + 1, M, dtype=torch.bool)}, "key_padding_mask: expected a tensor of shape",
         r"key_padding_mask: expected shape \(\.\.\., m\) = \(2, 6\)"),
        ({"attn_mask": np.zeros((N, M))}, "attn_mask: expected a tensor", ""),
        ({"causal": "yes"}, "causal must be True or False", None),
    ],
)  # fmt: skip
def test_bad_masks_raise_value_errors(keywords, message, numpy_message):
    q, k, v = (x.detach() for x in _tokens())
    _, w = reference_mha(D, H)
    with pytest.raises(ValueError, match=message):
        mha_torch.forward(q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], num_heads=H, **keywords)
    if numpy_message == "":
        return  # an array is a good mask for the NumPy backend
    arrays = {key: val.numpy() if isinstance(val, torch.Tensor) else val for key, val in keywords.items()}
    with pytest.raises(ValueError, match=numpy_message or message.replace("tensor", "array")):
        attention_numpy.forward(q.numpy(), k.numpy(), v.numpy(), **arrays)


def test_module_forward_takes_mask_keywords():
    torch.manual_seed(0)
    layer = mha_torch.MultiHeadAttention(D, num_heads=H, bias=True, dtype=F64)
    q, k, v = (x.detach() for x in _tokens())
    y = layer(q, k, v, causal=True)
    assert y.shape == (B, N, D) and torch.isfinite(y).all()
    assert not torch.equal(y, layer(q, k, v))


@pytest.mark.parametrize(
    ("name", "options", "wrt"),
    [
        ("attention", {"causal": True}, None),
        ("attention", {"mask": True, "scale": 1}, None),
        ("mha", {"num_heads": 2, "key_padding_mask": True}, ["Q", "W_K"]),
    ],
)
def test_masked_derivations_verify(name, options, wrt):
    d = sa.derive(name, **options)
    assert "M" in d.text(wrt) and d.verify(wrt).ok
    assert [str(c.name) for c in d.spec.constants] == ["M"] and "M" not in d.gradients


VARIANT_DOCS = {
    "attention_masked": ("attention", {"mask": True}),
    "mha_bias_gqa_masked": ("mha", {"num_kv_heads": "H_kv", "bias": True, "mask": True}),
}


@pytest.mark.parametrize("doc", sorted(VARIANT_DOCS))
def test_committed_variant_derivations_are_what_the_tool_writes_and_verify(doc):
    from pathlib import Path

    name, options = VARIANT_DOCS[doc]
    d = sa.derive(name, **options)
    path = Path(__file__).resolve().parents[2] / "docs" / "derivations" / f"{doc}.md"
    flags = " ".join(f"--option {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
    assert path.read_text(encoding="utf-8") == d.markdown(), (
        f"{path} is stale; regenerate it with: symattn derive {name} {flags} --format markdown > {path.name}"
    )
    assert d.verify().ok
