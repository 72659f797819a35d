"""Attention written as plain functions, in the styles of well-known code (written here, not copied)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def annotated_attention(query, key, value, mask):
    """The Annotated Transformer's attention(): scores / √d_k, masked_fill(mask == 0, -1e9), softmax, @ value."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    return torch.matmul(p_attn, value)


def weights_attention(x, w_q, w_k, w_v):
    """Single-head self-attention with the weights as arguments (tokens as rows, math layout), .mT, F.softmax."""
    q = x @ w_q
    k = x @ w_k
    v = x @ w_v
    scores = q @ k.mT * q.shape[-1] ** -0.5
    weights = F.softmax(scores, dim=-1)
    return weights @ v


def causal_where_attention(q, k, v):
    """A causal mask made inside (torch.tril of ones) applied with torch.where, as minimal GPT code does."""
    n, m = q.size(-2), k.size(-2)
    allowed = torch.ones(n, m, dtype=torch.bool).tril()
    scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.size(-1))
    scores = torch.where(allowed, scores, float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    return attn @ v


def sigmoid_attention(q, k, v, b):
    """Sigmoid attention (Apple's recipe): σ(Q Kᵀ/√d + b) V, the bias b a 0-d tensor (initialised to −log n)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + b
    attn = torch.sigmoid(scores)
    return attn @ v


def relu_attention(q, k, v):
    """ReLU attention (Wortsman et al. 2023): F.relu of the scaled scores, the keys' sum divided by the length."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return torch.nn.functional.relu(scores) @ v / k.size(-2)


def pointer_log_attention(x, w_q, w_k):
    """Pointer-network style: log-probabilities over positions, log(softmax(Q Kᵀ/√d))."""
    q, k = x @ w_q, x @ w_k
    logits = q @ k.mT / math.sqrt(w_q.shape[-1])
    return torch.log(torch.softmax(logits, dim=-1))


def padded_attention(q, k, v, key_padding):
    """A key-padding mask (B, m), True at padded keys, broadcast over the queries: masked_fill(−∞)."""
    scores = q @ k.mT / math.sqrt(q.size(-1))
    scores = scores.masked_fill(key_padding[:, None, :], float("-inf"))
    return scores.softmax(-1) @ v


def no_self_attention(x, w_q, w_k):
    """Each token attends to the others only: the diagonal weights zeroed after the softmax (masked_fill 0)."""
    q, k = x @ w_q, x @ w_k
    weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
    weights = weights.masked_fill(torch.eye(x.shape[-2], dtype=torch.bool), 0.0)
    return weights @ x
