"""Drop-in modules: mha_torch.MultiheadAttention against torch.nn.MultiheadAttention and
transformer_block_torch.TransformerEncoderLayer against torch.nn.TransformerEncoderLayer: state dicts both ways,
outputs, attention weights and every gradient (inputs, parameters, float masks), masks and options; every
configuration of both in test_dropin_configurations.py."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from symattn.generated import mha_torch, transformer_block_torch  # noqa: E402

E, H, L, S, N = 12, 3, 5, 7, 2
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-10}  # outputs and weights; gradients relative to their size


def _pair(dtype, **options):
    """torch's module with random (nonzero) biases, and ours loaded from its state dict."""
    torch.manual_seed(7)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **options)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) / 3)
    ours = mha_torch.MultiheadAttention(E, H, dtype=dtype, **options)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(dtype, batch_first=True, batched=True, cross=False, kdim=E, vdim=E):
    """query, key, value in torch's layout, requiring gradients; key/value of S rows when cross."""
    torch.manual_seed(11)
    rows = S if cross else L

    def make(length, width):
        shape = ((N, length, width) if batch_first else (length, N, width)) if batched else (length, width)
        return torch.randn(shape, dtype=dtype, requires_grad=True)

    q = make(L, E)
    if not cross and kdim == vdim == E:
        return q, q, q
    return q, make(rows, kdim), make(rows, vdim)


def _close(a, b, dtype, scale=1.0):
    assert a.shape == b.shape, (a.shape, b.shape)
    error = (a - b).abs().max().item() if a.numel() else 0.0
    assert error <= TOLERANCE[dtype] * scale, error


def _compare(ref, ours, inputs, dtype, **kwargs):
    """Output, weights and the gradients of a loss through both (the weights' too) agree with torch's."""
    out_ref, w_ref = ref(*inputs, **kwargs)
    out, w = ours(*inputs, **kwargs)
    _close(out, out_ref, dtype)
    assert (w is None) == (w_ref is None)
    if w is not None:
        _close(w, w_ref, dtype)
    torch.manual_seed(3)
    seed = torch.randn_like(out_ref)
    leaves = [*dict.fromkeys(t for t in inputs if t.requires_grad)]
    extras = [kwargs["attn_mask"]] if isinstance(kwargs.get("attn_mask"), torch.Tensor) else []
    extras = [m for m in extras if m.requires_grad]

    def gradients(module, out, w):
        loss = (out * seed).sum() + (0.0 if w is None else (w * w).sum())
        return torch.autograd.grad(loss, [*leaves, *extras, *module.parameters()])

    for g, g_ref in zip(gradients(ours, out, w), gradients(ref, out_ref, w_ref), strict=True):
        _close(g, g_ref, dtype, scale=max(1.0, g_ref.abs().max().item()) * 10)


DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize(
    "case",
    ["plain", "key_padding_mask", "bool_attn_mask", "float_attn_mask", "per_head_mask", "is_causal", "both_masks"],
)
def test_multihead_attention_matches_torch(dtype, batch_first, case):
    ref, ours = _pair(dtype, batch_first=batch_first)
    q, k, v = _inputs(dtype, batch_first)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[0, -2:] = True  # no row fully masked: torch gives NaN there, the closed form zeros
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    kwargs = {
        "plain": {},
        "key_padding_mask": {"key_padding_mask": padding},
        "bool_attn_mask": {"attn_mask": torch.eye(L, dtype=torch.bool).roll(1, 0)},
        "float_attn_mask": {"attn_mask": torch.randn(L, L, dtype=dtype, requires_grad=True)},
        "per_head_mask": {"attn_mask": torch.randn(N * H, L, L, dtype=dtype, requires_grad=True)},
        "is_causal": {"attn_mask": causal, "is_causal": True},
        "both_masks": {"attn_mask": causal, "key_padding_mask": padding},
    }[case]
    _compare(ref, ours, (q, k, v), dtype, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs", [{"need_weights": False}, {"average_attn_weights": False}, {"need_weights": False, "is_causal": True}]
)
def test_weights_options_match_torch(dtype, kwargs):
    ref, ours = _pair(dtype)
    q, k, v = _inputs(dtype, batch_first=False)
    if kwargs.get("is_causal"):
        kwargs = kwargs | {"attn_mask": torch.ones(L, L, dtype=torch.bool).triu(1)}
    _compare(ref, ours, (q, k, v), dtype, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_attention_unbatched_and_without_bias(dtype):
    for options, batched in (({}, False), ({"bias": False}, True), ({"bias": False}, False)):
        ref, ours = _pair(dtype, **options)
        inputs = _inputs(dtype, batch_first=False, batched=batched, cross=True)
        padding = torch.zeros((N, S) if batched else (S,), dtype=torch.bool)
        padding[..., 1] = True
        _compare(ref, ours, inputs, dtype, key_padding_mask=padding)
        _compare(ref, ours, inputs, dtype, attn_mask=torch.randn(H, L, S, dtype=dtype) if not batched else None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kdim_and_vdim(dtype):
    ref, ours = _pair(dtype, kdim=5, vdim=4, batch_first=True)
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        "q_proj_weight": (E, E),
        "k_proj_weight": (E, 5),
        "v_proj_weight": (E, 4),
        "in_proj_bias": (3 * E,),
        "out_proj.weight": (E, E),
        "out_proj.bias": (E,),
    }
    _compare(ref, ours, _inputs(dtype, cross=True, kdim=5, vdim=4), dtype)


def test_state_dict_both_ways_and_parameters_named_as_torch():
    for options in ({}, {"bias": False}, {"kdim": 5}):
        ref = torch.nn.MultiheadAttention(E, H, **options)
        ours = mha_torch.MultiheadAttention(E, H, **options)
        shapes = {k: v.shape for k, v in ref.state_dict().items()}
        assert {k: v.shape for k, v in ours.state_dict().items()} == shapes
        assert [name for name, _ in ours.named_parameters()] == [name for name, _ in ref.named_parameters()]
        ref.load_state_dict(ours.state_dict())  # ours -> torch
        assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), ours.state_dict().values()))
    ours = mha_torch.MultiheadAttention(E, H)
    assert ours.in_proj_weight.shape == (3 * E, E) and ours.in_proj_bias.abs().sum() == 0  # torch's init
    assert isinstance(ours.out_proj, torch.nn.Linear)


def test_torch_argument_order_and_repr():
    ours = mha_torch.MultiheadAttention(E, H, 0.0, False, False, False, None, None, True)
    assert ours.batch_first and ours.in_proj_bias is None and ours.out_proj.bias is None
    text = repr(mha_torch.MultiheadAttention(E, H, dropout=0.1, kdim=4))
    for part in (f"embed_dim={E}", f"num_heads={H}", "dropout=0.1", "bias=True", "kdim=4", "batch_first=False"):
        assert part in text
    x = torch.randn(L, 2, E)
    out, weights = ours(x, x, x)  # `out, _ = attn(x, x, x)` never splits the batch of 2
    assert out.shape == (L, 2, E) and weights.shape == (L, 2, 2)


def test_unsupported_options_raise_naming_them():
    for option in ("add_bias_kv", "add_zero_attn"):
        with pytest.raises(NotImplementedError, match=option):
            mha_torch.MultiheadAttention(E, H, **{option: True})
    attn = mha_torch.MultiheadAttention(E, H, dropout=0.1)
    x = torch.randn(L, N, E)
    attn.eval()  # no dropout outside training (while training: test_dropin_dropout.py)
    assert attn(x, x, x)[0].shape == x.shape
    with pytest.raises(RuntimeError, match="is_causal"):
        attn(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask: expected shape .*\(5, 5\)"):
        attn(x, x, x, attn_mask=torch.zeros(L, L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        attn(x, x, x, key_padding_mask=torch.zeros(L, N, dtype=torch.bool))
    with pytest.raises(ValueError, match="3-D"):
        attn(x, x[0], x)
    with pytest.raises(ValueError, match="divisible"):
        mha_torch.MultiheadAttention(10, 3)


def test_weights_gradient_alone_and_double_backward_refused():
    ref, ours = _pair(torch.float64)
    q, k, v = _inputs(torch.float64)
    _, w_ref = ref(q, k, v, average_attn_weights=False)
    _, w = ours(q, k, v, average_attn_weights=False)
    (g_ref,) = torch.autograd.grad(w_ref.pow(3).sum(), [q])
    (g,) = torch.autograd.grad(w.pow(3).sum(), [q])  # the output unused: its gradient is zero
    _close(g, g_ref, torch.float64)
    out, w = ours(q, k, v)
    (g,) = torch.autograd.grad(out.sum() + w.sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


def test_existing_module_and_functional_forward_unchanged():
    module = mha_torch.MultiHeadAttention(E, num_heads=H)
    assert [name for name, _ in module.named_parameters()] == ["W_Q", "W_K", "W_V", "W_O"]
    x = torch.randn(N, L, E)
    assert module(x, x, x).shape == x.shape


def _block_pair(dtype, **options):
    torch.manual_seed(5)
    kwargs = {"dim_feedforward": 20, "dropout": 0.0, "activation": "gelu", "norm_first": True} | options
    ref = torch.nn.TransformerEncoderLayer(E, H, dtype=dtype, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) / 5)
    ours = transformer_block_torch.TransformerEncoderLayer(E, H, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", ["plain", "masks", "no_bias", "unbatched"])
def test_encoder_layer_matches_torch(dtype, batch_first, case):
    ref, ours = _block_pair(dtype, batch_first=batch_first, bias=case != "no_bias")
    torch.manual_seed(2)
    shape = (L, E) if case == "unbatched" else (N, L, E) if batch_first else (L, N, E)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    kwargs = {}
    if case == "masks":
        padding = torch.zeros(N, L, dtype=torch.bool)
        padding[1, 0] = True
        kwargs = {"src_mask": torch.ones(L, L, dtype=torch.bool).triu(1), "src_key_padding_mask": padding}
        kwargs["is_causal"] = True
    out_ref, out = ref(x, **kwargs), ours(x, **kwargs)
    _close(out, out_ref, dtype, scale=10)
    seed = torch.randn_like(out)
    g_ref = torch.autograd.grad((out_ref * seed).sum(), [x, *ref.parameters()])
    g = torch.autograd.grad((out * seed).sum(), [x, *ours.parameters()])
    for a, b in zip(g, g_ref, strict=True):
        _close(a, b, dtype, scale=max(1.0, b.abs().max().item()) * 10)


def test_encoder_layer_state_dict_repr_and_unsupported_options():
    for bias in (True, False):
        ref = torch.nn.TransformerEncoderLayer(E, H, 20, norm_first=True, bias=bias)
        ours = transformer_block_torch.TransformerEncoderLayer(E, H, 20, activation="gelu", norm_first=True, bias=bias)
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
        ref.load_state_dict(ours.state_dict())
    text = repr(ours)
    for part in (f"d_model={E}", f"nhead={H}", "dim_feedforward=20", "activation=gelu", "norm_first=True"):
        assert part in text
    layer = transformer_block_torch.TransformerEncoderLayer
    assert "activation=gelu(approximate='tanh')" in repr(layer(E, H, activation=torch.nn.GELU(approximate="tanh")))
    with pytest.raises(RuntimeError, match="activation should be relu/gelu, not tanh"):  # torch's own words
        layer(E, H, activation="tanh")
    for activation, name in ((torch.tanh, "tanh"), (torch.nn.Mish(), "Mish()"), (lambda x: 2 * x, "<lambda>")):
        with pytest.raises(NotImplementedError, match=re.escape(f"activation={name!r} is not supported")):
            layer(E, H, activation=activation)
    x = torch.randn(L, N, E)
    assert layer(E, H).eval()(x).shape == x.shape
    ours = layer(E, H, dropout=0.0)
    ours.norm2.eps = 1e-3
    with pytest.raises(NotImplementedError, match=r"norm2\.eps"):
        ours(x)


def test_torchs_defaults_build_torchs_layer():
    """The drop-in's defaults are torch's (post-LN, ReLU, dropout 0.1): the same arguments, the same layer."""
    ours = transformer_block_torch.TransformerEncoderLayer(E, H, 20, batch_first=True, dtype=torch.float64)
    ref = torch.nn.TransformerEncoderLayer(E, H, 20, batch_first=True, dtype=torch.float64)
    assert (ours.dropout, ref.dropout.p) == (0.1, 0.1) and ours.norm_first is ref.norm_first is False
    assert ours.activation is ref.activation is torch.nn.functional.relu
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(N, L, E, dtype=torch.float64)
    assert torch.allclose(ours.eval()(x), ref.eval()(x), rtol=1e-12, atol=1e-12)


def test_a_changed_activation_or_norm_first_is_computed():
    # torch reads self.activation and self.norm_first at each call: so does the drop-in, never the constructor's
    ref, ours = _block_pair(torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64).transpose(0, 1)
    for module in (ref, ours):
        module.activation, module.norm_first = torch.nn.functional.silu, False
    assert torch.allclose(ours.eval()(x), ref(x), rtol=1e-12, atol=1e-12)
    assert "activation=silu" in repr(ours) and "norm_first=False" in repr(ours)


@pytest.mark.slow
def test_dropin_benchmark_quick_run(tmp_path):
    # benchmarks/dropin.py end to end at tiny sizes: every row timed, gradients agreeing; no timing asserted
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "dropin.py"
    out = tmp_path / "dropin.json"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4  # float32 and float64, need_weights True and False
    for row in rows:
        assert row["torch"] > 0 and row["dropin"] > 0
        assert row["relative_error"] < (1e-5 if row["dtype"] == "float32" else 1e-12)
