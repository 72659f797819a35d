"""Masks: causal and padding masks on the generated attention, a learned float mask, sa.with_mask (docs/masks.md).

The generated ``attention_torch`` with ``causal=True`` and a ``key_padding_mask`` is compared with torch's
``F.scaled_dot_product_attention`` given the same mask (output and gradients); a float ``attn_mask`` that
requires grad (a learned bias) receives its gradient; a row whose keys are all masked gives zeros, not NaN.
Then ``sa.with_mask`` adds an additive mask M to a gallery spec and its derivation is verified.

    python examples/masks.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from symattn.generated import attention_torch, attention_torch_memeff

import symattn as sa
from symattn.specs.files import load_spec_file

torch.manual_seed(0)
B, H, n, d = 2, 3, 6, 4
q, k, v = (torch.randn(B, H, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
padding = torch.zeros(B, n, dtype=torch.bool)
padding[1, -2:] = True  # the second sequence's last two keys are padding (True = ignore)

mask = padding[:, None, :].expand(B, H, n)  # (..., m): the inputs' batch axes, then the keys
ours = attention_torch.forward(q, k, v, key_padding_mask=mask, causal=True)
allowed = ~mask[..., None, :] & torch.ones(n, n, dtype=torch.bool).tril()  # SDPA's bool mask: True = allowed
reference = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
ours_grads = torch.autograd.grad(ours.sum(), (q, k, v))
reference_grads = torch.autograd.grad(reference.sum(), (q, k, v))
gap = max((a - b).abs().max().item() for a, b in zip((ours, *ours_grads), (reference, *reference_grads)))
print(f"causal + padding, against SDPA: largest difference {gap:.1e}")
memeff = attention_torch_memeff.forward(q, k, v, key_padding_mask=mask, causal=True, block_size=2)
print(f"memory-efficient variant: largest difference {(memeff - ours).abs().max().item():.1e}")

bias = torch.zeros(n, n, dtype=torch.float64, requires_grad=True)  # a learned additive bias on the scores
attention_torch.forward(q, k, v, attn_mask=bias, causal=True).square().sum().backward()
print("the float mask's gradient:", tuple(bias.grad.shape), "upper triangle zero:", bool(bias.grad.triu(1).eq(0).all()))

blocked = torch.zeros(n, n, dtype=torch.bool)
blocked[0] = True  # query 0 may see no key at all
rows = attention_torch.forward(q, k, v, attn_mask=blocked)
print("a row with every key masked:", rows[0, 0, 0].tolist(), "finite:", bool(rows.isfinite().all()))

spec = sa.with_mask(load_spec_file("examples/specs/softcap_attention.py"))  # softmax(A) → softmax(A + M)
print("masked spec:", spec.output, "| constants:", [str(c) for c in spec.constants])
verification = sa.derive(spec).verify("W_Q")
print(f"its derivation of ∂f/∂W_Q verified: {verification.ok}")
assert gap < 1e-12 and bool(rows.isfinite().all()) and verification.ok
