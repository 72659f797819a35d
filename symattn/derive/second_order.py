"""Second-order derivations: the Hessian-vector product of a spec, derived like any gradient.

For f = tr(Gᵀ Y) and a direction V_w of the input w, f₂ = tr(V_wᵀ ∂f/∂w) is a scalar of the
inputs, G and V_w (``specs.second_order``); its gradient with respect to w is the Hessian
block H_ww applied to V_w, and with respect to any other input x, H_xw V_w. Its derivation is
the first-order machinery run on f₂, so every printed step is checked the same way (--verify).
"""

from __future__ import annotations

from symattn.derive.derivation import Derivation, derive
from symattn.specs import Spec
from symattn.specs.second_order import second_order_spec

__all__ = ["derive_second_order"]


def derive_second_order(s: Spec, wrt: str | None = None) -> Derivation:
    """The derivation of f₂ = Σ_w tr(V_wᵀ ∂tr(Gᵀ Y)/∂w) over w = wrt (default: every input): its gradients
    are the Hessian-vector products H V."""
    return derive(second_order_spec(s, None if wrt is None else [wrt]).spec)
