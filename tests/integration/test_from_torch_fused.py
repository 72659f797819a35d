"""sa.from_torch of fused projections: GPT-2's Conv1D (addmm on the flattened rows, its weight stored (in, out))
split in three, nanoGPT's fused c_attn, timm's qkv reshaped to (B, N, 3, H, d), permuted and unbound (or indexed).
The spec reads a piece as a product with a block of the weight (the blocks are its inputs, W_0, W_1, W_2 in W's
place); the drop-in passes the blocks as views of the one parameter, so its gradient arrives whole. Each is compared
with torch autograd of the original (output, every gradient) at a new batch size and length."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rendered import close  # noqa: E402
from torch_corpus import hf, modules  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm, generated_instance  # noqa: E402

C = 16


def causal(lengths: list[int], n: int) -> torch.Tensor:
    """(B, 1, n, n) as transformers' create_causal_mask makes it for eager attention: 0, or float64's minimum."""
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    allowed = keep[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)


CASES = {  # name: (the module, whether it takes a mask, its fused parameters)
    "gpt2_conv1d": (lambda: hf.First(hf.GPT2Attention(C, 2)), True, "attn_c_attn"),
    "nanogpt_c_attn": (lambda: modules.FusedCausalSelfAttention(C, 2), False, "c_attn"),
    "timm_unbind": (lambda: modules.TimmFusedAttention(C, 2), False, "qkv"),
    "timm_index": (lambda: modules.TimmFusedAttention(C, 2, index=True), False, "qkv"),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().double().eval()


def _args(name: str, lengths: list[int], n: int) -> tuple:
    return (causal(lengths, n),) if CASES[name][1] else ()


@pytest.mark.parametrize("name", CASES)
def test_a_fused_projection_traces_in_blocks_and_drops_in(name):
    model = _model(name)
    x = torch.randn(2, 5, C, dtype=torch.float64)
    spec = sa.from_torch(model, x, *_args(name, [5, 3], 5))
    fused = CASES[name][2]
    blocks = [f"{fused}_{kind}_{i}" for kind in ("weight", "bias") for i in range(3)]
    assert [n for n in spec.input_names if n.startswith(fused)] == blocks
    closed = ClosedForm(model, (x, *_args(name, [5, 3], 5)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, C, dtype=torch.float64, generator=g).requires_grad_()
    args = _args(name, [7, 2, 5], 7)
    want = model(x, *args)
    cotangent = torch.randn(want.shape, dtype=torch.float64, generator=g)
    leaves = [x, *model.parameters()]
    wanted = torch.autograd.grad(want, leaves, cotangent)
    got = closed(x, *args)
    close(got.detach(), want.detach(), f"{name}: output at 3 × 7")
    names = ["x", *(p for p, _ in model.named_parameters())]
    for label, a, b in zip(names, torch.autograd.grad(got, leaves, cotangent), wanted):
        close(a, b, f"{name}: ∂f/∂{label} at 3 × 7 (one tensor, in the parameter's layout)")


def test_the_generated_module_holds_the_blocks_of_the_fused_parameter():
    model = _model("gpt2_conv1d")
    x = torch.randn(2, 5, C, dtype=torch.float64)
    instance = generated_instance(model, x, causal([5, 3], 5), second_order=False)
    weight = model.attn.c_attn.weight.detach()
    held = instance.state_dict()
    for i in range(3):
        close(held[f"attn_c_attn_weight_{i}"], weight[:, i * C : (i + 1) * C], f"block {i}")


def test_a_projection_read_whole_and_in_blocks_is_refused_in_one_line():
    class Both(modules.FusedCausalSelfAttention):
        def forward(self, x):
            fused = self.c_attn(x)
            q, k, v = fused.split(self.n_embd, dim=2)
            return (q @ k.mT).softmax(-1) @ v + fused.sum(-1, keepdim=True)

    with pytest.raises(sa.SymattnError, match=r"c_attn_weight.* is read both whole and in blocks"):
        sa.from_torch(Both(C, 2).double(), torch.randn(2, 5, C, dtype=torch.float64))


def test_check_backward_cuts_a_fused_parameter_s_gradient_into_its_blocks():
    """A backward that returns c_attn.weight's gradient whole is checked block by block: right when it is right,
    wrong when one block is off."""
    model = _model("nanogpt_c_attn")

    def autograd_backward(module, x, g, off: float = 0.0):
        x = x.clone().requires_grad_()
        grads = torch.autograd.grad(module(x), [x, *module.parameters()], g)
        found = {"x": grads[0], **{name: grad for (name, _), grad in zip(module.named_parameters(), grads[1:])}}
        found["c_attn.weight"] = found["c_attn.weight"] + off * (torch.arange(3 * C) >= 2 * C)[:, None]
        return found

    x = torch.randn(1, 5, C, dtype=torch.float64)
    verdicts = sa.check_backward(model, autograd_backward, x, trials=2)
    assert all(v.status == "right" for v in verdicts.values()), {k: v.status for k, v in verdicts.items()}
    assert {"c_attn_weight_0", "c_attn_weight_2"} <= set(verdicts)
    verdicts = sa.check_backward(model, lambda m, x, g: autograd_backward(m, x, g, off=0.5), x, trials=2)
    assert [k for k, v in verdicts.items() if v.status != "right"] == ["c_attn_weight_2"]
