"""Fused projections read in blocks: GPT-2's Conv1D (``addmm`` on a flattened view) and the split of a fused QKV
projection along its features (``split``, ``chunk``, or timm's ``reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)``
then ``unbind(0)`` or ``[i]``).

A column block of a product is a product with a block of its last factor, (X W)[:, a:b] = X W[:, a:b] and
(X Wᵀ)[:, a:b] = X (W[a:b, :])ᵀ; a block of a sum, an entrywise product or function is the same of the blocks, and
(𝟏 b)[:, a:b] = 𝟏 b[:, a:b]. Pushed down to the inputs, the block of an input W is an input of its own, named after
it (W_0, W_1, … in the order of the split): the spec's inputs hold the blocks in W's place. The model's parameter
stays one tensor: ``drop_in`` passes each block as a view of it (``narrow``), so autograd hands W's gradient back
whole, in the user's layout, the blocks' gradients side by side (``source.Traced.views``).

A fused projection viewed with its k pieces inside each head, (…, n, H, k, d) (BLOOM's, Falcon's), is read by
``fused[..., i, :]``: the columns h·k·d + i·d + j of every head h, A S_i with S_i a constant selection, split into H
heads (a product with a constant: the weight stays one input).

A flattened view (…, n, c) → (B·n, c), as Conv1D makes, is the same matrix, rows of every sequence stacked: a
product with it as the left factor (``mm``, ``addmm``) keeps it so, and the view back to (…, n, c′) ends it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from sympy import Basic, MatAdd, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, OneMatrix, Transpose

from symattn.lang.algebra import factors, hadamard_product, product, total
from symattn.lang.functions import Elementwise
from symattn.lang.ops import split_heads
from symattn.trace import layout
from symattn.trace.forms import groups, masks, merged, rotary, tables
from symattn.trace.forms.heads import named_constant
from symattn.trace.layout import argument, matrix, transposed
from symattn.trace.tracer import MaskArgument, Trace
from symattn.trace.values import ORDERED, Refused, Value


@dataclass
class Block:
    """An input's block: the spec symbol, its parent input's name, the torch axis (−1 columns, −2 rows), the range."""

    symbol: MatrixSymbol
    parent: str
    axis: int
    start: int
    stop: int


def _width(t: Trace, start: int, stop: int, heads: int | None = None, owner: str = "block") -> Basic:
    """The length of the block start:stop (H·d where it is split into H heads), one per range in a trace: the blocks
    of one piece (a weight's and its bias's) share it."""
    key = (start, stop, heads)
    if key not in t.widths:
        size = stop - start
        t.widths[key] = (
            heads * t.dims.fresh(size // heads, ("head", "")) if heads else t.dims.fresh(size, ("cols", owner))
        )
    return t.widths[key]


def _block_of(t: Trace, symbol: MatrixSymbol, axis: int, piece: tuple) -> MatrixSymbol:
    """The input symbol's block (axis −1: columns, −2: rows) of the piece (start, stop, index, heads), made once."""
    start, stop, index, heads = piece
    name = str(symbol.name)
    if name not in {n for n, _ in t.inputs}:
        raise Refused(f"a block of {name}, which is no input (a block of a constant is not read)")
    held = next((b for b in t.blocks if (b.parent, b.axis, b.start, b.stop) == (name, axis, start, stop)), None)
    if held is not None:
        return held.symbol
    taken = {n for n, _ in t.inputs} | {str(b.symbol.name) for b in t.blocks}
    label = next(f"{name}_{i}" for i in range(index, 10**6) if f"{name}_{i}" not in taken)
    width = _width(t, start, stop, heads, owner=f"{name}_{index}")
    shape = (symbol.shape[0], width) if axis == -1 else (width, symbol.shape[1])
    block = MatrixSymbol(label, *shape)
    t.blocks.append(Block(block, name, axis, start, stop))
    return block


def columns(t: Trace, e: Basic, piece: tuple) -> Basic:
    """The columns of e in the piece (start, stop, index in the split, heads it is split into or None), pushed down
    to the inputs (see the module docstring)."""
    if not isinstance(e, MatrixExpr):
        return e
    if isinstance(e, MatrixSymbol):
        return _block_of(t, e, -1, piece)
    if isinstance(e, Transpose):
        return transposed(rows(t, e.arg, piece))
    if isinstance(e, OneMatrix):
        return OneMatrix(e.shape[0], _width(t, piece[0], piece[1], piece[3]))
    coeff, mats = factors(e)
    if len(mats) > 1 or coeff != 1:
        return product(coeff, *mats[:-1], columns(t, mats[-1], piece))
    return _entrywise(t, e, columns, piece)


def rows(t: Trace, e: Basic, piece: tuple) -> Basic:
    """The rows of e in the piece, pushed down to the inputs."""
    if not isinstance(e, MatrixExpr):
        return e
    if isinstance(e, MatrixSymbol):
        return _block_of(t, e, -2, piece)
    if isinstance(e, Transpose):
        return transposed(columns(t, e.arg, piece))
    if isinstance(e, OneMatrix):
        return OneMatrix(_width(t, piece[0], piece[1], piece[3]), e.shape[1])
    coeff, mats = factors(e)
    if len(mats) > 1 or coeff != 1:
        return product(coeff, rows(t, mats[0], piece), *mats[1:])
    return _entrywise(t, e, rows, piece)


def _entrywise(t: Trace, e: Basic, block, piece: tuple) -> Basic:
    """A block of a sum, an entrywise product, power or function: the same of the operands' blocks."""
    if isinstance(e, MatAdd):
        return total(*(block(t, a, piece) for a in e.args))
    if isinstance(e, HadamardProduct):
        return hadamard_product(*(block(t, a, piece) for a in e.args))
    if isinstance(e, HadamardPower):
        return HadamardPower(block(t, e.base, piece), e.exp)
    if isinstance(e, Elementwise):
        return e.with_arg(block(t, e.arg, piece))
    raise Refused(f"a block of {type(e).__name__}: read are blocks of products, sums and entrywise functions")


def _pieces(results, axis: int) -> list[tuple[int, int]]:
    """The ranges along axis that results (the pieces of a split) take, in order."""
    ranges, start = [], 0
    for r in results:
        ranges.append((start, start + r.shape[axis]))
        start += r.shape[axis]
    return ranges


def _split(t: Trace, name: str, v: Value, axis: object, result) -> list[Value]:
    """The pieces of v along axis: column blocks of the last axis, or a fused projection's heads (``fused``)."""
    if v.pending == "fused" and axis in (0, -len(v.shape)):
        return [_fused_piece(t, v, i, r) for i, r in enumerate(result)]
    v = matrix(v)
    if axis not in (-1, len(v.shape) - 1) or name == "unbind":
        raise Refused(f"pieces along dim={axis}: read are the pieces of the last axis (a fused projection's features)")
    if v.heads is not None:
        raise Refused("pieces of per-head values: split the fused projection before the view into heads")
    pieces = _pieces(result, -1)
    return [
        Value(columns(t, v.expr, (a, b, i, None)), tuple(r.shape)) for i, ((a, b), r) in enumerate(zip(pieces, result))
    ]


def split(t: Trace, args: tuple, kwargs: dict, result) -> list[Value]:
    """split(sizes, dim) / chunk(k, dim) of a fused projection along its features: the pieces' column blocks."""
    return _split(t, "split", t.value(args[0]), argument(args, kwargs, 2, "dim", 0), result)


def unbind(t: Trace, args: tuple, kwargs: dict, result) -> list[Value]:
    """unbind(0) of a fused projection viewed as (k, B, H, n, d): each piece's heads."""
    return _split(t, "unbind", t.value(args[0]), argument(args, kwargs, 1, "dim", 0), result)


split.several = unbind.several = True  # rules whose result is several tensors (``tracer.record``)


def _fused_piece(t: Trace, v: Value, i: int, result) -> Value:
    """Piece i of a fused projection viewed as (k, B, H, n, d): columns i·H·d … of the projection, split in heads."""
    heads = v.layout[1]
    width = v.shape[-1] * heads  # H·d: the block's length, a multiple of the heads (its split needs no new length)
    block = columns(t, v.expr, (i * width, (i + 1) * width, i, heads))
    return Value(split_heads(block, heads), tuple(result.shape), heads)


def reshape(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """view / reshape: the flattened rows (…, n, c) ↔ (B·n, c), the fused projection (…, n, k·H·d) → (…, n, k, H, d),
    batch and heads merged and split again (``merged.regroup``); anything else as ``layout.reshape``, which a float
    argument it refuses signals as perhaps an additive mask (``MaskArgument``: traced again as a constant)."""
    v = t.value(args[0])
    old, new = tuple(v.shape), tuple(result.shape)
    flattens = len(old) > 2 and new == (math.prod(old[:-1]), old[-1])
    if v.pending is None and v.heads is None and flattens:
        return Value(v.expr, new, pending="flat", layout=old[:-1])
    if v.pending == "index_read":
        return tables.viewed(t, v, result)
    if v.pending == "repeat":
        return rotary.grouped(t, v, result)
    if v.pending == "stacked":
        return rotary.interleaved(t, v, result)
    if v.pending == "flat":
        if new[:-1] != v.layout:
            raise Refused(f"a view of the flattened rows {old} as {new}; read: back to {(*v.layout, old[-1])}")
        return Value(v.expr, new)
    fused = len(new) == len(old) + 2 and new[:-3] == old[:-1] and math.prod(new[-3:]) == old[-1] and new[-3] > 1
    if fused and v.pending is None and v.heads is None:
        return Value(v.expr, new, pending="fused_view", layout=(new[-3], new[-2]))
    regrouped = merged.regroup(t, v, result)
    if regrouped is not None:
        return regrouped
    if id(args[0]) in t.floats:  # a float argument viewed otherwise (ALiBi's (B·H, 1, m) as (B, H, 1, m)): a mask?
        try:
            return layout.reshape(t, args, kwargs, result)
        except Refused as err:
            raise MaskArgument(t.floats[id(args[0])], str(err)) from None
    return layout.reshape(t, args, kwargs, result)


def permute(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """permute(2, 0, 3, 1, 4) of a fused projection's view (…, n, k, H, d): (k, …, H, n, d); (2, 0, 1) of a table
    read at positions (``forms.tables``); else ``layout``'s."""
    v = t.value(args[0])
    if v.pending not in ("fused_view", "table_read"):
        return layout.permute(t, args, kwargs, result)
    dims = argument(args, kwargs, 1, "dims")
    dims = tuple(d % len(v.shape) for d in (dims if isinstance(dims, (tuple, list)) else args[1:]))
    if v.pending == "table_read":
        return tables.heads_first(v, dims, result)
    lead = len(v.shape) - 4
    if dims != (lead + 1, *range(lead), lead + 2, lead, lead + 3):
        raise Refused(f"the permutation {dims} of a fused projection's view {tuple(v.shape)}; read: (2, 0, 3, 1, 4)")
    return Value(v.expr, tuple(result.shape), pending="fused", layout=v.layout)


def getitem(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """qkv[i] of a fused projection viewed as (k, B, H, n, d): piece i; a slice of the last axis (``rotary.select``);
    an axis added to key/value heads (``rotary.unsqueeze_heads``); heads chosen, or one head (``groups.select``); a
    parameter at a constant integer index (``tables.indexed``); any other index as ``layout.indexing``."""
    v = t.value(args[0]) if t.traced(args[0]) else None
    if v is not None and v.pending == "fused" and isinstance(args[1], int):
        return _fused_piece(t, v, args[1] % v.layout[0], result)
    if v is not None and v.pending == "fused_view":
        return _strided_piece(t, v, args[1], result)
    if v is not None and v.pending == ORDERED:  # a top-k's or sort's values: one column, a row's j-th value
        return masks.column(t, v, args[1], result)
    if v is not None and id(args[0]) not in t.floats and (read := tables.indexed(t, args[0], args[1], result)):
        return read  # T[idx] of a parameter at a constant integer index: Swin's table (``tables.indexed``)
    if v is not None and not v.is_scalar and id(args[0]) not in t.floats:  # (a float argument: perhaps a mask)
        found = rotary.select(t, args, kwargs, result) or rotary.unsqueeze_heads(t, args, kwargs, result)
        found = found or groups.select(t, args, kwargs, result)
        if found is not None:
            return found
    return layout.indexing(t, args, kwargs, result)


def _strided_piece(t: Trace, v: Value, index: object, result) -> Value:
    """fused[..., i, :] of a fused projection's view (…, n, a, b, d), BLOOM's and Falcon's (…, n, H, 3, d): piece i of
    each of the a groups, the columns p·b·d + i·d + j of A, as A S (S the constant selection, (a·b·d) × (a·d)) split
    into a heads, right after the view into heads (a transpose(1, 2) follows)."""
    index = index if isinstance(index, tuple) else (index,)
    ndim, full = len(v.shape), slice(None)
    if index.count(Ellipsis) == 1:
        at = index.index(Ellipsis)
        index = (*index[:at], *(full,) * (ndim - len(index) + 1), *index[at + 1 :])
    index = (*index, *(full,) * (ndim - len(index)))
    picked = index[-2] if len(index) == ndim else None
    if not isinstance(picked, int) or any(i != full for k, i in enumerate(index) if k != ndim - 2):
        raise Refused(
            f"an index {index} of a fused projection's view {tuple(v.shape)}; read: [..., i, :] (a piece of each "
            "head), or permute(2, 0, 3, 1, 4) then unbind(0) or [i]"
        )
    groups, pieces = v.layout
    width = v.shape[-1]
    s = torch.zeros(groups * pieces * width, groups * width, dtype=result.dtype)
    for p in range(groups):
        rows = p * pieces * width + (picked % pieces) * width + torch.arange(width)
        s[rows, p * width + torch.arange(width)] = 1
    head = t.dims.divisible(v.cols, groups * pieces)  # d, the width of a head
    symbol = named_constant(t, s, "S", (v.cols, groups * head))
    return Value(split_heads(product(v.expr, symbol), groups), tuple(result.shape), groups, pending="split")


def addmm(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.addmm(b, X, W, beta=β, alpha=α) = β 𝟏 b + α X W, X flattened rows or a matrix: Conv1D's x·W + b; with
    an input other than a traced bias row, β·input + α X W (``merged.scaled_sum``)."""
    beta, alpha = argument(args, kwargs, 3, "beta", 1), argument(args, kwargs, 4, "alpha", 1)
    bias, x, w = args[0], argument(args, kwargs, 1, "mat1"), argument(args, kwargs, 2, "mat2")
    if not (isinstance(bias, torch.Tensor) and bias.ndim == 1 and t.traced(x)):
        return merged.scaled_sum(t, bias, x, w, beta, alpha, result)
    xv, wv, b = matrix(t.value(x), "left factor", flat=True), matrix(t.value(w), "right factor"), t.value(bias)
    if len(wv.shape) != 2:
        raise Refused("addmm of a matrix and a bias row; read: addmm(b, X, W) with W 2-D and b of shape (d,)")
    t.dims.equate(xv.cols, wv.rows)
    if b.cols != 1:
        t.dims.equate(t.value(bias).cols, t.value(w).cols)
    xv, wv, b = (t.value(z) for z in (x, w, bias))
    t.dims.contracted.append(xv.cols)
    out = product(t.value(alpha, (xv.cols,)).expr, xv.expr, wv.expr)
    if beta != 0:  # β = 0: the bias ignored
        term = product(t.value(beta).expr, OneMatrix(xv.rows, 1), b.expr)
        out = total(out, term if b.cols != 1 else product(term, OneMatrix(1, wv.cols)))
    return Value(out, tuple(result.shape), None, xv.pending, inner=xv.cols, layout=xv.layout)
