"""Sigmoid attention, a user-defined spec: O = σ(Q Kᵀ / √d_k) V with Q = X W_Q, K = X W_K, V = X W_V.

Each score goes through the logistic sigmoid on its own instead of a row softmax
(no normalisation over the keys). Derive and generate it with

    symattn derive --spec-file examples/specs/sigmoid_attention.py
    symattn generate --spec-file examples/specs/sigmoid_attention.py --out my_modules/
"""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q = sa.matrix("W_Q", d_model, d_k)  # names W_… are weights: no batch dimensions, gradients summed
W_K = sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)

Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = S / sp.sqrt(d_k)
P = sa.sigmoid(A)
out = P * V

spec = sa.Spec(
    name="sigmoid_attention",
    summary="σ(X W_Q (X W_K)ᵀ / √d_k) X W_V, the sigmoid entrywise",
    inputs=(X, W_Q, W_K, W_V),
    output=out,
    intermediates=(("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
