"""Bring your PyTorch attention: from_torch, check_backward, drop_in and undo (docs/from_torch.md).

The module of attention_module.py (next to this file) is traced into a spec; ``sa.check_backward`` judges a
hand-written backward of plain attention (right) and one with the textbook slip dV = G (wrong);
``drop_in`` replaces the module's forward by the generated closed form, whose gradients match torch
autograd of the original, and a few SGD steps train through it; ``undo`` restores the original forward.

    python examples/from_torch/drop_in.py
"""

from __future__ import annotations

import math

import torch
from attention_module import CausalSelfAttention

import symattn as sa
from symattn.trace import drop_in, undo

torch.manual_seed(0)
model, x = CausalSelfAttention(d_model=12, n_heads=2).double(), torch.randn(3, 7, 12, dtype=torch.float64)
spec = sa.from_torch(model, x)
print("spec inputs:", ", ".join(spec.input_names))


def attention(q, k, v):
    return torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1) @ v


def my_backward(q, k, v, g, slip=False):  # ∂⟨G, attention(q, k, v)⟩ by input name
    p = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
    dp = g @ v.mT
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return {"q": ds @ k, "k": ds.mT @ q, "v": g if slip else p.mT @ g}


q, k, v = torch.randn(2, 5, 3), torch.randn(2, 6, 3), torch.randn(2, 6, 4)
right = sa.check_backward(attention, my_backward, q, k, v)
wrong = sa.check_backward(attention, lambda *a: my_backward(*a, slip=True), q, k, v)
print(right["v"].text().splitlines()[0])
print(wrong["v"].text().splitlines()[0])

model(x).square().mean().backward()  # torch autograd of the original, for comparison
reference = {name: p.grad.clone() for name, p in model.named_parameters()}
model.zero_grad()
drop_in(model, x)  # model.forward is now the generated code; its backward the closed form
model(x).square().mean().backward()
gap = max((p.grad - reference[name]).abs().max().item() for name, p in model.named_parameters())
print(f"drop-in gradients vs torch autograd of the original: {gap:.1e}")

opt = torch.optim.SGD(model.parameters(), lr=0.5)
for step in range(5):  # the training loop is unchanged
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")
undo(model)  # the original forward again
assert all(r.right for r in right.values()) and wrong["v"].wrong and gap < 1e-10
