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


def _routed(module, monkeypatch) -> list:
    """module's forward routed to its Triton module for CPU tensors; the list the Triton forward's calls go into."""
    monkeypatch.setattr(module, "_kernel_device", lambda x: True)
    kernels = module._kernels_module()
    calls = []
    forward = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
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
