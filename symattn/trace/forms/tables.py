"""A learned table read at positions: ``F.embedding(index, weight)`` (``nn.Embedding``) of a parameter at an index
the code made of positions (T5's relative attention bias at its relative-position buckets).

The index (rows, cols) is read as an integer formula r(i, j) of the query and key positions (``forms.positions``,
checked equal to every entry at the example); the read weight[r(i, j), h] (rows, cols, H) is the language's
matrix of positions per head, ``sa.entries(rows, cols, lambda i, j, h: W[r(i, j), h], heads=H)``, held with the
heads last until ``permute(2, 0, 1)`` puts them first, where it is a per-head value like the scores
(T5 then adds it to them). The table's sizes are its own (the number of buckets, of heads): fixed lengths, against
which the index is checked to stay inside for every position (``lang.positions``). Its gradient is the scatter of
the score cotangent (``lang.positions.Scatter``): a fixed-order segment sum, the same bits on every run.

A parameter indexed by a constant integer tensor (Swin's ``relative_position_bias_table[relative_position_index
.view(-1)]``, the index a buffer made at construction) is the nested read ``T[idx[r, c], h]``: the index becomes a
spec constant named after its buffer, and the read, viewed (rows, cols, H) (one index of rows·cols entries, read
as the row idx[0, cols·i + j]) or made so (an index of rows × cols), is the per-head matrix of positions as above,
pending its permute(2, 0, 1). The constant's values are no size's: generated code checks them where given.
"""

from __future__ import annotations

import re

import sympy as sp
import torch
from sympy import MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.positions import I, J, entries
from symattn.trace.constants import Ref
from symattn.trace.forms import positions
from symattn.trace.layout import argument, matrix
from symattn.trace.tracer import Constant, Trace
from symattn.trace.values import Refused, Value


def embedding(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.embedding(index, weight): the table weight (K, H) read at an index made of positions (see the module
    docstring), pending its permute(2, 0, 1)."""
    index, weight = args[0], argument(args, kwargs, 1, "weight")
    for option, default in (("padding_idx", 2), ("max_norm", 3)):
        if argument(args, kwargs, default, option) is not None:
            raise Refused(f"embedding with {option}: read is a plain table read (nn.Embedding's defaults)")
    if t.traced(index) or not t.traced(weight):
        raise Refused("embedding of a traced index, or of a constant table: read is a parameter read at positions")
    formula = positions.index(t.program, index, t)
    if formula is None:
        raise Refused(
            "embedding at an index not made of positions (torch.arange and the operations on it that "
            "docs/from_torch.md lists, its entries equal to the formula at the example)"
        )
    table = matrix(t.value(weight), "weight").expr
    for length, size in zip(table.shape, weight.shape):
        t.dims.equate(length, int(size))  # the table's own sizes: the buckets, the heads
    table = t.value(weight).expr
    rows, cols = (t.position_number(int(s)) for s in index.shape)
    if not all(isinstance(s, sp.Expr) and s.free_symbols for s in (rows, cols)):
        raise Refused(f"embedding at positions over {tuple(index.shape)}: read are lengths the code read (a size)")
    try:
        read = lambda i, j, h: table[formula.xreplace({I: i, J: j}), h]  # noqa: E731
        expr = entries(rows, cols, read, heads=int(weight.shape[1])).expr
    except SymattnError as err:
        raise Refused(str(err)) from None
    return Value(expr, tuple(result.shape), pending="table_read")


def heads_first(v: Value, dims: tuple, result) -> Value:
    """permute(2, 0, 1) of a table read (rows, cols, H): the per-head value (H, rows, cols)."""
    if dims != (2, 0, 1):
        raise Refused(f"the permutation {dims} of a table read (rows, cols, heads); read: (2, 0, 1)")
    return Value(v.expr, tuple(result.shape), int(result.shape[0]))


def indexed(t: Trace, weight: torch.Tensor, index: object, result) -> Value | None:
    """weight[index] of a traced 2-D table (a parameter, as it is) at a constant integer tensor index of one or two
    axes: the read pending its view (rows, cols, H) (``viewed``), or of an index of rows × cols, the read itself;
    None for anything else (a slice, a traced index, a table computed from others)."""
    v = t.value(weight)
    if not isinstance(index, torch.Tensor) or t.traced(index) or index.is_floating_point() or index.dtype == torch.bool:
        return None
    if v.pending is not None or v.heads is not None or len(v.shape) != 2 or index.ndim not in (1, 2):
        return None
    if not isinstance(v.expr, MatrixSymbol):  # a table made of others: no matrix of the language is read at positions
        return None
    if index.ndim == 2:
        return _read(t, weight, index, tuple(index.shape), result)
    return Value(v.expr, tuple(result.shape), pending="index_read", layout=(index, weight))


def viewed(t: Trace, v: Value, result) -> Value:
    """view(rows, cols, H) of table[index] (``indexed``): the read T[idx[0, cols·i + j], h] per head."""
    index, weight = v.layout
    shape = tuple(result.shape)
    if len(shape) != 3 or shape[0] * shape[1] != v.shape[0] or shape[2] != v.shape[1]:
        raise Refused(f"a view {shape} of a table read at a constant index {v.shape}; read: (rows, cols, heads)")
    return _read(t, weight, index, shape[:2], result)


def _read(t: Trace, weight: torch.Tensor, index: torch.Tensor, positions: tuple[int, int], result) -> Value:
    """weight[idx[…], h] over positions (rows, cols), lengths the code read: idx the index as a spec constant."""
    rows, cols = (t.position_number(int(s)) for s in positions)
    if not all(isinstance(s, sp.Expr) and s.free_symbols for s in (rows, cols)):
        raise Refused(f"a table read at a constant index over {positions}: read are lengths the code read (a size)")
    for length, size in zip(matrix(t.value(weight), "weight").expr.shape, weight.shape):
        t.dims.equate(length, int(size))  # the table's own sizes: its entries, the heads
    table = t.value(weight).expr
    flat = index.ndim == 1
    symbol = MatrixSymbol(_constant_name(t, index), *((1, rows * cols) if flat else (rows, cols)))
    t.constants.append(Constant(symbol, t.program.ref(index), "as_is"))
    t.kept.append(index)
    at = (lambda i, j: symbol[0, cols * i + j]) if flat else (lambda i, j: symbol[i, j])
    try:
        expr = entries(rows, cols, lambda i, j, h: table[at(i, j), h], heads=int(weight.shape[1])).expr
    except SymattnError as err:
        raise Refused(str(err)) from None
    return Value(expr, tuple(result.shape), pending="table_read")


def _constant_name(t: Trace, index: torch.Tensor) -> str:
    """The index constant's name: the buffer it is made from (its last dotted part), else I; a free name."""
    ref, name = t.program.sources.get(id(index)), "I"
    while ref is not None and ref.kind not in ("buffer", "arg", "item", "literal"):  # a call's result: its first input
        _, args, _ = t.program.steps[ref.key]
        ref = next((a for a in args if isinstance(a, Ref)), None)
    if ref is not None and ref.kind == "buffer":
        name = re.sub(r"\W", "_", str(ref.key).rsplit(".", 1)[-1])
    taken = {str(c.symbol.name) for c in t.constants} | set(t.masks.values()) | {n for n, _ in t.inputs}
    return next(x for x in (name, *(f"{name}_{k}" for k in range(2, 99))) if x not in taken)
