"""The torch modules' right path per device: on CUDA their forward hands the call to the spec's Triton module (its
fused kernels) where they apply, and ``path(...)`` says which code runs and why. Here the device rule is widened to
CPU tensors, the Triton modules running under Triton's interpreter: the routed call gives the torch module's output
and gradients, a constant in its position stays without a gradient, and every reason for the torch ops is named."""

from __future__ import annotations

import importlib

import pytest
from triton_rendered import M, N, torch  # first: without torch or triton this module is skipped


def _torch_module(name: str):
    """symattn.generated.<name>, imported once torch is known to be there."""
    return importlib.import_module(f"symattn.generated.{name}")


def _routed(module, monkeypatch, entry: str = "forward") -> list:
    """module's entry (forward, jvp) routed to its Triton module's for CPU tensors; the list the Triton entry's calls
    go into."""
    monkeypatch.setattr(module, "_kernel_device", lambda x: True)
    kernels = module._kernels_module()
    calls = []
    routed = getattr(kernels, entry)
    monkeypatch.setattr(kernels, entry, lambda *a, **k: calls.append(1) or routed(*a, **k))
    return calls


def _same(run, leaves: list, module, monkeypatch) -> None:
    """run() through the torch ops, then routed to the kernels: the same output and gradients (float32)."""

    def step():
        out = run()
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)]

    want = step()
    calls = _routed(module, monkeypatch)
    got = step()
    assert calls == [1]
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if b is not None:
            assert (a - b).abs().max() <= 2e-5 * max(b.abs().max(), 1.0)


@pytest.mark.parametrize("name", ["attention_torch", "attention_torch_memeff"])
def test_attention_routed_gives_the_torch_modules_values(name, monkeypatch):
    module = _torch_module(name)
    generator = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 2, size, 16, generator=generator, requires_grad=True) for size in (N, M, M))
    mask = torch.randn(N, M, generator=generator)  # positional: a constant, no gradient on either path
    padding = torch.zeros(2, 2, M, dtype=torch.bool)
    padding[1, :, -5:] = True
    leaves = [q, k, v]
    _same(lambda: module.forward(q, k, v, mask, key_padding_mask=padding, causal=True), leaves, module, monkeypatch)
    assert module.path(q, k, v, mask, causal=True) == "triton"


def test_mha_and_the_module_routed_with_grouped_heads_biases_and_a_constant_mask(monkeypatch):
    mha_torch = _torch_module("mha_torch")
    torch.manual_seed(0)
    layer = mha_torch.MultiHeadAttention(32, num_heads=4, num_kv_heads=2, bias=True)
    x = torch.randn(2, N, 32, requires_grad=True)
    mask = torch.randn(N, N, requires_grad=True)  # in its position: a constant, routed or not
    leaves = [x, mask, *layer.parameters()]
    _same(lambda: layer(x, x, x, mask, causal=True), leaves, mha_torch, monkeypatch)


def test_self_attention_and_the_transformer_block_routed(monkeypatch):
    self_attention_torch, transformer_block_torch = map(
        _torch_module, ["self_attention_torch", "transformer_block_torch"]
    )
    torch.manual_seed(1)
    x = torch.randn(2, N, 24, requires_grad=True)
    layer = self_attention_torch.SelfAttention(24, 16, 16)
    _same(lambda: layer(x), [x, *layer.parameters()], self_attention_torch, monkeypatch)
    block = transformer_block_torch.TransformerBlock(24, 48, num_heads=4, bias=True)
    _same(lambda: block(x, causal=True), [x, *block.parameters()], transformer_block_torch, monkeypatch)


def test_the_drop_ins_without_weights_routed(monkeypatch):
    """nn.MultiheadAttention's drop-in (need_weights=False: no n × m weights to return; torch's masks) and the
    TransformerEncoderLayer drop-in (a causal src_mask, key padding) hand the call to the Triton module: the same
    output and parameter gradients; asked for the weights, the drop-in keeps the torch ops."""
    mha_torch, transformer_block_torch = map(_torch_module, ["mha_torch", "transformer_block_torch"])
    torch.manual_seed(2)
    x = torch.randn(2, N, 32, requires_grad=True)
    padding = torch.zeros(2, N, dtype=torch.bool)
    padding[1, -5:] = True
    causal = torch.ones(N, N, dtype=torch.bool).triu(1)
    layer = mha_torch.MultiheadAttention(32, 4, batch_first=True)
    masks = {"attn_mask": causal, "key_padding_mask": padding}
    run = lambda: layer(x, x, x, need_weights=False, **masks)[0]  # noqa: E731
    _same(run, [x, *layer.parameters()], mha_torch, monkeypatch)
    calls = _routed(mha_torch, monkeypatch)
    layer(x, x, x, **masks)
    assert calls == []  # the weights asked for: the torch ops
    block = transformer_block_torch.TransformerEncoderLayer(
        32, 4, 48, dropout=0.0, activation="gelu", norm_first=True, batch_first=True
    )
    step = lambda: block(x, src_mask=causal, src_key_padding_mask=padding)  # noqa: E731
    _same(step, [x, *block.parameters()], transformer_block_torch, monkeypatch)


@pytest.mark.parametrize(
    "options", [{"norm_first": False, "activation": "gelu"}, {"norm_first": True, "activation": "relu"}, {}]
)
def test_an_encoder_layer_of_another_configuration_keeps_the_torch_ops(options, monkeypatch):
    """The spec's Triton module computes the generated module's own configuration (pre-LN, exact GELU) only: a layer
    of another one (torch's default, post-LN ReLU, among them) runs the torch ops even where the kernels would take
    the call, and computes torch's layer."""
    transformer_block_torch = _torch_module("transformer_block_torch")
    torch.manual_seed(3)
    x = torch.randn(2, N, 32)
    ours = transformer_block_torch.TransformerEncoderLayer(32, 4, 48, dropout=0.0, batch_first=True, **options)
    ref = torch.nn.TransformerEncoderLayer(32, 4, 48, dropout=0.0, batch_first=True, **options)
    ref.load_state_dict(ours.state_dict())
    calls = _routed(transformer_block_torch, monkeypatch)
    out = ours(x)
    assert calls == []
    assert (out - ref(x)).abs().max() <= 2e-5


@pytest.mark.parametrize("name", ["attention_torch", "attention_torch_memeff", "mha_torch_memeff"])
def test_jvp_routed_to_the_jvp_kernel_gives_the_torch_modules_tangent(name, monkeypatch):
    """jvp on CUDA hands the call to the Triton module's JVP kernel: the same output and tangent as the closed form
    (masks by keyword, causal; mha with grouped heads and biases; memeff's block_size not handed on); float64
    keeps the torch ops."""
    module = _torch_module(name)
    generator = torch.Generator().manual_seed(5)
    padding = torch.zeros(2, M, dtype=torch.bool)
    padding[1, -4:] = True
    if name.startswith("mha"):
        shapes = {"Q": (2, N, 32), "K": (2, M, 32), "V": (2, M, 32), "W_Q": (32, 32), "W_K": (32, 16)}
        shapes |= {"W_V": (32, 16), "W_O": (32, 32)}
        options = {"num_heads": 4, "num_kv_heads": 2, "b_Q": torch.randn(1, 32, generator=generator)}
        options |= {"block_size": 16, "key_padding_mask": padding, "causal": True}
    else:
        shapes = {"Q": (2, 2, N, 16), "K": (2, 2, M, 16), "V": (2, 2, M, 16)}
        options = {
            "attn_mask": torch.randn(N, M, generator=generator),
            "key_padding_mask": padding[:, None].expand(2, 2, M),
        }
        options |= {"causal": True} | ({"block_size": 16} if "memeff" in name else {})
    inputs = {k: torch.randn(shape, generator=generator) / 3 for k, shape in shapes.items()}
    tangents = {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items() if k != "K"}
    want = module.jvp(*inputs.values(), tangents, **options)
    calls = _routed(module, monkeypatch, "jvp")
    got = module.jvp(*inputs.values(), tangents, **options)
    assert calls == [1]
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 2e-5 * max(b.abs().max(), 1.0)
    wide = {k: x.double() if torch.is_tensor(x) and x.is_floating_point() else x for k, x in options.items()}
    module.jvp(*(x.double() for x in inputs.values()), {k: t.double() for k, t in tangents.items()}, **wide)
    assert calls == [1]  # float64: the torch ops


def test_a_constant_in_its_position_has_no_gradient_in_either_module_and_attn_mask_has_one():
    """Spec.constants receive no gradient: attention's M given in its position, requiring grad, gets none from the
    Triton module as from the torch module; the same mask by keyword (attn_mask) gets its gradient from both."""
    attention_torch, attention_triton = map(_torch_module, ["attention_torch", "attention_triton"])
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, size, 16, generator=generator, requires_grad=True) for size in (N, M, M))
    mask = torch.randn(N, M, generator=generator, requires_grad=True)
    by_keyword = []
    for module in (attention_torch, attention_triton):
        positional = module.forward(q, k, v, mask, causal=True)
        assert torch.autograd.grad(positional.sum(), [mask, q], allow_unused=True)[0] is None, module.__name__
        keyword = module.forward(q, k, v, attn_mask=mask, causal=True)
        by_keyword.append(torch.autograd.grad(keyword.sum(), mask)[0])
    assert (by_keyword[0] - by_keyword[1]).abs().max() <= 1e-5 * by_keyword[0].abs().max()


def test_path_names_why_the_torch_ops_run(monkeypatch):
    attention_torch = _torch_module("attention_torch")
    q = torch.randn(1, 4, 8)
    assert attention_torch.path(q, q, q) == "torch: not every tensor is on CUDA"
    monkeypatch.setattr(attention_torch, "_kernel_device", lambda x: True)
    assert attention_torch.path(q, q, q) == "triton"
    assert attention_torch.path(q.double(), q, q) == "torch: a float64 tensor"
    fake = torch._subclasses.FakeTensorMode().from_tensor(q)
    assert attention_torch.path(fake, q, q) == "torch: a tensor subclass (DTensor, fake tensors)"
    monkeypatch.setattr(attention_torch, "KERNELS", False)
    assert attention_torch.path(q, q, q) == "torch: KERNELS is False"
    monkeypatch.setattr(attention_torch, "KERNELS", True)
    seen = []
    torch.func.grad(lambda a: seen.append(attention_torch.path(a, q, q)) or attention_torch.forward(a, q, q).sum())(q)
    assert seen == ["torch: under a torch.func transform"]
    monkeypatch.setattr(attention_torch, "_KERNELS_MODULE", [None])
    assert attention_torch.path(q, q, q) == "torch: no attention_triton module imports beside this one"
