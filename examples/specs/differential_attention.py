"""Differential attention (Ye et al., 2024, "Differential Transformer"): the difference of two
softmax attention maps, (softmax(Q₁K₁ᵀ/√d_k) − λ softmax(Q₂K₂ᵀ/√d_k)) V, λ a trainable scalar
(the paper learns λ through a re-parameterisation and initialises it near 0.8)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q1, W_K1 = sa.matrix("W_Q1", d_model, d_k), sa.matrix("W_K1", d_model, d_k)
W_Q2, W_K2 = sa.matrix("W_Q2", d_model, d_k), sa.matrix("W_K2", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
lam = sp.Symbol("lam", real=True)
Q1, K1, Q2, K2, V = X * W_Q1, X * W_K1, X * W_Q2, X * W_K2, X * W_V
P1 = sa.softmax(Q1 * K1.T / sp.sqrt(d_k))
P2 = sa.softmax(Q2 * K2.T / sp.sqrt(d_k))
D = P1 - lam * P2
out = D * V
spec = sa.Spec(
    "differential_attention",
    "(softmax(Q₁K₁ᵀ/√d_k) − λ softmax(Q₂K₂ᵀ/√d_k)) X W_V, λ a trainable scalar",
    (X, W_Q1, W_K1, W_Q2, W_K2, W_V, lam),
    out,
    (("Q1", Q1), ("K1", K1), ("Q2", Q2), ("K2", K2), ("V", V), ("P1", P1), ("P2", P2), ("D", D), ("O", out)),
)
