"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs") with a positive feature
map φ = σ: O = (φ(Q) (φ(K)ᵀ V)) ⊘ (φ(Q) φ(K)ᵀ 𝟏 𝟏ᵀ), O(n·d²) instead of O(n²·d)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
F_Q, F_K, V = sa.sigmoid(X * W_Q), sa.sigmoid(X * W_K), X * W_V
N = F_Q * (F_K.T * V)
Z = F_Q * (F_K.T * sa.ones(n, 1))
out = sa.hadamard(N, sp.HadamardPower(Z * sa.ones(1, d_v), -1))
spec = sa.Spec(
    "linear_attention",
    "(σ(X W_Q) (σ(X W_K)ᵀ X W_V)) ⊘ (σ(X W_Q) σ(X W_K)ᵀ 𝟏 𝟏ᵀ)",
    (X, W_Q, W_K, W_V),
    out,
    (("F_Q", F_Q), ("F_K", F_K), ("V", V), ("N", N), ("Z", Z), ("O", out)),
)
