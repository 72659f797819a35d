"""A learned table read at positions: ``F.embedding(index, weight)`` (``nn.Embedding``) of a parameter at an index
the code made of positions (T5's relative attention bias at its relative-position buckets).

The index (rows, cols) is read as an integer formula r(i, j) of the query and key positions (``forms.positions``,
checked equal to every entry at the example); the read weight[r(i, j), h] (rows, cols, H) is the language's
matrix of positions per head, ``sa.entries(rows, cols, lambda i, j, h: W[r(i, j), h], heads=H)``, held with the
heads last until ``permute(2, 0, 1)`` puts them first, where it is a per-head value like the scores
(T5 then adds it to them). The table's sizes are its own (the number of buckets, of heads): fixed lengths, against
which the index is checked to stay inside for every position (``lang.positions``). Its gradient is the scatter of
the score cotangent (``lang.positions.Scatter``): a fixed-order segment sum, the same bits on every run.
"""

from __future__ import annotations

import sympy as sp

from symattn.errors import SymattnError
from symattn.lang.positions import I, J, entries
from symattn.trace.forms import positions
from symattn.trace.layout import argument, matrix
from symattn.trace.tracer import Trace
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
