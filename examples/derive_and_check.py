"""Derive a built-in spec's gradient, verify every printed step, then check claimed gradients (docs/check.md).

``sa.derive`` prints ∂f/∂W_V of self-attention step by step and ``verify`` evaluates each printed equality at
random matrices. ``sa.check`` then judges formulas a reader might find in notes: the textbook slip Xᵀ G
(wrong, with a counterexample), the corrected Xᵀ Pᵀ G (right), the attention weights' gradient G Vᵀ, and
a claim that is NaN at some sizes (cannot be checked: never called right).

    python examples/derive_and_check.py
"""

from __future__ import annotations

import symattn as sa

derivation = sa.derive("self_attention")
print(derivation.text("W_V"))
verification = derivation.verify("W_V")
print(f"every printed equality checked: {verification.ok}\n")

claims = [  # (spec, wrt, formula, expected verdict)
    ("self_attention", "W_V", "X.T * G", "wrong"),
    ("self_attention", "W_V", "X.T * P.T * G", "right"),
    ("self_attention", "P", "G * V.T", "right"),
    ("self_attention", "W_V", "log(X.T * P.T * G)", "undecided"),
]
failures = 0
for spec, wrt, formula, expected in claims:
    result = sa.check(spec, wrt, formula)
    print(f"$ symattn check {spec} --wrt {wrt} {formula!r}")
    print(result.text().splitlines()[0])
    if result.wrong:  # a counterexample: the sizes, the inputs, both values
        print(f"  counterexample at {result.counterexample.dims}")
    failures += result.status != expected
# spec options as keywords: attention without 1/√d_k, the values' gradient
print(sa.check("attention", "V", "P.T * G", scale=1).text())
raise SystemExit(1 if failures or not verification.ok else 0)
