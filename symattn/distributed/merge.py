"""How partial results of a core over blocks of keys merge: a rule per row normaliser (STYLE.md, "a ring is a
merge rule").

A core O = N(A) V computed by one rank's query rows against one block of keys at a time gives a partial output
O_j and the block's row statistic; the rows' whole output is a merge of the partials that only the normaliser
decides:

- row softmax: O_j = softmax(A_j) V_j with L_j = log Σ_k exp(A_j) (the row log-sum-exp); the whole row's
  L = log Σ_j exp(L_j) and O = Σ_j exp(L_j − L) O_j. The backward recomputes each block's P_j = exp(A_j − L)
  from the merged L, and D = rowsum(dO ⊙ O) from the merged O: the block's saved values with O and L replaced.
- a division by row sums: numerators and row sums added (not yet: refused).
- none: outputs added (not yet: refused).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from symattn.errors import SymattnError


@dataclass(frozen=True)
class Merge:
    """The merge of a normaliser: the row statistic a block's forward saves beside its output, and how two
    partials (output, statistic) of the same rows over disjoint key blocks make the partial over both."""

    statistic: str  # the name the generated module saves it under
    combine: Callable[[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], tuple]
    saved: Callable[[torch.Tensor], torch.Tensor]  # the merged statistic as the module's backward reads it
    tangent: Callable[[tuple, tuple], tuple]  # combine for (output, statistic, their tangents)


def _softmax(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """(O, L) of softmax over the keys of both: L = log(e^{L₁} + e^{L₂}), O = e^{L₁ − L} O₁ + e^{L₂ − L} O₂. A row
    with no key in a block has L = −∞ there (the generated module's +∞ for such a row is read as −∞)."""
    (o1, l1), (o2, l2) = first, second
    l1, l2 = (torch.where(x == float("inf"), float("-inf"), x) for x in (l1, l2))
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(lse == float("-inf"), 0.0, lse)  # a row with no key at all: weights 0, O = 0
    return torch.exp(l1 - safe) * o1 + torch.exp(l2 - safe) * o2, lse


def _softmax_tangent(first: tuple, second: tuple) -> tuple:
    """(O, L, Ȯ, L̇) of softmax over the keys of both, from each part's: with weights a = e^{L₁ − L}, b = e^{L₂ − L}
    (O = a O₁ + b O₂, ȧ = a (L̇₁ − L̇)), L̇ = a L̇₁ + b L̇₂ and Ȯ = a (Ȯ₁ + (L̇₁ − L̇) O₁) + b (Ȯ₂ + (L̇₂ − L̇) O₂)."""
    (o1, l1, t1, s1), (o2, l2, t2, s2) = first, second
    o, lse = _softmax((o1, l1), (o2, l2))
    safe = torch.where(lse == float("-inf"), 0.0, lse)
    a, b = (torch.exp(torch.where(x == float("inf"), float("-inf"), x) - safe) for x in (l1, l2))
    s = a * s1 + b * s2
    return o, lse, a * (t1 + (s1 - s) * o1) + b * (t2 + (s2 - s) * o2), s


# normaliser (codegen.backends.triton.core.NORMALISERS) → its merge; the others slot in here
MERGES: dict[str, Merge] = {
    # a row with no key: L = +∞ for the generated backward (P = exp(A − L) = 0), −∞ in the merge
    "row softmax": Merge(
        "L", _softmax, lambda lse: torch.where(lse == float("-inf"), float("inf"), lse), _softmax_tangent
    ),
}


def merge_for(spec: str, normaliser: str) -> Merge:
    """The merge rule of a core's normaliser, or a SymattnError of one line naming what has none yet."""
    if normaliser not in MERGES:
        known = ", ".join(MERGES)
        raise SymattnError(
            f"context_parallel: {spec}'s core is normalised by {normaliser!r}, whose ring merge is not implemented "
            f"(implemented: {known})"
        )
    return MERGES[normaliser]
