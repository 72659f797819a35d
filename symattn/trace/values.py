"""What a traced tensor is in symattn's language, and the dimensions the trace discovers.

A tensor's last two axes are a matrix (tokens as rows): a ``Value`` holds that matrix expression, the
example's shape, and where it stands in the multi-head pattern. A 1-D tensor (d,) is the 1 × d row that
torch broadcasts it as; a 0-d tensor is a SymPy scalar. An axis of size 1 is the number 1 (a broadcast
axis); every other axis is a dimension symbol, made fresh for each input's axis and merged (``Dims.equate``)
where an operation needs two lengths equal, so coincidentally equal example sizes stay distinct dimensions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import sympy as sp
from sympy import Basic

from symattn.errors import SymattnError
from symattn.lang.dims import dim
from symattn.lang.functions import StopGradient, sg


class Refused(SymattnError):
    """An operation the trace cannot express; the tracer adds the operation's name and the user's line."""


@dataclass(eq=False)
class Value:
    """A traced tensor: ``expr`` its last two axes (a SymPy scalar for a 0-d tensor), ``shape`` the example's.

    ``heads``: H for a per-head tensor (…, H, rows, cols), the H blocks of ``split_heads``.
    ``pending``: "split" for (…, n, H, d) right after the view into heads (a transpose(1, 2) must follow),
    "merge" for (…, n, H, d) after the transpose back (a view/reshape to (…, n, H·d) must follow);
    "flat" for rows flattened (B·n, c), "fused_view" and "fused" for a fused projection's view (…, n, k, H, d) and
    its permutation (k, …, H, n, d) (``forms.blocks``).
    """

    expr: Basic
    shape: tuple[int, ...]
    heads: int | None = None
    pending: str | None = None
    inner: Basic | None = None  # for a product's result, the length it contracted (a scale's √d_k is read by it)
    layout: tuple | None = None  # a pending form's sizes: "flat" its leading axes (…, n), "fused…" its (k, H)
    shift: object = None  # the row max it holds, as a softmax's shift (``forms.shift.Shift``); None: none

    @property
    def is_scalar(self) -> bool:
        return len(self.shape) == 0

    @property
    def rows(self) -> Basic:
        return self.expr.shape[0]

    @property
    def cols(self) -> Basic:
        return self.expr.shape[1]

    def substitute(self, mapping: dict) -> None:
        """Rewrite the expression in place after two dimensions were made one."""
        self.expr = self.expr.xreplace(mapping)
        if self.inner is not None:
            self.inner = sp.sympify(self.inner).xreplace(mapping)


# pending states that only the rules named in ``KEEPS`` may read (each keeps or ends the state): why others refuse
GUARDED = {
    "unread": "nn.MultiheadAttention's attention weights (need_weights=True) are not read; call it with "
    "need_weights=False (nn.TransformerEncoderLayer and nn.TransformerDecoderLayer do)",
    "seq_first": "a tensor in the (n, B, c) layout, sequence first: read are its transpose(0, 1) back to (B, n, c) "
    "and torch's own multi-head attention on it",
    "table_read": "a table read at positions, (rows, cols, heads): read is its permute(2, 0, 1), heads first",
    "index_read": "a table read at a constant index (rows·cols, heads): read is its view (rows, cols, heads)",
}
# an order statistic's pieces (``forms.masks``): its values, read by one column of them; its indices, unread
ORDERED, INDICES = "ordered", "order_indices"
GUARDED[ORDERED] = "the values of topk or sort are read as one column of them, [..., j:j+1] (a row's j-th value)"
GUARDED[INDICES] = (
    "the indices of topk, sort or kthvalue are not read (a mask of the top k: compare with the k-th value, "
    "s >= s.topk(k, dim=-1).values[..., -1:])"
)
KEEPS = {
    "seq_first": frozenset({"transpose", "swapaxes", "swapdims", "permute", "contiguous", "clone"}),
    "table_read": frozenset({"permute"}),
    "index_read": frozenset({"view", "reshape"}),
    ORDERED: frozenset({"__getitem__"}),
}


def stopped(value: Value) -> Value:
    """value as a stop-gradient: sg(A) of a matrix, sg(x) of a number (detach(), .data, a call under the code's
    torch.no_grad()): its value, differentiated as a constant."""
    if value.shift is not None or value.pending == INDICES:  # a row max as a softmax's shift: the shift cancels
        return value
    if value.pending == ORDERED:  # an order statistic's values: the column read of them is stopped
        return replace(value, layout=(*value.layout[:2], True))
    if value.pending is not None:
        raise Refused("a stop-gradient (detach, torch.no_grad()) of a view halfway into heads")
    if isinstance(value.expr, StopGradient):  # sg(sg(A)) = sg(A)
        return value
    expr = sg(value.expr) if value.is_scalar else StopGradient(value.expr)
    return Value(expr, value.shape, value.heads, inner=value.inner, layout=value.layout)


class Dims:
    """The dimension symbols of a trace, each with its size at the example.

    ``equate(a, b)`` merges two lengths an operation needs equal (c₁·s₁ = c₂·s₂), and the substitution
    it makes is handed to ``on_merge`` so that every value built so far is rewritten.
    """

    def __init__(self, on_merge: Callable[[dict], None]) -> None:
        self.sizes: dict[sp.Symbol, int] = {}
        self.hints: dict[sp.Symbol, tuple[str, str]] = {}  # the axis that made the symbol: its name, given at the end
        self.on_merge = on_merge
        self.contracted: list[Basic] = []  # inner lengths of the matrix products, most recent last

    def fresh(self, size: int, hint: tuple[str, str]) -> Basic:
        """A new dimension of this size (the number 1 for a size-1 axis)."""
        if size == 1:
            return sp.Integer(1)
        symbol = dim(f"t_{len(self.hints)}")
        self.sizes[symbol] = int(size)
        self.hints[symbol] = hint
        return symbol

    def size(self, length: Basic) -> int:
        return int(sp.sympify(length).xreplace(self.sizes))

    def equate(self, a: Basic, b: Basic) -> None:
        """Make lengths a and b one (their example sizes are equal: torch ran the operation)."""
        a, b = sp.sympify(a), sp.sympify(b)
        if a == b:
            return
        if self.size(a) != self.size(b):
            raise Refused(f"lengths {a} and {b} differ")
        if a.is_Symbol and b.is_Symbol:  # the later symbol goes: names come from the first axis seen
            old, new = (a, b) if _index(a) > _index(b) else (b, a)
            self._merge({old: new})
            return
        if a.is_Symbol or b.is_Symbol:
            old, new = (a, b) if a.is_Symbol else (b, a)
            self._merge({old: new})
            return
        (c_a, s_a), (c_b, s_b) = (_coefficient(a), _coefficient(b))
        common = sp.ilcm(c_a, c_b)
        t = self.fresh(self.size(a) // common, self.hints[s_a])
        self._merge({s_a: (common // c_a) * t, s_b: (common // c_b) * t})

    def divisible(self, length: Basic, by: int) -> Basic:
        """length / by as a length: a symbol s of length c·s is rewritten (s = g·t) so that by divides it."""
        length = sp.sympify(length)
        c, s = _coefficient(length)
        g = by // math.gcd(c, by)
        if g > 1:
            t = self.fresh(self.size(s) // g, ("head", ""))
            self._merge({s: g * t})
            length = length.xreplace({s: g * t})
        return sp.expand(length / by)

    def _merge(self, mapping: dict) -> None:
        for old in mapping:
            self.sizes.pop(old, None)
        for new in mapping.values():
            for s in sp.sympify(new).free_symbols:
                self.sizes.setdefault(s, self.size(new))
        self.contracted = [sp.sympify(c).xreplace(mapping) for c in self.contracted]
        self.on_merge(mapping)

    def lengths(self) -> Iterable[Basic]:
        """The lengths to read a number as √d or 1/√d of: the latest contracted ones first, then every symbol."""
        seen: list[Basic] = []
        for length in (*reversed(self.contracted), *self.sizes):
            if length not in seen and self.size(length) > 1:
                seen.append(length)
        return seen


def _index(symbol: sp.Symbol) -> int:
    return int(str(symbol.name).split("_")[1])


def _coefficient(length: Basic) -> tuple[int, sp.Symbol]:
    """(c, s) with length = c·s, s a dimension symbol."""
    c, rest = sp.sympify(length).as_coeff_Mul()
    if not rest.is_Symbol or not c.is_Integer:
        raise Refused(f"the length {length} is not a whole multiple of one dimension")
    return int(c), rest


def number(x: float | int, dims: Dims, prefer: Iterable[Basic] = (), read: dict[int, Basic] | None = None) -> Basic:
    """A Python number as a SymPy number: an int equal to a length the code read off a traced tensor (``read``:
    ``k.size(-2)``, ``q.shape``) as that length, and a float equal to one or its reciprocal (a mean over the keys,
    ReLU attention's 1/m) as that expression; any other int exactly; a float equal at the example to one of the
    forms of the dimensions (``_forms``: √d, 1/√d, ±log d, and a root times a log, log n/√d: a score scale or sigmoid
    attention's bias −log m, computed from sizes) as that expression; any other float as its simplest exact form
    (0.1 → 1/10, √(2/π) stays √2/√π) when that form rounds back to it, else as it is."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Refused(f"the number {x!r} of type {type(x).__name__}")
    for size, length in (read or {}).items():
        if x == size or (isinstance(x, float) and math.isclose(x * size, 1.0, rel_tol=1e-13)):
            return length if x == size else 1 / length
    if isinstance(x, int):
        return sp.Integer(x)
    if not math.isfinite(x):
        raise Refused(f"the number {x}")
    lengths = dict.fromkeys((*prefer, *dims.lengths()))  # the preferred lengths first
    for value, form in _forms({length: size for length in lengths if (size := dims.size(length)) > 1}):
        if math.isclose(x, value, rel_tol=1e-13):
            return form()
    return literal(x)


# a length's expressions a float is read as: (the expression of the length d, its value at d's size s)
ROOTS = ((sp.sqrt, math.sqrt), (lambda d: 1 / sp.sqrt(d), lambda s: 1 / math.sqrt(s)))
LOGS = ((sp.log, math.log), (lambda d: -sp.log(d), lambda s: -math.log(s)))


def _forms(sizes: dict[Basic, int]) -> Iterator[tuple[float, Callable[[], Basic]]]:
    """(value, its expression made on demand) of each form a float is tried against, the preferred lengths first:
    each length's √d, 1/√d, log d and −log d, then each root times a length's ±log (log n/√d). Values by math on
    the sizes: a float of no form costs no SymPy expression."""
    for length, size in sizes.items():
        for make, value in (*ROOTS, *LOGS):
            yield value(size), lambda make=make, length=length: make(length)
    for (a, r), (b, s) in itertools.product(sizes.items(), repeat=2):
        for (root, root_value), (log, log_value) in itertools.product(ROOTS, LOGS):
            yield root_value(r) * log_value(s), lambda root=root, log=log, a=a, b=b: root(a) * log(b)


def literal(x: float | int) -> Basic:
    """A number that is no dimension's expression (eps, a fill value, a cap) as its simplest exact form."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise Refused(f"the number {x!r} of type {type(x).__name__}")
    if isinstance(x, int) or x.is_integer():
        return sp.Integer(int(x))
    if not math.isfinite(x):
        raise Refused(f"the number {x}")
    simple = sp.nsimplify(x, [sp.pi])
    if math.isclose(float(simple), x, rel_tol=1e-15, abs_tol=0.0):
        return simple
    return sp.Float(x)
