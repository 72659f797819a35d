"""ReLU attention, a user-defined spec: O = ReLU(Q Kᵀ / √d_k) V / n with Q = X W_Q, K = X W_K, V = X W_V.

Each score goes through ReLU on its own, and the sum over the keys is divided by the sequence length n instead
of a row normalisation (Wortsman et al., "Replacing softmax with ReLU in Vision Transformers", 2023). ReLU′ is the
step (0 at 0, as torch's). Derive and generate it with

    symattn derive --spec-file examples/specs/relu_attention.py
    symattn generate --spec-file examples/specs/relu_attention.py --out my_modules/
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
P = sa.relu(A)
out = P * V / n

spec = sa.Spec(
    name="relu_attention",
    summary="ReLU(X W_Q (X W_K)ᵀ / √d_k) X W_V / n, ReLU entrywise, divided by the length",
    inputs=(X, W_Q, W_K, W_V),
    output=out,
    intermediates=(("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)
