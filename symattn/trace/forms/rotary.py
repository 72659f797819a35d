"""Rotary position embeddings: slices of the last axis, their concatenation, and grouped key/value heads.

A slice of the last axis is a product with a constant selection, x[..., a:b:s] = x S (S_{a+js, j} = 1, d × w); a
concatenation along it is Σ_i A_i E_i with E_i the placement of block i (w_i × D: E_i[j, o_i + j] = 1), and the
interleaved form ``stack((A_1, A_2), -1).flatten(-2)`` the same with E_i[j, 2j + i] = 1. Where every A_i is
c_i X S_i of one X (``rotate_half``: cat((−x₂, x₁)); GPT-J's rotate_every_two), the sum is one product X R with
R = Σ_i c_i S_i E_i a constant d × d (for rotate_half the signed permutation [[0, I], [−I, 0]]), so RoPE reads
q ⊙ cos + (q R) ⊙ sin, its cos and sin tables constants (``forms.heads.fixed``). The constants are fixed (no
gradient) at the example's head width, which the parameters fix; a slice's and a concatenation's widths are numbers
(a rotation R of a d × d block keeps the length d).

``repeat_kv`` — ``x[:, :, None, :, :].expand(B, H_kv, r, n, d).reshape(B, H_kv·r, n, d)`` — is symattn's grouped
heads, ``repeat_heads(x, H_kv, H)``: query head h reads key/value head ⌊h / r⌋.
"""

from __future__ import annotations

import torch
from sympy import Basic, Integer, MatrixSymbol

from symattn.lang.algebra import factors, product, total
from symattn.lang.ops import repeat_heads
from symattn.trace.forms import groups
from symattn.trace.forms.heads import named_constant
from symattn.trace.layout import argument, matrix, same_heads
from symattn.trace.tracer import Trace
from symattn.trace.values import Refused, Value


def _last_slice(index: object, ndim: int) -> slice | None:
    """The slice of an index that slices the last axis only (``x[..., a:b]``, ``x[:, :, :, a:b]``), else None."""
    index = index if isinstance(index, tuple) else (index,)
    full = slice(None)
    if not index or not isinstance(index[-1], slice) or index[-1] == full:
        return None
    rest = index[:-1]
    if all(i == full for i in rest) and len(index) == ndim:
        return index[-1]
    if rest.count(Ellipsis) == 1 and all(i is Ellipsis or i == full for i in rest):
        return index[-1]
    return None


def select(t: Trace, args: tuple, kwargs: dict, result) -> Value | None:
    """x[..., a:b:s]: x S, S the constant selection; None for another index."""
    v = t.value(args[0])
    cut = _last_slice(args[1], len(v.shape))
    if cut is None or v.is_scalar:
        return None
    v = matrix(v)
    columns = list(range(v.shape[-1]))[cut]
    s = torch.zeros(v.shape[-1], len(columns), dtype=result.dtype)
    s[columns, torch.arange(len(columns))] = 1
    symbol = named_constant(t, s, "S", (v.cols, Integer(len(columns))))
    t.selections[str(symbol.name)] = s
    return Value(product(v.expr, symbol), tuple(result.shape), v.heads)


def _combined(t: Trace, parts: list[Value], placements: list[torch.Tensor], result) -> Value:
    """Σ_i A_i E_i, or X R where every A_i is c_i X S_i of one X (see the module docstring)."""
    heads = same_heads(*parts)
    for p in parts[1:]:
        t.dims.equate(parts[0].rows, p.rows)
    cols = Integer(result.shape[-1])
    split = [factors(p.expr) for p in parts]
    bases = {tuple(mats[:-1]) for _, mats in split}
    last = [mats[-1] for _, mats in split]
    if len(bases) == 1 and all(isinstance(m, MatrixSymbol) and str(m.name) in t.selections for m in last):
        if all(c.is_number for c, _ in split) and len(next(iter(bases))) > 0:
            r = sum(float(c) * t.selections[str(m.name)] @ e for (c, _), m, e in zip(split, last, placements))
            base = product(*next(iter(bases)))
            cols = base.shape[1] if t.dims.size(base.shape[1]) == r.shape[1] else cols  # (a d × d rotation)
            symbol = named_constant(t, r, "R", (base.shape[1], cols))
            return Value(product(base, symbol), tuple(result.shape), heads)
    terms = []
    for p, e in zip(parts, placements):
        symbol = named_constant(t, e.to(result.dtype), "E", (p.cols, cols))
        terms.append(product(p.expr, symbol))
    return Value(total(*terms), tuple(result.shape), heads)


def _placements(widths: list[int], interleaved: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """E_i (w_i × D): block i at columns o_i … (side by side), or at i, i + k, i + 2k, … (interleaved)."""
    total_width, found, start = sum(widths), [], 0
    for i, w in enumerate(widths):
        e = torch.zeros(w, total_width, dtype=dtype)
        columns = torch.arange(w) * len(widths) + i if interleaved else torch.arange(w) + start
        e[torch.arange(w), columns] = 1
        found.append(e)
        start += w
    return found


def cat(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.cat(tensors, dim=-1): Σ_i A_i E_i (rotate_half's cat((−x₂, x₁)) is x R)."""
    tensors, axis = args[0], argument(args, kwargs, 1, "dim", 0)
    parts = [matrix(t.value(x)) for x in tensors]
    if axis not in (-1, len(parts[0].shape) - 1):
        raise Refused(f"cat along dim={axis}: read is the last axis (the halves of a rotary embedding)")
    return _combined(t, parts, _placements([p.shape[-1] for p in parts], False, result.dtype), result)


def stack(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.stack(tensors, dim=-1), to be flattened back (flatten(-2)): the interleaved rotary form."""
    tensors, axis = args[0], argument(args, kwargs, 1, "dim", 0)
    parts = [matrix(t.value(x)) for x in tensors]
    if axis not in (-1, len(parts[0].shape)):
        raise Refused(f"stack along dim={axis}: read is a new last axis, then flatten(-2) (interleaved rotary)")
    return Value(parts[0].expr, tuple(result.shape), parts[0].heads, pending="stacked", layout=tuple(parts))


def interleaved(t: Trace, v: Value, result) -> Value:
    """flatten(-2) of a stack along a new last axis: A_1, A_2, … interleaved, column by column."""
    parts = list(v.layout)
    if tuple(result.shape) != (*v.shape[:-2], v.shape[-2] * v.shape[-1]):
        raise Refused(f"a reshape of a stack {tuple(v.shape)} to {tuple(result.shape)}; read: flatten(-2)")
    return _combined(t, parts, _placements([p.shape[-1] for p in parts], True, result.dtype), result)


def unsqueeze_heads(t: Trace, args: tuple, kwargs: dict, result) -> Value | None:
    """x[:, :, None, :, :] of per-head values (B, H_kv, n, d): the first step of repeat_kv; None for another."""
    v = t.value(args[0])
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    full = slice(None)
    if v.heads is None or v.pending is not None or len(v.shape) != 4 or len(index) not in (3, 5):
        return None
    if index[:2] != (full, full) or index[2] is not None or any(i != full for i in index[3:]):
        return None
    return Value(v.expr, tuple(result.shape), v.heads, pending="repeat")


def expand(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """expand of key/value heads with an axis added (repeat_kv): (B, H_kv, r, n, d); of one head to H
    (``groups.broadcast``); of the same shape: identity."""
    v = t.value(args[0])
    if tuple(result.shape) == tuple(v.shape):
        return Value(v.expr, tuple(result.shape), v.heads, v.pending, layout=v.layout)
    if v.pending == "repeat" and result.shape[:2] == v.shape[:2] and result.shape[3:] == v.shape[3:]:
        return Value(v.expr, tuple(result.shape), v.heads, pending="repeat", layout=(result.shape[2],))
    one = groups.broadcast(v, result)  # one key/value head to H
    if one is not None:
        return one
    raise Refused(
        f"expand of a traced tensor {tuple(v.shape)} to {tuple(result.shape)}; read: repeat_kv's, or one head to H"
    )


def expand_as(t: Trace, args: tuple, kwargs: dict, result) -> Value | None:
    """c.expand_as(x) of a constant c (a mask expanded to the scores' shape): the constant expand(x.shape), kept in
    the constant program (None: no traced value); of a traced tensor, as ``expand``."""
    if t.traced(args[0]):
        return expand(t, args, kwargs, result)
    t.program.record(torch.Tensor.expand, (args[0], tuple(result.shape)), {}, result)
    return None


def grouped(t: Trace, v: Value, result) -> Value:
    """reshape (B, H_kv, r, n, d) → (B, H_kv·r, n, d): repeat_heads(x, H_kv, H_kv·r)."""
    kv = v.heads
    repeats = v.layout[0] if v.layout else 1
    if tuple(result.shape) != (v.shape[0], kv * repeats, *v.shape[-2:]):
        raise Refused(f"a reshape of repeated heads {tuple(v.shape)} to {tuple(result.shape)}; read: (B, H, n, d)")
    expr: Basic = repeat_heads(v.expr, kv, kv * repeats) if repeats > 1 else v.expr
    return Value(expr, tuple(result.shape), kv * repeats)
