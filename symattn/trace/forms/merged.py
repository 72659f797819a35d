"""Batch and heads merged into one axis and split again: (B, H, n, d) ↔ (B·H, n, d), and the batched products with
an added term that code in that layout writes, ``torch.baddbmm`` and ``torch.addmm``.

A reshape that only merges or splits the axes before a per-head value's rows is the same value: its matrix, per
head, does not change, and torch's merged index b·H + h is head h of sequence b. So a per-head value keeps its
heads through (B·H, n, d); torch's shape tells only that its axis −3 holds B·H (``forms.heads.is_merged``). A
constant meeting such a value with an axis of B·H entries (a mask or an ALiBi bias of shape (B·H, n, m), (B·H, 1, m))
is viewed as (B, H, …) by a step of the constant program (``forms.heads.unmerged``), then read as any constant with
batch and head axes (``forms.heads``). A reshape that moves rows into the batch ((B, H, n, d) → (B·H·n, d),
(B·H, n, d) → (B, H·n, d)) is another function, refused as before.

``baddbmm(input, A, B, beta=β, alpha=α)`` is β·input + α·(A B) and ``addmm`` the same of matrices: the product is
``matmul``'s, α a number read as the scale it is (1/√d of the contracted length, as BLOOM, Falcon and GPT-NeoX write
the scores), β·input added by the ``add`` rule (a constant with batch and head axes: the additive mask M or a
per-head bias; a float argument: an additive mask, ``MaskArgument``). β = 0 ignores the input (torch does, even of
nan and ∞), and so does an input made by ``torch.zeros`` (β·0 = 0).
"""

from __future__ import annotations

import torch

from symattn.trace import algebra, layout
from symattn.trace.forms.groups import one_head
from symattn.trace.layout import argument
from symattn.trace.tracer import MaskArgument, Trace, op_name
from symattn.trace.values import Refused, Value


def regroup(t: Trace, v: Value, result) -> Value | None:
    """view/reshape of a per-head value merging the batch axis into the heads' ((…, B, H, r, c) → (…, B·H, r, c)) or
    splitting it again ((…, B·H, r, c) → (…, B, H, r, c)); of a matrix with batch axes to (…, 1, n, d), one head;
    None for any other reshape."""
    old, new = tuple(v.shape), tuple(result.shape)
    if v.pending is not None or v.is_scalar or len(old) < 3 or old[-2:] != new[-2:]:
        return None
    if v.heads is None:
        if len(new) == len(old) + 1 and new[:-3] == old[:-2] and new[-3] == 1:
            return one_head(v, result)
        return None
    merges = len(new) == len(old) - 1 >= 3 and old[-3] == v.heads and new[:-3] == old[:-4]
    merges = merges and new[-3] == old[-4] * v.heads
    splits = len(new) == len(old) + 1 and new[-3] == v.heads and new[:-4] == old[:-3] and new[-4] * v.heads == old[-3]
    if merges or splits:
        return Value(v.expr, new, v.heads)
    return None


def _made_by_zeros(t: Trace, tensor: object) -> bool:
    """A constant tensor made by torch.zeros (or zeros_like, new_zeros) in the code: β·0 = 0 whatever its shape."""
    if not isinstance(tensor, torch.Tensor) or t.traced(tensor) or id(tensor) not in t.program.sources:
        return False
    ref = t.program.sources[id(tensor)]
    return ref.kind == "step" and op_name(t.program.steps[ref.key][0]) in ("zeros", "zeros_like", "new_zeros")


def _bound(t: Trace, value: Value, tensor: torch.Tensor) -> torch.Tensor:
    t.bind(tensor, value)
    return tensor


def _scaled(t: Trace, tensor: torch.Tensor, factor: object) -> torch.Tensor:
    """factor · tensor, a traced tensor or a constant (the constant program's step), as a new tensor."""
    scaled = tensor * factor
    if t.traced(tensor):
        return _bound(t, algebra.binary("mul")(t, (tensor, factor), {}, scaled), scaled)
    t.program.record(torch.mul, (tensor, factor), {}, scaled)
    t.kept.append(scaled)
    return scaled


def scaled_sum(t: Trace, base: object, x: object, y: object, beta: object, alpha: object, result) -> Value:
    """β·base + α·(x y): the product, α read as a scale of its contracted length, β·base added (module docstring)."""
    if not (t.traced(x) or t.traced(y)):
        raise Refused("a product of constants added to a traced input; read: a traced product plus a bias or mask")
    with torch.no_grad():
        plain = torch.matmul(x, y)
    scores = _bound(t, layout.matmul(t, (x, y), {}, plain), plain)
    if alpha != 1:
        with torch.no_grad():
            scores = _scaled(t, scores, alpha)
    if beta == 0 or _made_by_zeros(t, base):
        v = t.value(scores)
        return Value(v.expr, tuple(result.shape), v.heads)
    if beta != 1:
        if t.traced(base) and id(base) in t.floats:  # a float argument scaled and added: an additive mask
            raise MaskArgument(t.floats[id(base)])
        with torch.no_grad():
            base = _scaled(t, base, beta)
    return algebra.binary("add")(t, (scores, base), {}, result)


def baddbmm(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.baddbmm(input, A, B, beta=β, alpha=α) = β·input + α·(A B), batched (BLOOM's alibi.baddbmm(q, k, …))."""
    base, x, y = args[0], argument(args, kwargs, 1, "batch1"), argument(args, kwargs, 2, "batch2")
    beta, alpha = argument(args, kwargs, 3, "beta", 1), argument(args, kwargs, 4, "alpha", 1)
    return scaled_sum(t, base, x, y, beta, alpha, result)
