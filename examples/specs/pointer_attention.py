"""Pointer attention (Vinyals et al., 2015, "Pointer Networks"): the output is a distribution over
the input positions, kept in log space for a cross-entropy loss, L = log_softmax(X W_Q (X W_K)ᵀ / √d_k)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k = dim("n"), dim("d_model"), dim("d_k")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
Q, K = X * W_Q, X * W_K
A = Q * K.T / sp.sqrt(d_k)
out = sa.log_softmax(A)
spec = sa.Spec(
    "pointer_attention",
    "log_softmax(X W_Q (X W_K)ᵀ / √d_k): log-probabilities over the input positions",
    (X, W_Q, W_K),
    out,
    (("Q", Q), ("K", K), ("A", A), ("L", out)),
)
