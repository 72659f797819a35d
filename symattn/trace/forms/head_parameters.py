"""A parameter with a heads axis read per head: a gate or temperature per head, a per-head table cut to the length.

A parameter p of H > 1 heads is one of (H,) — a gate, a temperature, a slope per head — or (…, H, N, M) with its
leading axes of size 1 — a learned bias per head over positions. Its canonical view is the (H, N, M) array
(N = M = 1 for (H,)). The code lines its heads up with per-head values (…, H, n, m) by a view that keeps its entries
in order — ``gate.view(1, H, 1, 1)``, ``gate.reshape(H, 1, 1)``, ``gate[None, :, None, None]``, ``gate[:, None,
None]``, ``gate.unsqueeze(-1).unsqueeze(-1)``, ``gate[torch.arange(H)]`` first — or reads it cut to lengths,
``table[:, :n, :m]``, ``table[..., :n, :n]``: a result (…, H, a, b), leading axes of size 1, of an index that keeps
the entries in order from each axis's start (``_in_order``) and equal to the canonical view's p[:, :a, :b] at the
example, is the per-head read (``read``):

- N = M = 1 (a value per head): the spec input g (1 × H: torch's (H,), which generated forward takes as it is) read
  as ``sa.entries(n, m, lambda i, j, h: g[0, h], heads=H)``, made at the rows and columns of the values it meets
  (``widened``, where torch broadcasts it); an entrywise function of it whose scalar form is a position formula
  (exp, sigmoid: a temperature, a gate) is that formula of the read (``folded``).
- otherwise (a table): the spec input T of a × (H·b), each head's first a rows and b columns side by side (head h
  in columns h·b … (h+1)·b − 1, the layout of every per-head constant), the per-head value split_heads(T, H), which
  is ``sa.entries(a, b, lambda i, j, h: T[i, b·h + j], heads=H)``. a and b are lengths the code read off a traced
  tensor (``q.shape[-2]``) where the table is cut, the table's own sizes where it is read whole (then equal to the
  lengths of the values it meets).

Generated code takes T so laid out; the drop-in lays the parameter out at each call (``spec_layout``: a view of it,
through which autograd hands back its gradient, zero on the rows and columns beyond the lengths). At lengths beyond
the table the original code fails, and so does the drop-in, in one line: never a read outside the table.

Arguments given split into heads, (B, H, n, d), have no heads to the trace (that axis is a batch axis) until such a
read meets a value made of them: then it traces again with them read as heads (``HeadsFirst``).
"""

from __future__ import annotations

import sympy as sp
import torch
from sympy import MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.ops import merge_heads, split_heads
from symattn.lang.positions import entries
from symattn.trace.tracer import Trace
from symattn.trace.values import Refused, Value

HEAD = sp.Symbol("h", integer=True, nonnegative=True)  # the head in a per-head formula f(h)
VIEW = "head_parameter"  # Value.layout[0] of a 1-D parameter's view on the way to its heads' axis: (VIEW, p, name)
READ = "per_head_read"  # Value.layout[0] of a value per head (N = M = 1): (READ, f(h)), made at any rows and cols
TABLE = "per_head_table"  # Value.layout[0] of a per-head table's read: (TABLE,)
TAGS = (READ, TABLE)


def canonical(p: torch.Tensor) -> tuple[int, int, int] | None:
    """(H, N, M) of a parameter with a heads axis (see the module docstring); None for any other."""
    if p.ndim == 1 and p.shape[0] > 1:
        return int(p.shape[0]), 1, 1
    if p.ndim >= 3 and all(s == 1 for s in p.shape[:-3]) and p.shape[-3] > 1:
        return tuple(int(s) for s in p.shape[-3:])
    return None


def spec_layout(p: torch.Tensor, layout: tuple[int, int, int]):
    """The parameter as the spec's input of a per-head table: (H, N, M) cut to (H, a, b), laid out a × (H·b) (head h
    in columns h·b … (h+1)·b − 1); a view autograd differentiates, the gradient zero beyond a and b."""
    heads, a, b = layout
    n, m = p.shape[-2:]
    if a > n or b > m:
        raise SymattnError(f"drop_in: the parameter of shape {tuple(p.shape)} is read at {a} × {b}, beyond its size")
    return p.reshape(heads, n, m)[:, :a, :b].transpose(0, 1).reshape(a, heads * b)


def first(rule, name: str):
    """A layout rule (view, reshape, [...], unsqueeze: each keeps the entries' order, an index only as ``_in_order``
    says) that reads a parameter per head first (``read``)."""

    def wrapped(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        ordered = name != "__getitem__" or _in_order(args[1])
        found = read(t, args[0], result) if ordered and isinstance(result, torch.Tensor) else None
        return found if found is not None else rule(t, args, kwargs, result)

    wrapped.__doc__ = rule.__doc__
    return wrapped


def _in_order(index: object) -> bool:
    """Whether an index keeps the entries it takes in their order, each axis from its start: new axes (None), ``...``,
    slices from 0 with step 1, and an integer index 0, 1, …, k − 1 (``gate[torch.arange(H)]``). The read's values are
    then checked against the parameter's at the example (``read``); a permutation, a shifted slice or a step is not
    read per head, whatever its values at the example (a parameter initialised to zeros reads the same either way)."""
    for item in index if isinstance(index, tuple) else (index,):
        if isinstance(item, slice):
            if item.start not in (None, 0) or item.step not in (None, 1):
                return False
        elif isinstance(item, (torch.Tensor, list)):
            taken = torch.as_tensor(item)
            if taken.ndim != 1 or taken.is_floating_point() or taken.dtype == torch.bool:
                return False
            if not torch.equal(taken.cpu(), torch.arange(len(taken), dtype=taken.dtype)):
                return False
        elif item is not None and item is not Ellipsis:
            return False
    return True


def _source(t: Trace, tensor: object) -> tuple[torch.Tensor, str] | None:
    """(the parameter, its input's name) of the parameter itself or of a view of it (``VIEW``); else None."""
    if not t.traced(tensor):
        return None
    v = t.values[id(tensor)]
    if v.layout is not None and v.layout[0] == VIEW:
        return v.layout[1], v.layout[2]
    if not isinstance(tensor, torch.nn.Parameter) or canonical(tensor) is None:
        return None
    name = str(getattr(v.expr, "name", ""))
    return tensor, name if name in {n for n, _ in t.inputs} else None


def read(t: Trace, tensor: object, result: torch.Tensor) -> Value | None:
    """The per-head read of a parameter (see the module docstring) made by a layout operation's result, a view on the
    way to it (a 1-D parameter's (H,) or (H, 1)), or None (the operation's own rule reads it)."""
    source = _source(t, tensor)
    if source is None or source[1] is None:
        return None
    p, name = source
    heads, rows, cols = canonical(p)
    whole, shape = p.detach().reshape(heads, rows, cols), tuple(result.shape)
    if len(shape) >= 3 and all(s == 1 for s in shape[:-3]) and shape[-3] == heads:
        a, b = shape[-2:]
        if a <= rows and b <= cols and torch.equal(result.reshape(heads, a, b), whole[:, :a, :b]):
            return _per_head(t, p, name, (a, b), shape)
        return None
    if p.ndim == 1 and shape in ((heads,), (heads, 1)) and torch.equal(result.reshape(-1), p.detach()):
        symbol = t.values[id(tensor)].expr if tensor is p else t.values[id(p)].expr
        return Value(symbol if shape == (heads,) else symbol.T, shape, layout=(VIEW, p, name))
    return None


def _per_head(t: Trace, p: torch.Tensor, name: str, cut: tuple[int, int], shape: tuple) -> Value:
    """p read per head at its first cut = (a, b) rows and columns (see the module docstring)."""
    heads, rows, cols = canonical(p)
    t.kept.append(p)
    if (rows, cols) == (1, 1):
        symbol = _relaid(t, p, name, (sp.Integer(1), sp.Integer(1)), (heads, 1, 1))
        formula = symbol[0, HEAD]
        expr = entries(1, 1, lambda i, j, h: formula.xreplace({HEAD: h}), heads=heads).expr
        return Value(expr, shape, heads, layout=(READ, formula))
    lengths = tuple(_length(t, size, full, name) for size, full in zip(cut, (rows, cols)))
    symbol = _relaid(t, p, name, lengths, (heads, *cut))
    return Value(split_heads(symbol, heads), shape, heads, layout=(TABLE,))


def _length(t: Trace, size: int, full: int, name: str) -> sp.Basic:
    """A per-head table's length: the table's own where read whole (a fresh dimension), else one the code read."""
    if size == 1:
        return sp.Integer(1)
    if size == full:
        return t.dims.fresh(size, ("rows", name))
    length = t.position_number(int(size))
    if not (isinstance(length, sp.Expr) and length.free_symbols):
        raise Refused(
            f"the parameter {name} cut to {size} rows or columns of {full}: read are cuts to lengths the code read "
            "off a traced tensor (q.shape[-2])"
        )
    return length


def _relaid(t: Trace, p: torch.Tensor, name: str, lengths: tuple, layout: tuple[int, int, int]) -> MatrixSymbol:
    """The spec input of the per-head parameter, lengths[0] × (H·lengths[1]), in place of its own (one layout)."""
    heads = layout[0]
    k = next(k for k, (n, _) in enumerate(t.inputs) if n == name)
    held = t.head_layouts.get(name)
    if held is not None:
        if held != layout:
            raise Refused(f"the parameter {name} read per head at two cuts, {held[1:]} and {layout[1:]}")
        return t.inputs[k][1]
    symbol = MatrixSymbol(name, lengths[0], heads * lengths[1])
    if p.ndim != 1:  # (H,) is the spec's 1 × H row as it is; any other is laid out by the drop-in
        t.head_layouts[name] = layout
    t.inputs[k] = (name, symbol)
    return symbol


def widened(v: Value, other: Value) -> Value:
    """v, a value per head (``READ``), made at other's rows and columns where torch broadcasts it; else v."""
    if v.layout is None or v.layout[0] != READ or other.is_scalar or (v.rows, v.cols) == (other.rows, other.cols):
        return v
    formula = v.layout[1]
    expr = entries(other.rows, other.cols, lambda i, j, h: formula.xreplace({HEAD: h}), heads=v.heads).expr
    return Value(expr, v.shape, v.heads, layout=v.layout)


def folded(v: Value, record: type) -> Value | None:
    """record's entrywise function of a value per head (``READ``) as the formula of the read, f(g[0, h]) (exp of a
    temperature, a sigmoid gate); None where v is no such value or f is no position formula."""
    if v.layout is None or v.layout[0] != READ:
        return None
    formula = record.scalar(v.layout[1])
    try:
        expr = entries(v.rows, v.cols, lambda i, j, h: formula.xreplace({HEAD: h}), heads=v.heads).expr
    except SymattnError:
        return None
    return Value(expr, v.shape, v.heads, layout=(READ, formula))


def operand(t: Trace, tensor: object, other: object) -> None:
    """A parameter with a heads axis meeting per-head values as it is ((H, 1, 1), (1, H, n, m)): bound to its
    per-head read (``read``), so that every later use reads it so. A read per head (or such a parameter) meeting
    values whose axis −3 of H entries is a batch axis of the arguments (they were given split into heads, (B, H, n,
    d)): the signal to trace again with the arguments read as heads (``HeadsFirst``)."""
    if not t.traced(other) or not isinstance(tensor, torch.Tensor):
        return
    met = t.values[id(other)]
    if t.traced(tensor) and t.values[id(tensor)].layout is not None and t.values[id(tensor)].layout[0] in TAGS:
        heads = t.values[id(tensor)].heads
    elif isinstance(tensor, torch.nn.Parameter) and (found := read(t, tensor, tensor)) is not None and found.heads:
        heads = found.heads
        if met.heads is not None:
            t.bind(tensor, found)
    else:
        return
    batched = met.heads is None and len(met.shape) >= 3 and met.shape[-3] == heads
    if batched and t.heads_first is None:
        raise HeadsFirst(heads)


class HeadsFirst(Exception):  # a signal to trace again, not an error
    """A parameter read per head met values whose axis −3 is a batch axis of H entries: the forward's arguments were
    given split into heads, (…, H, n, d). Traced again with each float argument of H entries there read as the
    per-head value split_heads(X, H) of X, n × (H·d) (``split_arguments``), and the per-head output merged back
    (``merged``): generated code takes (…, n, H·d), and the drop-in hands it the arguments so and the output back."""

    def __init__(self, heads: int) -> None:
        super().__init__(heads)
        self.heads = heads


def split_arguments(t: Trace, bound: dict, arguments: list[str]) -> None:
    """With t.heads_first = H: each float argument input (…, H, n, d) is the spec's X of n × (H·d), its value
    split_heads(X, H); the batch axes those before the heads."""
    heads = t.heads_first
    if heads is None:
        return
    for k, pname in enumerate(arguments):
        x = bound[pname]
        if x.ndim < 3 or x.shape[-3] != heads:
            continue
        name, symbol = t.inputs[k]
        wide = MatrixSymbol(name, symbol.rows, heads * symbol.cols)
        t.inputs[k] = (name, wide)
        value = t.bind(x, Value(split_heads(wide, heads), tuple(x.shape), heads))
        t.known[id(value)] = value
        if k == 0:
            t.batch = tuple(x.shape[:-3])


def merged(t: Trace, output: Value) -> Value:
    """The output of a trace with its arguments split into heads (``HeadsFirst``): per head (…, H, n, d_v), merged
    to the spec's n × (H·d_v) (the drop-in splits generated code's output back); any other as it is."""
    if t.heads_first is None or output.heads != t.heads_first or output.pending is not None:
        return output
    return Value(merge_heads(output.expr, output.heads), output.shape, layout=("merged_heads",))
