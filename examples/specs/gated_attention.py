"""Gated attention (Qiu et al., 2025, "Gated Attention for Large Language Models"): the attention
output times an elementwise sigmoid gate of the input, (P V) ⊙ σ(X W_G)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V, W_G = sa.matrix("W_V", d_model, d_v), sa.matrix("W_G", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = S / sp.sqrt(d_k)
P = sa.softmax(A)
O_h = P * V  # the attention output, before the gate
G = sa.sigmoid(X * W_G)
out = sa.hadamard(O_h, G)
spec = sa.Spec(
    "gated_attention",
    "softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V ⊙ σ(X W_G)",
    (X, W_Q, W_K, W_V, W_G),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", O_h), ("Gate", G), ("Y", out)),
)
