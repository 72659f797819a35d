"""An everyday PyTorch attention module, traced into a spec: `symattn derive --spec-file` reads this file.

    symattn derive --spec-file examples/from_torch/attention_module.py --verify
    symattn generate --spec-file examples/from_torch/attention_module.py --backend torch --out my_modules/

The spec's inputs are x, then the module's parameters by state_dict name (q_proj_weight, in torch's
(out, in) layout, …); the causal mask made in forward is the spec's additive constant M.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import symattn as sa


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        attn = F.softmax(scores, dim=-1)
        y = (attn @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.out_proj(y)


model = CausalSelfAttention(d_model=12, n_heads=2)
spec = sa.from_torch(model, torch.randn(2, 5, 12))
