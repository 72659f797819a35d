"""Heads sliced, added and repeated along the heads axis: multi-query and grouped key/value heads written by hand.

A per-head value (…, H, n, d) is split_heads(A, H), A = Concat(A_1 … A_H) of n × (H·d). Along its heads axis:

- a selection of heads ``x[:, h0:h1]``, ``x[:, [i, j]]``, ``x.narrow(1, h0, k)`` (heads c_1 … c_h) is
  split_heads(A S, h), S the constant (H·d) × (h·d) selection, S[c_i·d + j, i·d + j] = 1 (A's blocks c_1 … c_h
  side by side; the cotangent A receives is G Sᵀ, zero in the heads left out);
- one head broadcast against H heads (a product or entrywise operation with torch's broadcasting, ``expand`` to
  (B, H, n, d), ``repeat(1, H, 1, 1)``) is repeat_heads(A, 1, H): every query head reads the one block, whose
  cotangent is the sum of the H heads' (``layout.at_heads``);
- ``repeat_interleave(r, dim=1)`` of H_kv heads is repeat_heads(A, H_kv, r·H_kv): query head h reads key/value head
  ⌊h / r⌋, the grouping of repeat_kv and of SDPA's enable_gqa;
- an axis of size 1 added before the rows of a matrix with batch axes (``unsqueeze(1)``, ``x[:, None]``,
  ``view(B, 1, n, d)``) is one head, split_heads(A, 1).

A tiling ``repeat(1, r, 1, 1)`` of H_kv > 1 heads (head h reads h mod H_kv) is no grouping of symattn's: refused.
"""

from __future__ import annotations

import torch
from sympy import Basic

from symattn.lang.algebra import product
from symattn.lang.ops import SplitHeads, merge_heads, repeat_heads, split_heads
from symattn.trace import layout
from symattn.trace.forms.heads import named_constant
from symattn.trace.layout import argument, matrix
from symattn.trace.tracer import Trace
from symattn.trace.values import Refused, Value


def _heads_axis(v: Value) -> int:
    """The heads axis of a per-head value, counted from the front: −3, or −2 right after the view into heads."""
    return len(v.shape) - (2 if v.pending == "split" else 3)


def _concatenated(v: Value) -> Basic:
    """A of a per-head value split_heads(A, H): the blocks side by side (merge_heads of what is no split)."""
    if isinstance(v.expr, SplitHeads) and v.expr.heads == v.heads:
        return v.expr.arg
    return merge_heads(v.expr, v.heads)


def chosen(t: Trace, v: Value, picked: list[int], result) -> Value:
    """Heads c_1 … c_h of the per-head value v: split_heads(A S, h) (see the module docstring); right after the view
    into heads, still waiting for its transpose."""
    pending = v.pending if v.pending == "split" else matrix(v).pending
    if picked == list(range(v.heads)):
        return Value(v.expr, tuple(result.shape), v.heads, pending)
    if not picked:
        raise Refused("a selection of no heads")
    width = v.shape[-1]
    s = torch.zeros(v.heads * width, len(picked) * width, dtype=result.dtype)
    for i, c in enumerate(picked):
        s[c * width + torch.arange(width), i * width + torch.arange(width)] = 1
    symbol = named_constant(t, s, "S", (v.heads * v.cols, len(picked) * v.cols))
    expr = split_heads(product(_concatenated(v), symbol), len(picked))
    return Value(expr, tuple(result.shape), len(picked), pending)


def _expanded_index(index: object, ndim: int) -> tuple | None:
    """A getitem index as one entry per axis (Ellipsis expanded, missing trailing axes as full slices); None for an
    index that adds or drops axes, or indexes by a tensor."""
    index = index if isinstance(index, tuple) else (index,)
    if index.count(Ellipsis) > 1 or any(i is None or isinstance(i, (int, torch.Tensor)) for i in index):
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = (*index[:at], *(slice(None),) * (ndim - len(index) + 1), *index[at + 1 :])
    if len(index) > ndim:
        return None
    return (*index, *(slice(None),) * (ndim - len(index)))


def select(t: Trace, args: tuple, kwargs: dict, result) -> Value | None:
    """x[:, h0:h1], x[:, [i, j]] of a per-head value (B, H, n, d) (x[..., h0:h1, :] right after the view into heads,
    (B, n, H, d)): the heads chosen; x[:, None] of a matrix with batch axes (B, n, d): one head; None for any other
    index."""
    v = t.value(args[0])
    if v.pending not in (None, "split") or v.is_scalar:
        return None
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    full = slice(None)
    if (
        v.pending is None
        and v.heads is None
        and len(v.shape) == 3
        and index[:2] == (full, None)
        and all(i == full for i in index[2:])
    ):
        return one_head(v, result)
    if v.heads is None:
        return None
    each = _expanded_index(args[1], len(v.shape))
    axis = _heads_axis(v)
    if each is None or any(i != full for k, i in enumerate(each) if k != axis):
        return None
    cut = each[axis]
    if isinstance(cut, list) and all(isinstance(i, int) for i in cut):
        return chosen(t, v, [i % v.heads for i in cut], result)
    if isinstance(cut, slice):
        return chosen(t, v, list(range(v.heads))[cut], result)
    return None


def narrow(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """x.narrow(1, h0, k) of a per-head value: heads h0 … h0 + k − 1; another narrow as ``layout.indexing``."""
    v = t.value(args[0])
    axis, start = argument(args, kwargs, 1, "dim"), argument(args, kwargs, 2, "start")
    length = argument(args, kwargs, 3, "length")
    if v.heads is not None and v.pending is None and isinstance(axis, int) and axis % len(v.shape) == _heads_axis(v):
        start = start % v.heads
        return chosen(t, v, list(range(start, start + length)), result)
    return layout.indexing(t, args, kwargs, result)


def one_head(v: Value, result) -> Value:
    """A matrix with batch axes (…, n, d) as one head (…, 1, n, d): split_heads(A, 1)."""
    v = matrix(v)
    return Value(split_heads(v.expr, 1), tuple(result.shape), 1)


def unsqueeze(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """unsqueeze(dim): an axis of size 1 before the rows of a matrix with batch axes is one head; before the heads
    (or a plain matrix's rows: (1, n, d)) an axis torch broadcasts."""
    v = t.value(args[0])
    axis = argument(args, kwargs, 1, "dim") % len(result.shape)
    if v.pending is None and not v.is_scalar and axis == len(result.shape) - 3:
        if v.heads is None and len(v.shape) > 2:
            return one_head(v, result)
        if v.heads is None:
            return Value(v.expr, tuple(result.shape))
    if v.pending is None and not v.is_scalar and axis < len(result.shape) - 3 and v.heads is not None:
        return Value(v.expr, tuple(result.shape), v.heads)
    raise Refused(
        f"unsqueeze({axis}) of shape {tuple(v.shape)}: read is a new axis before the rows (one head, or a size-1 axis "
        "torch broadcasts)"
    )


def broadcast(v: Value, result) -> Value | None:
    """expand of one head (…, 1, n, d) to (…, H, n, d): repeat_heads(A, 1, H); None for any other expand."""
    new, old = tuple(result.shape), tuple(v.shape)
    if v.heads != 1 or v.pending is not None or len(new) != len(old) or new[-2:] != old[-2:]:
        return None
    if new[:-3] != old[:-3] or new[-3] == 1:
        return None
    return Value(repeat_heads(v.expr, 1, new[-3]), new, new[-3])


def repeat_interleave(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """x.repeat_interleave(r, dim=1) of H_kv heads: repeat_heads(A, H_kv, r·H_kv) (query head h reads ⌊h / r⌋)."""
    v = t.value(args[0])
    repeats, axis = argument(args, kwargs, 1, "repeats"), argument(args, kwargs, 2, "dim")
    per_head = v.heads is not None and v.pending is None and not v.is_scalar
    if per_head and isinstance(repeats, int) and isinstance(axis, int) and axis % len(v.shape) == _heads_axis(v):
        expr = repeat_heads(v.expr, v.heads, v.heads * repeats) if repeats > 1 else v.expr
        return Value(expr, tuple(result.shape), v.heads * repeats)
    raise Refused(
        "repeat_interleave read: an int count along the heads axis of per-head values (key/value heads, dim=1)"
    )


def repeat(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """x.repeat(1, H, 1, 1) of one head: repeat_heads(A, 1, H) (of H_kv > 1 heads a tiling: refused)."""
    v = t.value(args[0])
    sizes = argument(args, kwargs, 1, "repeats")
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list, torch.Size)) else tuple(args[1:])
    per_head = v.heads is not None and v.pending is None and len(sizes) == len(v.shape)
    if per_head and all(r == 1 for k, r in enumerate(sizes) if k != _heads_axis(v)):
        count = sizes[_heads_axis(v)]
        if count == 1:
            return Value(v.expr, tuple(result.shape), v.heads)
        if v.heads == 1:
            return Value(repeat_heads(v.expr, 1, count), tuple(result.shape), count)
        raise Refused(
            f"repeat tiles {v.heads} heads {count} times (head h reads h mod {v.heads}); read: repeat_interleave, "
            "or repeat_kv's expand and reshape"
        )
    raise Refused(f"repeat{sizes} of shape {tuple(v.shape)}; read: repeat(1, H, 1, 1) of one key/value head")
