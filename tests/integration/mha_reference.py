"""torch references for the generated attention modules: nn.MultiheadAttention's weights in symattn's convention."""

from __future__ import annotations

import torch


def reference_mha(d_model: int, num_heads: int, seed: int = 0) -> tuple[torch.nn.MultiheadAttention, dict]:
    """An nn.MultiheadAttention (bias=True, float64, random weights and biases) and the same weights as
    symattn's inputs: W_Q = in_proj_weight[:d]ᵀ (math convention, rows are tokens), b_Q a 1 × d row, …"""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(d_model, num_heads, bias=True, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.5)
    w_q, w_k, w_v = (w.detach().T.clone() for w in ref.in_proj_weight.chunk(3))
    b_q, b_k, b_v = (b.detach()[None].clone() for b in ref.in_proj_bias.chunk(3))
    weights = {
        "W_Q": w_q,
        "W_K": w_k,
        "W_V": w_v,
        "W_O": ref.out_proj.weight.detach().T.clone(),
        "b_Q": b_q,
        "b_K": b_k,
        "b_V": b_v,
        "b_O": ref.out_proj.bias.detach()[None].clone(),
    }
    return ref, {k: v.requires_grad_() for k, v in weights.items()}


def reference_gradients(ref: torch.nn.MultiheadAttention, grads: tuple[torch.Tensor, ...]) -> dict:
    """nn.MultiheadAttention's parameter gradients in symattn's names and convention (order of ref.parameters
    as requested: in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias)."""
    w_in, b_in, w_out, b_out = grads
    w_q, w_k, w_v = w_in.chunk(3)
    b_q, b_k, b_v = b_in.chunk(3)
    return {
        "W_Q": w_q.T,
        "W_K": w_k.T,
        "W_V": w_v.T,
        "W_O": w_out.T,
        "b_Q": b_q[None],
        "b_K": b_k[None],
        "b_V": b_v[None],
        "b_O": b_out[None],
    }


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to the reference's largest entry (at least 1)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))
