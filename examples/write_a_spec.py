"""Write your own spec in Python, derive its gradients and print them (docs/spec.md).

A spec is the forward pass in symattn's language: matrices from ``sa.matrix`` with sizes from ``dim``,
their operators and the node functions (here ``sa.sigmoid`` where attention has ``sa.softmax``), and the
intermediates to print by name. ``sa.derive`` gives every gradient in closed form, printed as text or
LaTeX, each printed equality checked at random matrices by ``verify``.

    python examples/write_a_spec.py
    symattn derive --spec-file examples/write_a_spec.py --wrt W_Q   # the file is a spec file too
"""

from __future__ import annotations

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
W_V = sa.matrix("W_V", d_model, d_v)
Q, K, V = X * W_Q, X * W_K, X * W_V
S = Q * K.T
A = S / sp.sqrt(d_k)
P = sa.sigmoid(A)  # instead of sa.softmax(A)
out = P * V
spec = sa.Spec(
    "sigmoid_attention",
    "σ(X W_Q (X W_K)ᵀ / √d_k) X W_V",
    (X, W_Q, W_K, W_V),
    out,
    (("Q", Q), ("K", K), ("V", V), ("S", S), ("A", A), ("P", P), ("O", out)),
)

if __name__ == "__main__":
    derivation = sa.derive(spec)
    print("inputs:", ", ".join(spec.input_names))
    print(derivation.text("W_Q"))  # forward pass, then each step of ∂f/∂W_Q with its rule
    print("LaTeX of ∂f/∂W_V:")
    print(derivation.latex("W_V"))
    verification = derivation.verify()  # every printed equality, evaluated on both sides
    print(f"verified: {verification.ok}, largest discrepancy {verification.max_discrepancy:.1e}")
    raise SystemExit(0 if verification.ok else 1)
