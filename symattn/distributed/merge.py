"""How partial results of a core over blocks of keys merge: a rule per row normaliser (STYLE.md, "a ring is a
merge rule").

A core O = N(A) V computed by one rank's query rows against one block of keys at a time gives the block's share
O_j and a row statistic s_j (the eager core's ``part="share"``); the rows' whole output is a merge of the shares
that only the normaliser decides, and so is the backward: with the merged output and statistic, block j's
weights P_j and the cotangent of its scores' steps Ā_j are its own (FlashAttention's backward identity for the
softmax), dV_j = P_jᵀ Ō, and autograd of the block's A_j (the eager core's ``part="logits"``) does the rest.

- row softmax: O_j = softmax(A_j) V_j, s_j = L_j = log Σ_k exp(A_j) (−∞: no key); L = log Σ_j e^{L_j} and
  O = Σ_j e^{L_j − L} O_j. Backward: P_j = exp(A_j − L), Ā_j = P_j ⊙ (Ō V_jᵀ − rowsum(Ō ⊙ O) 𝟏ᵀ).
- row sum: O_j = A_j V_j, s_j = rowsum(A_j); U = Σ_j O_j, s = Σ_j s_j, O = U ⊘ s (a row summing to 0: O = U).
  Backward: P_j = A_j ⊘ s, Ā_j = (Ō V_jᵀ − rowsum(Ō ⊙ O) 𝟏ᵀ) ⊘ s (no row-sum term where s = 0).
- none: O_j = A_j V_j, no statistic; O = Σ_j O_j. Backward: P_j = A_j, Ā_j = Ō V_jᵀ.

Every rule is torch ops, so forward-mode autograd carries tangents through the merges (the ring's JVP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from symattn.errors import SymattnError

Share = tuple[torch.Tensor, torch.Tensor | None]  # (a block's output share, its row statistic; None: none)


@dataclass(frozen=True)
class Merge:
    """The merge of a normaliser: the share of rows that read no key, how two shares of the same rows over
    disjoint key blocks make the share over both, the output of the merged share; for the backward, a block's
    weights P_j from its A_j and the merged (O, s), and its Ā_j from (P_j, Ō V_jᵀ, Ō, the merged (O, s))."""

    nothing: Callable[[torch.Tensor, torch.Tensor], Share]  # (O-shaped zeros, a row-statistic-shaped like) → share
    combine: Callable[[Share, Share], Share]
    finish: Callable[[Share], torch.Tensor]
    weights: Callable[[torch.Tensor, Share], torch.Tensor]
    scores: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Share], torch.Tensor]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """A log-sum-exp with −∞ (no key) as 0: the weights e^{L_j − L} of such a row are then e^{−∞} = 0."""
    return torch.where(lse == float("-inf"), 0.0, lse)


def _softmax(first: Share, second: Share) -> Share:
    """(O, L) over the keys of both: L = log(e^{L₁} + e^{L₂}), O = e^{L₁ − L} O₁ + e^{L₂ − L} O₂. Written from the
    larger of L₁, L₂ (0 where both are −∞), so that forward-mode tangents stay finite where a row has no key."""
    (o1, l1), (o2, l2) = first, second
    top = _finite(torch.maximum(l1, l2))
    total = torch.exp(l1 - top) + torch.exp(l2 - top)
    lse = torch.where(total == 0.0, float("-inf"), top + torch.log(torch.where(total == 0.0, 1.0, total)))
    safe = _finite(lse)
    return torch.exp(l1 - safe) * o1 + torch.exp(l2 - safe) * o2, lse


def _rowdot(grad: torch.Tensor, merged: Share) -> torch.Tensor:
    """rowsum(Ō ⊙ O)."""
    return (grad * merged[0]).sum(-1, keepdim=True)


def _divisor(total: torch.Tensor) -> torch.Tensor:
    return torch.where(total == 0.0, 1.0, total)


def _row_sum_scores(p: torch.Tensor, dp: torch.Tensor, grad: torch.Tensor, merged: Share) -> torch.Tensor:
    """Ā_j = (Ō V_jᵀ − rowsum(Ō ⊙ O) 𝟏ᵀ) ⊘ s, the row-sum term 0 where s = 0 (O = U there)."""
    total = merged[1]
    return (dp - torch.where(total == 0.0, 0.0, _rowdot(grad, merged))) / _divisor(total)


def _added(first: Share, second: Share) -> Share:
    """Shares whose outputs and statistics add (a row sum's; none's, with no statistic)."""
    (o1, s1), (o2, s2) = first, second
    return o1 + o2, None if s1 is None else s1 + s2


MERGES: dict[str, Merge] = {  # normaliser (codegen.backends.triton.core.NORMALISERS) → its merge
    "row softmax": Merge(
        lambda zeros, like: (zeros, torch.full_like(like, float("-inf"))),
        _softmax,
        lambda share: share[0],
        lambda a, merged: torch.exp(a - _finite(merged[1])),  # P_j = exp(A_j − L)
        lambda p, dp, grad, merged: p * (dp - _rowdot(grad, merged)),  # P_j ⊙ (Ō V_jᵀ − rowsum(Ō ⊙ O))
    ),
    "row sum": Merge(
        lambda zeros, like: (zeros, torch.zeros_like(like)),
        _added,
        lambda share: share[0] / _divisor(share[1]),
        lambda a, merged: a / _divisor(merged[1]),  # P_j = A_j ⊘ s
        _row_sum_scores,
    ),
    "none": Merge(
        lambda zeros, like: (zeros, None),
        _added,
        lambda share: share[0],
        lambda a, merged: a,  # P_j = A_j
        lambda p, dp, grad, merged: dp,  # Ā_j = Ō V_jᵀ
    ),
}


def merge_for(spec: str, record: dict) -> Merge:
    """The merge rule of a core (its Triton module's RING record), or a SymattnError of one line naming why none."""
    if record["dropout"]:
        raise SymattnError(
            f"context_parallel: {spec} drops out its attention weights, whose masks are drawn over the whole n × m "
            "array; a ring of blocks does not draw them yet (dropout=0.0, or eval())"
        )
    if record["normaliser"] not in MERGES:
        raise SymattnError(
            f"context_parallel: {spec}'s core is a {record['normaliser']} map with an n × m output, which has no "
            f"merge over blocks of keys (merged: {', '.join(MERGES)})"
        )
    return MERGES[record["normaliser"]]
