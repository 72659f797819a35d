"""Every tensor on the inputs' device, and no value read back from it: every torch entry point run on meta tensors.

A meta tensor has a shape and a dtype and no data. A generated module that makes a tensor on the CPU while its
inputs are elsewhere (a mask, a constant, a buffer: "Expected all tensors to be on the same device" on a GPU) or
that reads a value back from the device to decide what to do (``bool(t.any())``, ``.item()``, ``nonzero``: on a
GPU a wait for the device at every call) fails here, on a machine without a GPU.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import generated.attention_torch as attention  # noqa: E402
import generated.attention_torch_memeff as attention_memeff  # noqa: E402
import generated.mha_torch as mha  # noqa: E402
import generated.transformer_block_torch as block  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
META = "meta"


def tensor(*shape: int, grad: bool = True):
    return torch.randn(*shape, device=META, requires_grad=grad)


def causal(n: int):
    return torch.nn.Transformer.generate_square_subsequent_mask(n, device=META)


MASKS = {
    "none": {},
    "causal": {"causal": True},
    "bool": {"attn_mask": torch.ones(5, 5, dtype=torch.bool, device=META).triu(1)},
    "float": {"attn_mask": torch.zeros(5, 5, device=META)},
    "key padding": {"key_padding_mask": torch.zeros(2, 5, dtype=torch.bool, device=META)},
}


@pytest.mark.parametrize("module", [attention, attention_memeff], ids=["standard", "memeff"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_attention_forward_and_backward_stay_on_the_device(module, mask):
    q, k, v = tensor(2, 5, 4), tensor(2, 5, 4), tensor(2, 5, 4)
    out = module.forward(q, k, v, **MASKS[mask])
    out.sum().backward()
    assert out.device.type == META and q.grad.shape == q.shape and v.grad.device.type == META


@pytest.mark.parametrize("mask", ["causal", "bool"])
def test_second_order_and_forward_mode_stay_on_the_device(mask):
    q, k, v, g = (torch.randn(2, 5, 4, device=META) for _ in range(4))
    hvp = attention.hvp(q, k, v, g, {"Q": q, "V": v}, **MASKS[mask])
    _, tangent = attention.jvp(q, k, v, {"K": k}, **MASKS[mask])
    leaf = tensor(2, 5, 4)
    (first,) = torch.autograd.grad(attention.forward(leaf, k, v, **MASKS[mask]).sum(), [leaf], create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), [leaf])
    assert {hvp["Q"].device.type, tangent.device.type, second.device.type} == {META}


def test_the_drop_ins_stay_on_the_device():
    x = tensor(2, 5, 8)
    attn = mha.MultiheadAttention(8, 2, device=META, batch_first=True)
    out, _ = attn(x, x, x, need_weights=False, attn_mask=causal(5), is_causal=True)
    layer = block.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, activation="gelu", norm_first=True, device=META, batch_first=True
    )
    (out + layer(x, src_mask=causal(5), is_causal=True)).sum().backward()
    assert x.grad.device.type == META and attn.in_proj_weight.grad.device.type == META


def test_a_traced_module_dropped_in_follows_its_parameters_to_the_device():
    """The example from_torch module (its causal mask made in forward), dropped in on the CPU and moved: the
    replacement rebuilds its mask on the new device at a new length."""
    from symattn.trace import drop_in

    example = runpy.run_path(str(ROOT / "examples" / "from_torch" / "attention_module.py"))
    model = example["CausalSelfAttention"](12, 2)
    drop_in(model, torch.randn(2, 5, 12), second_order=False)
    model.to(META)
    x = tensor(2, 7, 12)
    model(x).sum().backward()
    assert x.grad.shape == x.shape and model.q_proj.weight.grad.device.type == META
