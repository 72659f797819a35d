"""QK-LayerNorm attention (Dehghani et al., 2023, "Scaling Vision Transformers to 22 Billion
Parameters"): LayerNorm (learned γ, β) on queries and keys before the scores, for stable training."""

import sympy as sp

import symattn as sa
from symattn.lang.ops_block import layer_norm
from symattn.specs import dim

EPS = sp.Rational(1, 10**5)
n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
gamma_Q, beta_Q = sa.matrix("gamma_Q", 1, d_k), sa.matrix("beta_Q", 1, d_k)
gamma_K, beta_K = sa.matrix("gamma_K", 1, d_k), sa.matrix("beta_K", 1, d_k)
ones = sa.ones(n, 1)
Q = sa.hadamard(layer_norm(X * W_Q, EPS), ones * gamma_Q) + ones * beta_Q
K = sa.hadamard(layer_norm(X * W_K, EPS), ones * gamma_K) + ones * beta_K
V = X * W_V
S = Q * K.T
A = S / sp.sqrt(d_k)
P = sa.softmax(A)
out = P * V
spec = sa.Spec(
    "qk_norm_attention",
    "softmax(LN_Q(X W_Q) LN_K(X W_K)ᵀ / √d_k) X W_V",
    (X, W_Q, W_K, W_V, gamma_Q, beta_Q, gamma_K, beta_K),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
