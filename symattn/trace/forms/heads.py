"""Constants with batch and head axes meeting per-head values: masks, biases and tables of torch's layouts.

A constant of shape (…, h, r, c) meets per-head values (…, H, n, m) by torch's broadcasting. Along an axis where
it does not vary (an ``expand``, position tables equal for every sequence) it is one constant there: the trace
keeps its first entry (a step of the constant program, ``first_along``, guarded by ``varies``: a call where it
varies traces again). What is left is, in symattn's language:

- one n × m constant for every head (h = 1): the additive mask M (batched where it varies along the batch,
  which generated forward takes as (B, n, m)), K for a kept mask, or a fixed constant C;
- a per-head constant (h = H, no batch axis left): the spec's constant C of shape r × (H·c), split into the H
  blocks C_h = ``split_heads(C, H)``; generated forward takes it in that layout, (n, H·m), head h's block in
  columns h·m … (h+1)·m − 1 (``constants.spec_value`` lays out the model's (…, H, n, m) tensor so);
- a constant that varies along the batch (a scale or bias per sequence, per token; ALiBi of padded sequences): the
  same constant read at positions, [C_ij] (``read_as_is``), per head or not, which generated code takes with the
  inputs' batch axes, one per sequence, as it takes every table read at positions.

A constant meeting values whose batch and heads are merged into one axis (B·H, n, m) is first viewed as
(B, H, n, m) (``unmerged``).
"""

from __future__ import annotations

import torch
from sympy import Basic, MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.ops import split_heads
from symattn.lang.positions import make
from symattn.trace.tracer import Constant, Trace
from symattn.trace.values import Refused, Value


def first_along(tensor: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """The constant program's step: tensor's first entry along the axes (kept with size 1); it must be the same
    along them (a tensor that varies there is another function, which the traced spec does not compute)."""
    first = tensor
    for axis in axes:
        first = first.narrow(axis, 0, 1)
    if not torch.equal(torch.broadcast_to(first, tensor.shape), tensor):
        raise SymattnError(
            f"drop_in: a constant of shape {tuple(tensor.shape)} now varies along axes {axes}, where the traced one "
            "did not (trace the module with examples like these)"
        )
    return first


def varies(tensor: torch.Tensor, axes: tuple[int, ...]) -> bool:
    """Whether the tensor varies along the axes (the guard of a reduction: a call where it does, traces again)."""
    try:
        first_along(tensor, axes)
    except SymattnError:
        return True
    return False


def _reduced(t: Trace, tensor: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor | None:
    """tensor with the axes (of size > 1) reduced to their first entry, a recorded program step guarded by its not
    varying there (a call whose tensor varies traces again: a constant per sequence); None where it varies."""
    axes = tuple(a for a in axes if tensor.shape[a] != 1)
    if not axes:
        return tensor
    if varies(tensor, axes):
        return None
    t.program.guard(varies, (tensor, axes), {}, False)
    first = first_along(tensor, axes)
    t.program.record(first_along, (tensor, axes), {}, first)
    return first


def _leading(tensor: torch.Tensor) -> tuple[int, ...]:
    """The batch axes of a (…, h, r, c) tensor: those before the heads' axis."""
    return tuple(range(tensor.ndim - 3))


def named_constant(
    t: Trace, tensor: torch.Tensor, label: str, shape: tuple, form: str = "as_is", **how
) -> MatrixSymbol:
    """A new spec constant of this matrix shape made from the constant tensor, named label (label_2, … if taken)."""
    taken = {str(c.symbol.name) for c in t.constants} | set(t.masks.values())
    name = next(n for n in (label, *(f"{label}_{i}" for i in range(2, 999))) if n not in taken)
    symbol = MatrixSymbol(name, *shape)
    t.constants.append(Constant(symbol, t.program.ref(tensor), form, **how))
    t.kept.append(tensor)
    return symbol


def _per_head(
    t: Trace, tensor: torch.Tensor, form: str, heads: int, like: Value | None = None, batched: bool = False
) -> Value:
    """The per-head constant C (r × H·c in the spec), as the value split_heads(C, H); of like's matrix shape (a mask,
    broadcast to it: an additive one is added), else of its own. batched: one per sequence, read as [C_ij]
    (``read_as_is``)."""
    if like is not None:
        rows, cols = like.rows, like.cols
    else:
        rows, cols = (t.dims.fresh(size, ("cols" if i else "rows", "C")) for i, size in enumerate(tensor.shape[-2:]))
    added = like is not None and form == "as_is"
    label = "M" if form.startswith("additive") else "K" if form.startswith("keep") else "C"
    symbol = named_constant(t, tensor, label, (rows, heads * cols), form, added=added, heads=heads, batched=batched)
    return Value(split_heads(read_as_is(symbol) if batched else symbol, heads), tuple(tensor.shape), heads)


def read_as_is(symbol: MatrixSymbol) -> Basic:
    """The constant C read at positions, [C_ij] (``sa.entries``): C itself, one per sequence in generated code (a
    table read at positions carries the inputs' batch axes), where the drop-in passes it with its batch axes."""
    return make(symbol.rows, symbol.cols, lambda i, j: symbol[i, j])


def is_merged(v: Value) -> bool:
    """Whether the per-head value's axis −3 holds batch and heads merged (B·H entries, B > 1: ``forms.merged``)."""
    return v.heads is not None and len(v.shape) >= 3 and v.shape[-3] != v.heads


def unmerged(t: Trace, tensor: torch.Tensor, like: Value) -> torch.Tensor:
    """A constant meeting the merged per-head value like with its axis −3 of B·H entries, viewed as (…, B, H, r, c)
    (a step of the constant program); any other constant as it is."""
    if not is_merged(like) or tensor.ndim < 3 or tensor.shape[-3] != like.shape[-3] or tensor.shape[-3] == 1:
        return tensor
    shape = (*tensor.shape[:-3], tensor.shape[-3] // like.heads, like.heads, *tensor.shape[-2:])
    viewed = torch.reshape(tensor, shape)
    t.program.record(torch.reshape, (tensor, shape), {}, viewed)
    t.kept.append(viewed)
    return viewed


def across_heads(t: Trace, tensor: torch.Tensor, form: str, like: Value) -> tuple[Basic | None, torch.Tensor]:
    """A mask or bias of shape (…, h, n, m) at per-head values like: (the expression of the per-head constant, None)
    where it varies over the H heads, else (None, the tensor as (…, 1, n, m)), of which the caller makes M or K."""
    tensor = unmerged(t, tensor, like)
    if like.heads is None or tensor.ndim < 3 or tensor.shape[-3] == 1:
        return None, tensor
    if tensor.shape[-3] != like.heads:
        raise Refused(f"a constant of shape {tuple(tensor.shape)} meets {like.heads} heads")
    once = _reduced(t, tensor, (tensor.ndim - 3,))
    if once is not None:
        return None, once
    unbatched = _reduced(t, tensor, _leading(tensor))
    if unbatched is None:  # per head and per sequence (ALiBi of padded sequences)
        return _per_head(t, tensor, form, like.heads, like, batched=True).expr, tensor
    return _per_head(t, unbatched, form, like.heads, like).expr, tensor


def per_sequence(t: Trace, tensor: torch.Tensor, other: Value) -> Value:
    """A float constant varying along its batch axes (a scale, a bias per sequence, per token) meeting other: the
    spec's constant C of its per-sequence shape (1 × 1, n × 1, 1 × m, n × m) read as [C_ij] (``read_as_is``), which
    generated code takes with the inputs' batch axes. At per-head values (…, H, n, m) it is per head, C of r × (H·c)
    split into the H heads (one block per head even where it is the same for every head: generated code broadcasts a
    value shared by the heads only without batch axes)."""
    if other.heads is not None:
        if tensor.shape[-3] not in (1, other.heads):
            raise Refused(f"a constant of shape {tuple(tensor.shape)} meets {other.heads} heads")
        return _per_head(t, tensor, "as_is", other.heads, batched=True)
    rows, cols = (t.dims.fresh(size, ("cols" if i else "rows", "C")) for i, size in enumerate(tensor.shape[-2:]))
    symbol = named_constant(t, tensor, "C", (rows, cols), batched=True)
    return Value(read_as_is(symbol), tuple(tensor.shape))


def fixed(t: Trace, tensor: torch.Tensor, other: Value) -> Value | None:
    """A float constant with batch (or head) axes meeting the traced value other in an entrywise operation (cos and
    sin tables, a bias, a scale): a fixed constant without batch axes, per head where it varies over them; None
    for a constant without such axes (the usual constant, ``Trace.value``)."""
    if tensor.ndim < 3 or other.is_scalar:
        return None
    tensor = unmerged(t, tensor, other)
    heads = other.heads if other.heads is not None and tensor.shape[-3] != 1 else None
    batch = _leading(tensor) if heads is not None else tuple(range(tensor.ndim - 2))
    unbatched = _reduced(t, tensor, batch)
    if unbatched is None and id(tensor) in t.program.sources and t.program.arguments(id(tensor)) & t.demoted:
        return None  # made from an additive mask argument: refused as used otherwise too (``source``)
    if unbatched is None:
        value = per_sequence(t, tensor, other)
        t.bind(tensor, value)
        return value
    if heads is not None:
        if tensor.shape[-3] != heads:
            raise Refused(f"a constant of shape {tuple(tensor.shape)} meets {heads} heads")
        once = _reduced(t, unbatched, (unbatched.ndim - 3,))
        if once is None:
            value = _per_head(t, unbatched, "as_is", heads)
            t.bind(tensor, value)
            return value
        unbatched = once
    value = t.constant(unbatched, "as_is")
    t.bind(tensor, value)
    return value
