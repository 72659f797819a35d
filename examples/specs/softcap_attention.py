"""Attention-logit soft-capping (Gemma 2, Gemma Team 2024): the scaled scores pass through
c·tanh(·/c), c = 50, so that no logit exceeds ±c."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

CAP = 50
n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = CAP * sa.tanh(S / (CAP * sp.sqrt(d_k)))
P = sa.softmax(A)
out = P * V
spec = sa.Spec(
    "softcap_attention",
    "softmax(50 tanh(X W_Q (X W_K)ᵀ / (50 √d_k))) X W_V",
    (X, W_Q, W_K, W_V),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
