"""Cosine-similarity attention (Henry et al., 2020, "Query-Key Normalization for Transformers";
Swin Transformer V2): queries and keys scaled to unit rows, scores g·Q̂ K̂ᵀ with g = 10 fixed."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

GAIN = 10
n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V


def unit_rows(M):
    """M with each row divided by its Euclidean norm: M ⊙ (rowsum(M^∘2)^∘(−1/2) 𝟏ᵀ)."""
    norms = sp.HadamardPower(sa.rowsum(sp.HadamardPower(M, 2)), sp.Rational(-1, 2))
    return sa.hadamard(M, norms * sa.ones(1, M.shape[1]))


Q_n, K_n = unit_rows(Q), unit_rows(K)
S = GAIN * Q_n * K_n.T
P = sa.softmax(S)
out = P * V
spec = sa.Spec(
    "cosine_attention",
    "softmax(10 Q̂ K̂ᵀ) X W_V, Q̂ and K̂ the unit-row X W_Q and X W_K",
    (X, W_Q, W_K, W_V),
    out,
    (("Q", Q), ("K", K), ("V", V), ("Q_n", Q_n), ("K_n", K_n), ("S", S), ("P", P), ("O", out)),
)
