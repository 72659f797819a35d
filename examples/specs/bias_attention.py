"""Attention with an additive score bias B (n × n), as T5's relative-position buckets or ALiBi's
distance penalties enter the scores (Raffel et al., 2020; Press et al., 2022): B is an input and gets
its gradient, so a learned bias trains like any weight."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X, B = sa.matrix("X", n, d_model), sa.matrix("B", n, n)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = S / sp.sqrt(d_k) + B
P = sa.softmax(A)
out = P * V
spec = sa.Spec(
    "bias_attention",
    "softmax(X W_Q (X W_K)ᵀ / √d_k + B) X W_V",
    (X, W_Q, W_K, W_V, B),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
