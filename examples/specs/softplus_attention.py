"""Softplus attention (as in "Softplus Attention with Re-weighting Boosts Length Extrapolation",
2025): softmax's exp replaced by softplus, each row normalised by its sum,
O = (F ⊘ rowsum(F) 𝟏ᵀ) V with F = softplus(X W_Q (X W_K)ᵀ / √d_k)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V
A = Q * K.T / sp.sqrt(d_k)
F = sa.softplus(A)
P = sa.hadamard(F, sp.HadamardPower(sa.rowsum(F) * sa.ones(1, n), -1))
out = P * V
spec = sa.Spec(
    "softplus_attention",
    "(F ⊘ rowsum(F) 𝟏ᵀ) X W_V, F = softplus(X W_Q (X W_K)ᵀ / √d_k)",
    (X, W_Q, W_K, W_V),
    out,
    (("Q", Q), ("K", K), ("V", V), ("A", A), ("F", F), ("P", P), ("O", out)),
)
