"""A constant the code builds from positions (``torch.arange``), read as the language's matrix of positions.

Masks and biases of eager attention code are tensors of the positions: ``i - j`` of two aranges broadcast against
each other, ``(j <= i) & (i - j < w)``, ``-slope * (i - j).abs()``, ``torch.ones(n, n).tril()``. Traced as a
constant they would be an n × m array passed to the generated code. Here the constant program's steps that made
the tensor are run once more on SymPy expressions of the index along each axis (``Axes``), through the table
``RULES``; if every step is in it and the result has the scores' two axes, it is the formula f(i, j) of a matrix
of positions (``lang.positions``), with the sizes the code read off traced tensors as the dimensions they are.

The formula is checked against the tensor itself at the example (every entry, exactly as the dtype holds it):
a constant whose formula would differ anywhere stays a constant, so the reading can only change how the entries
are computed, never what they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import sympy as sp
import torch
from sympy import Basic
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanAtom, BooleanFunction

from symattn.lang.positions import Entries, I, J, check_formula
from symattn.trace.constants import Program, Ref

# the index along an axis, by its position from the last (-1: the last axis); broadcasting aligns axes from the last
AXES = {k: sp.Symbol(f"_x{-k}", integer=True, nonnegative=True) for k in range(-1, -9, -1)}


@dataclass(frozen=True)
class Axes:
    """A tensor as a formula of its indices: of shape ``shape``, entry x = ``expr`` at the AXES of its axes."""

    shape: tuple[int, ...]
    expr: Basic

    def broadcast(self, shape: tuple[int, ...]) -> Axes:
        """This tensor broadcast to shape (its size-1 axes read at index 0)."""
        flat = {AXES[-1 - k]: 0 for k, size in enumerate(reversed(self.shape)) if size == 1}
        return Axes(shape, self.expr.xreplace(flat) if flat else self.expr)


class NotPositions(Exception):  # a step outside the table: the constant stays a constant
    """The tensor is not (or not only) a function of positions."""


def _shape(*operands: Axes) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(a.shape for a in operands)))


def _values(operands: list[Axes]) -> list[Basic]:
    shape = _shape(*operands)
    return [a.broadcast(shape).expr for a in operands]


def _logical(x: Basic) -> bool:
    """Whether x is a truth value (a comparison, a connective, true or false) rather than a number."""
    return isinstance(x, (Relational, BooleanFunction, BooleanAtom))


def _number(x: Basic) -> Basic:
    """A bool as 1 or 0 where a number is needed (a mask multiplied in, summed, or cast to float)."""
    return sp.Piecewise((1, x), (0, True)) if _logical(x) else x


def _bool(x: Basic) -> Basic:
    return x if _logical(x) else sp.Ne(x, 0)


def _truncated(x: Basic) -> Basic:
    """x cast to an integer dtype: rounded toward zero (an integer expression as itself)."""
    if x.is_integer:
        return x
    return sp.Piecewise((sp.floor(x), x >= 0), (sp.ceiling(x), True))


def _elementwise(combine: Callable[..., Basic], numbers: bool = True) -> Callable:
    def rule(operands: list[Axes]) -> Axes:
        values = _values(operands)
        return Axes(_shape(*operands), combine(*(_number(v) if numbers else v for v in values)))

    return rule


def _tril(operands: list[Axes], diagonal: int = 0, lower: bool = True) -> Axes:
    (a,) = operands
    row, col = AXES[-2], AXES[-1]
    keep = col - row <= diagonal if lower else col - row >= diagonal
    if _logical(a.expr):
        return Axes(a.shape, sp.And(a.expr, keep))
    return Axes(a.shape, sp.Piecewise((a.expr, keep), (0, True)))


def _where(operands: list[Axes]) -> Axes:
    cond, a, b = _values(operands)
    return Axes(_shape(*operands), sp.Piecewise((_number(a), _bool(cond)), (_number(b), True)))


def _masked_fill(operands: list[Axes]) -> Axes:
    x, mask, value = _values(operands)
    return Axes(_shape(*operands), sp.Piecewise((value, _bool(mask)), (_number(x), True)))


def _clamp(operands: list[Axes]) -> Axes:
    x, low, high = (*operands, None, None)[:3]
    expr = _number(x.expr)
    if low is not None:
        expr = sp.Max(expr, low.broadcast(x.shape).expr)
    if high is not None:
        expr = sp.Min(expr, high.broadcast(x.shape).expr)
    return Axes(x.shape, expr)


# torch operation (op_name) → its rule on Axes operands (the tensor arguments and numbers, in the call's order)
RULES: dict[str, Callable] = {
    **dict.fromkeys(("add", "__add__", "__radd__", "add_", "__iadd__"), _elementwise(lambda a, b: a + b)),
    **dict.fromkeys(("sub", "__sub__", "sub_", "__isub__"), _elementwise(lambda a, b: a - b)),
    "__rsub__": _elementwise(lambda a, b: b - a),
    **dict.fromkeys(("mul", "__mul__", "__rmul__", "mul_", "__imul__"), _elementwise(lambda a, b: a * b)),
    **dict.fromkeys(("div", "true_divide", "__truediv__"), _elementwise(lambda a, b: a / b)),
    "__rtruediv__": _elementwise(lambda a, b: b / a),
    **dict.fromkeys(("floor_divide", "__floordiv__"), _elementwise(lambda a, b: sp.floor(a / b))),
    **dict.fromkeys(("neg", "__neg__"), _elementwise(lambda a: -a)),
    **dict.fromkeys(("abs", "__abs__"), _elementwise(sp.Abs)),
    "sign": _elementwise(sp.sign),
    "log": _elementwise(sp.log),
    "exp": _elementwise(sp.exp),
    "floor": _elementwise(sp.floor),
    "ceil": _elementwise(sp.ceiling),
    **dict.fromkeys(("maximum", "max"), _elementwise(sp.Max)),
    **dict.fromkeys(("minimum", "min"), _elementwise(sp.Min)),
    **dict.fromkeys(("eq", "__eq__"), _elementwise(sp.Eq)),
    **dict.fromkeys(("ne", "__ne__"), _elementwise(sp.Ne)),
    **dict.fromkeys(("lt", "__lt__"), _elementwise(lambda a, b: a < b)),
    **dict.fromkeys(("le", "__le__"), _elementwise(lambda a, b: a <= b)),
    **dict.fromkeys(("gt", "__gt__"), _elementwise(lambda a, b: a > b)),
    **dict.fromkeys(("ge", "__ge__"), _elementwise(lambda a, b: a >= b)),
    **dict.fromkeys(
        ("logical_and", "bitwise_and", "__and__", "__rand__"),
        _elementwise(lambda a, b: sp.And(_bool(a), _bool(b)), numbers=False),
    ),
    **dict.fromkeys(
        ("logical_or", "bitwise_or", "__or__", "__ror__"),
        _elementwise(lambda a, b: sp.Or(_bool(a), _bool(b)), numbers=False),
    ),
    **dict.fromkeys(
        ("logical_not", "bitwise_not", "__invert__"), _elementwise(lambda a: sp.Not(_bool(a)), numbers=False)
    ),
    **dict.fromkeys(("float", "double", "half", "bfloat16", "to", "type_as"), _elementwise(lambda a: a)),
    **dict.fromkeys(("long", "int", "short"), _elementwise(_truncated)),
    "bool": _elementwise(_bool, numbers=False),
    "where": _where,
    **dict.fromkeys(("masked_fill", "masked_fill_"), _masked_fill),
    **dict.fromkeys(("clamp", "clip"), _clamp),
    **dict.fromkeys(("tril", "tril_"), _tril),
    **dict.fromkeys(("triu", "triu_"), lambda ops, diagonal=0: _tril(ops, diagonal, lower=False)),
}


class Reader:
    """The constant program's steps run on Axes (see the module docstring); ``number`` reads a Python number
    (an int equal to a size the code read is that length)."""

    def __init__(self, program: Program, number: Callable[[object], Basic]) -> None:
        self.program, self.number = program, number
        self.done: dict[int, Axes] = {}

    def of(self, ref: Ref) -> Axes:
        if ref.kind != "step":
            raise NotPositions(ref.kind)  # an argument, a buffer, a literal: data, not positions
        if ref.key not in self.done:
            func, args, kwargs = self.program.steps[ref.key]
            self.done[ref.key] = self._step(func, args, kwargs)
        return self.done[ref.key]

    def _operand(self, x: object) -> Axes:
        if isinstance(x, Ref):
            return self.of(x)
        if isinstance(x, bool):
            return Axes((), sp.true if x else sp.false)
        if isinstance(x, (int, float)):
            if not math.isfinite(x):
                return Axes((), sp.oo if x > 0 else -sp.oo)
            return Axes((), self.number(x))
        raise NotPositions(type(x).__name__)

    def _step(self, func: object, args: tuple, kwargs: dict) -> Axes:
        name = getattr(func, "__name__", "")
        if name == "arange":
            return self._arange(*args, **{k: v for k, v in kwargs.items() if k in ("start", "end", "step")})
        if name in ("ones", "zeros", "full", "ones_like", "zeros_like", "full_like"):
            return self._filled(name, args, kwargs)
        if name in ("__getitem__", "unsqueeze", "expand", "expand_as", "broadcast_to", "view", "reshape"):
            return self._layout(name, args)
        rule = RULES.get(name)
        if rule is None:
            raise NotPositions(name)
        keywords = {k: v for k, v in kwargs.items() if k in ("diagonal",)}
        if name in ("clamp", "clip"):
            bounds = [
                kwargs.get("min", args[1] if len(args) > 1 else None),
                kwargs.get("max", args[2] if len(args) > 2 else None),
            ]
            operands = [self._operand(args[0]), *(None if b is None else self._operand(b) for b in bounds)]
            return rule(operands)
        if name == "to" and _integral([*args[1:], *kwargs.values()]):
            return RULES["long"]([self._operand(args[0])])
        if name in ("to", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short", "bool"):
            return rule([self._operand(args[0])])
        if name in ("tril", "tril_", "triu", "triu_"):
            diagonal = args[1] if len(args) > 1 else keywords.get("diagonal", 0)
            return rule([self._operand(args[0])], diagonal)
        return rule([self._operand(a) for a in args])

    def _arange(self, *args, start=None, end=None, step=None) -> Axes:
        numbers = [a for a in args if isinstance(a, (int, float))]
        if len(numbers) == 1:
            start, end = 0, numbers[0]
        elif len(numbers) >= 2:
            start, end = numbers[:2]
            step = numbers[2] if len(numbers) > 2 else step
        start, step = start or 0, step or 1
        if not all(isinstance(x, int) for x in (start, end, step)):
            raise NotPositions("a float arange")
        count = len(range(start, end, step))
        return Axes((count,), self.number(start) + step * AXES[-1] if start else step * AXES[-1])

    def _filled(self, name: str, args: tuple, kwargs: dict) -> Axes:
        if name.endswith("_like"):
            shape = self._operand(args[0]).shape
            rest = args[1:]
        else:
            sizes = args[0] if args and isinstance(args[0], (tuple, list)) else args
            sizes = sizes if name != "full" or not args or isinstance(args[0], (tuple, list)) else args[:-1]
            shape = tuple(int(s) for s in (kwargs.get("size") or sizes) if isinstance(s, int))
            rest = args[1:] if name == "full" and args and isinstance(args[0], (tuple, list)) else args[-1:]
        if name.startswith("full"):
            value = kwargs.get("fill_value", rest[0] if rest else None)
            return Axes(shape, self._operand(value).expr)
        dtype = kwargs.get("dtype")
        one = sp.true if dtype is torch.bool else sp.Integer(1)
        return Axes(shape, one if name.startswith("ones") else (sp.false if dtype is torch.bool else sp.Integer(0)))

    def _layout(self, name: str, args: tuple) -> Axes:
        a = self._operand(args[0])
        if name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return _indexed(a, index)
        if name == "unsqueeze":
            return _indexed(
                a,
                (Ellipsis, None)
                if args[1] in (-1, len(a.shape))
                else (*(slice(None),) * (args[1] % (len(a.shape) + 1)), None),
            )
        target = self._operand(args[1]).shape if name == "expand_as" else _sizes(args[1:], a.shape)
        if name in ("view", "reshape"):
            if [s for s in target if s != 1] != [s for s in a.shape if s != 1]:
                raise NotPositions("a reshape that moves entries")
            return _regrouped(a, target)
        return a.broadcast(tuple(target))


def _integral(options: list) -> bool:
    """Whether a ``to`` call's arguments name an integer dtype (a cast that rounds toward zero)."""
    dtypes = [x for x in options if isinstance(x, torch.dtype)]
    return any(not (x.is_floating_point or x.is_complex or x is torch.bool) for x in dtypes)


def _sizes(args: tuple, like: tuple[int, ...]) -> tuple[int, ...]:
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not all(isinstance(s, int) for s in sizes):
        raise NotPositions("sizes")
    sizes = tuple(sizes)
    known = [s for s in sizes if s != -1]
    if -1 in sizes:
        missing = math.prod(like) // max(math.prod(known), 1)
        sizes = tuple(missing if s == -1 else s for s in sizes)
    return tuple(like[len(like) - len(sizes) + k] if s == -1 else s for k, s in enumerate(sizes))


def _regrouped(a: Axes, shape: tuple[int, ...]) -> Axes:
    """a viewed as shape where only size-1 axes come or go: each axis of size > 1 keeps its index."""
    old = [k for k, s in enumerate(a.shape) if s != 1]
    new = [k for k, s in enumerate(shape) if s != 1]
    moved = {AXES[k - len(a.shape)]: AXES[m - len(shape)] for k, m in zip(old, new)}
    return Axes(shape, a.broadcast(a.shape).expr.xreplace(moved))


def _indexed(a: Axes, index: tuple) -> Axes:
    """a[index] for an index of None, full slices and one Ellipsis (new axes only)."""
    if any(not (x is None or x is Ellipsis or x == slice(None)) for x in index):
        raise NotPositions("an index that selects")
    if index.count(Ellipsis) > 1:
        raise NotPositions("two ellipses")
    taken = sum(1 for x in index if x is not None and x is not Ellipsis)
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = (*index[:k], *(slice(None),) * (len(a.shape) - taken), *index[k + 1 :])
    else:
        index = (*index, *(slice(None),) * (len(a.shape) - taken))
    shape, old_axes = [], []
    source = iter(range(len(a.shape)))
    for x in index:
        if x is None:
            shape.append(1)
            old_axes.append(None)
        else:
            k = next(source)
            shape.append(a.shape[k])
            old_axes.append(k)
    moved = {AXES[k - len(a.shape)]: AXES[m - len(shape)] for m, k in enumerate(old_axes) if k is not None}
    return Axes(tuple(shape), a.expr.xreplace(moved))


# how a constant's form (``constants.FORMS``) makes the spec's matrix of the tensor's formula (a bool's: b)
FORMED: dict[str, Callable[[Basic], Basic]] = {
    "additive": lambda b: sp.Piecewise((-sp.oo, _bool(b)), (0, True)),  # −∞ where True
    "additive_false": lambda b: sp.Piecewise((0, _bool(b)), (-sp.oo, True)),  # −∞ where False
    "keep": lambda b: sp.Piecewise((0, _bool(b)), (1, True)),  # 1 where False
    "keep_false": lambda b: sp.Piecewise((1, _bool(b)), (0, True)),  # 1 where True
    "as_is": _number,
}


def read(program: Program, tensor: torch.Tensor, form: str, shape: tuple, trace, dtype: torch.dtype) -> Entries | None:
    """The matrix of positions of ``shape`` (rows, cols) that the constant of this tensor and form is (the tensor's
    last two axes the rows and columns, any axis before them of size 1), or None where the program made it of
    anything else, or where the formula differs from the constant anywhere at the example, to the rounding of the
    traced code's dtype (a float32 bias in a float64 run must be exact: computed at float64, it would differ).
    trace: its ``position_number`` reads a number, its ``dims.size`` a dimension's size at the example."""
    from symattn.trace.constants import FORMS

    if form not in FORMED:
        return None
    formula = _formula(program, tensor, trace)
    if formula is None:
        return None
    try:
        entries = Entries(*shape, sp.Lambda((I, J), check_formula(FORMED[form](formula))))
        got = _evaluated(entries, trace)
    except Exception:  # a value the reading does not cover: the constant stays a constant
        return None
    want = FORMS[form](tensor.detach().reshape(tensor.shape[-2:]).cpu(), torch.float64).numpy()
    eps = torch.finfo(dtype).eps
    if tensor.is_floating_point():
        eps = min(eps, torch.finfo(tensor.dtype).eps)
    return entries if _same(got, want, eps) else None


def index(program: Program, tensor: torch.Tensor, trace) -> Basic | None:
    """The integer formula of I and J that an index tensor (rows, cols) made of positions is (T5's relative
    position buckets), checked equal to every entry at the example; None where it is not one."""
    if tensor.is_floating_point() or tensor.dtype == torch.bool or tensor.ndim != 2:
        return None
    formula = _formula(program, tensor, trace)
    if formula is None:
        return None
    try:
        rows, cols = (trace.position_number(s) for s in tensor.shape)
        got = _evaluated(Entries(rows, cols, sp.Lambda((I, J), check_formula(formula))), trace)
    except Exception:
        return None
    return formula if np.array_equal(got, tensor.detach().cpu().numpy().astype(np.float64)) else None


def _formula(program: Program, tensor: torch.Tensor, trace) -> Basic | None:
    """The formula of I and J the program's steps made the tensor of (its last two axes; any before of size 1)."""
    source = program.sources.get(id(tensor))
    if tensor.is_meta or source is None or tensor.ndim < 2 or any(s != 1 for s in tensor.shape[:-2]):
        return None  # (a meta tensor: no values to check a formula against)
    try:
        lengths = set(tensor.shape[-2:])  # a number equal to another length is a number (T5's bucket counts)
        axes = Reader(program, lambda x: trace.position_number(x, lengths)).of(source)
    except Exception:  # a step or a value the reading does not cover
        return None
    formula = axes.broadcast(tuple(tensor.shape)).expr
    if formula.free_symbols - {AXES[-1], AXES[-2]} - _dimensions(formula):
        return None
    return formula.xreplace({AXES[-2]: I, AXES[-1]: J})


def _evaluated(entries: Entries, trace) -> np.ndarray:
    """The entries at the example's sizes, in float64."""
    from symattn.numeric.lambdify import lambdify

    lengths = _dimensions(entries.formula) | _dimensions(sp.Tuple(*entries.shape))
    with np.errstate(divide="ignore", invalid="ignore"):  # a branch not taken (the log of a bucket's 0)
        return np.asarray(lambdify([], entries, dims={s: trace.dims.size(s) for s in lengths})(), dtype=np.float64)


def _same(got: np.ndarray, want: np.ndarray, eps: float) -> bool:
    """Every entry the same: ±∞ and NaN where the constant has them, the rest to a few eps (the formula is SymPy's
    canonical form: 0.1·(i − j) computed as i/10 − j/10)."""
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return False
    scale = np.abs(want[finite]).max(initial=1.0)
    return bool(np.all(np.abs(got[finite] - want[finite]) <= 8 * eps * scale))


def _dimensions(expr: Basic) -> set:
    return {s for s in expr.free_symbols if s.is_integer and s.is_positive}
