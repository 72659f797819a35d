"""Attention with a learned temperature (as in CLIP's learned logit scale, Radford et al., 2021,
and the per-layer temperatures of Henry et al., 2020, "Query-Key Normalization"): the scores
X W_Q (X W_K)ᵀ are multiplied by a trainable scalar τ before the softmax."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
tau = sp.Symbol("tau", real=True)
Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = tau * S
P = sa.softmax(A)
out = P * V
spec = sa.Spec(
    "temperature_attention",
    "softmax(τ · X W_Q (X W_K)ᵀ) X W_V, τ a trainable scalar",
    (X, W_Q, W_K, W_V, tau),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
