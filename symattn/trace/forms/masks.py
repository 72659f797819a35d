"""Rules for masks computed per call from traced values: comparisons, & | ~ of them, masked_fill and where on them,
and a row's k-th largest value (a top-k threshold).

A bool tensor computed from traced values is a 0/1 matrix [cond] of the language, piecewise constant in the inputs:
its derivative is 0, as autograd's through a comparison. For IEEE numbers a < b ⟺ b − a > 0 exactly (subnormals
kept), so [a < b] = step(b − a) and [a ≤ b] = 𝟏𝟏ᵀ − step(a − b) (``COMPARISONS``); & | ^ ~ are products and
complements of 0/1 matrices (``LOGICAL``). With K the 0/1 matrix of the entries a fill leaves:
masked_fill(cond, −∞) is A + keep(K) (0 where kept, −∞ elsewhere: an additive mask made per call), a finite fill c
gives A ⊙ K + c (𝟏𝟏ᵀ − K), and where(cond, A, B) is A ⊙ K + B ⊙ (𝟏𝟏ᵀ − K), K = [cond] (``choose``).

Order statistics over the last axis: the values of topk(k) and sort are a row's ordered entries, read only as the
column of one place ([..., j:j+1]: ``column``), the r-th largest entry kth_r(A) (``KthLargest``) or the r-th smallest
−kth_r(−A); kthvalue(k, keepdim=True) is the k-th smallest. Their indices are refused where read.
"""

from __future__ import annotations

import math

import torch
from sympy import Basic, MatrixExpr, OneMatrix

from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.functions import Keep, Step, StopGradient
from symattn.lang.rowwise import KthLargest
from symattn.trace import algebra
from symattn.trace.forms.heads import across_heads
from symattn.trace.layout import argument, at_heads, matrix, same_heads
from symattn.trace.tracer import Trace
from symattn.trace.values import INDICES, ORDERED, Refused, Value


def _sub(a: Basic, b: Basic) -> Basic:
    return algebra.BINARY["sub"](a, b)


def _not(m: MatrixExpr) -> MatrixExpr:
    """𝟏𝟏ᵀ − M: the complement of a 0/1 matrix."""
    return total(OneMatrix(*m.shape), product(-1, m))


def _step(d: Basic) -> MatrixExpr:
    if not isinstance(d, MatrixExpr):
        raise Refused("a comparison of two numbers (a mask is a matrix: compare a matrix with a number or a matrix)")
    return Step(d)


COMPARISONS = {  # [a ∘ b] as a 0/1 matrix; a < b ⟺ b − a > 0 for IEEE numbers
    "lt": lambda a, b: _step(_sub(b, a)),  # [a < b] = step(b − a)
    "gt": lambda a, b: _step(_sub(a, b)),  # [a > b] = step(a − b)
    "le": lambda a, b: _not(_step(_sub(a, b))),  # [a ≤ b] = 𝟏𝟏ᵀ − [a > b]
    "ge": lambda a, b: _not(_step(_sub(b, a))),  # [a ≥ b] = 𝟏𝟏ᵀ − [a < b]
    "eq": lambda a, b: hadamard_product(COMPARISONS["le"](a, b), COMPARISONS["ge"](a, b)),  # [a ≤ b] ⊙ [a ≥ b]
    "ne": lambda a, b: _not(COMPARISONS["eq"](a, b)),  # 𝟏𝟏ᵀ − [a = b]
}
# torch's names of each comparison (methods, functions, operators, the operator with its operands swapped)
_SPELLINGS = {
    "lt": ("less",),
    "gt": ("greater",),
    "le": ("less_equal",),
    "ge": ("greater_equal",),
    "ne": ("not_equal",),
}

LOGICAL = {  # a ∘ b of 0/1 matrices
    "and": lambda a, b: hadamard_product(a, b),  # [p ∧ q] = P ⊙ Q
    "or": lambda a, b: total(a, b, product(-1, hadamard_product(a, b))),  # P + Q − P ⊙ Q
    "xor": lambda a, b: total(a, b, product(-2, hadamard_product(a, b))),  # P + Q − 2 P ⊙ Q
}


def comparison(kind: str):
    """The rule of a ∘ b (``COMPARISONS``) of a traced matrix and a matrix or number: its 0/1 matrix."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        x, y = args[0], argument(args, kwargs, 1, "other")
        ea, eb, heads, _ = algebra.broadcast(t, x, y)
        return Value(COMPARISONS[kind](ea, eb), tuple(result.shape), heads)

    return rule


def _indicator(t: Trace, obj: object, like: Value) -> Basic:
    """The 0/1 matrix of a bool operand at like's matrix shape: a traced mask's own, a bool constant's K (1 where
    True), a Python bool's number."""
    if isinstance(obj, bool):
        return int(obj)
    if t.traced(obj):
        return _spread(t.value(obj), like)
    if not isinstance(obj, torch.Tensor) or obj.dtype != torch.bool:
        raise Refused("a mask must be a bool tensor (True where it holds)")
    if tuple(obj.shape[-2:]) != tuple(like.shape[-2:]):
        raise Refused(f"a constant mask of shape {tuple(obj.shape)} meets a mask of shape {tuple(like.shape)}")
    t.program.ref(obj)
    per_head, obj = across_heads(t, obj, "keep_false", like)
    return per_head if per_head is not None else t.constant(obj, "keep_false", like=like).expr


def _shape_of(t: Trace, objs: tuple) -> Value:
    """The widest traced matrix among objs (the others broadcast to it)."""
    found = [matrix(t.value(x)) for x in objs if t.traced(x) and not t.value(x).is_scalar]
    if not found:
        raise Refused("a mask operation with no traced matrix")
    return max(found, key=lambda v: (v.rows != 1) + (v.cols != 1))


def logical(kind: str):
    """The rule of p & q, p | q, p ^ q (``LOGICAL``) of bool masks, one of them traced."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        x, y = args[0], argument(args, kwargs, 1, "other")
        if result.dtype != torch.bool:
            raise Refused("a bitwise operation on numbers (read: &, |, ^ of bool masks)")
        like = _shape_of(t, (x, y))
        a, b = _indicator(t, x, like), _indicator(t, y, like)
        if not isinstance(a, MatrixExpr) or not isinstance(b, MatrixExpr):
            raise Refused("a mask combined with a Python bool (write the mask itself)")
        return Value(LOGICAL[kind](a, b), tuple(result.shape), like.heads)

    return rule


def negation(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """~p, logical_not(p) of a bool mask: 𝟏𝟏ᵀ − P."""
    if result.dtype != torch.bool:
        raise Refused("a bitwise not of numbers (read: ~ of a bool mask)")
    v = matrix(t.value(args[0]))
    return Value(_not(v.expr), tuple(result.shape), v.heads)


def _fill(t: Trace, obj: object) -> float | None:
    """A fill that is a number (a Python number or a 0-d constant tensor): its float; None for a tensor."""
    if isinstance(obj, torch.Tensor) and (t.traced(obj) or obj.ndim > 0):
        return None
    value = float(obj.item() if isinstance(obj, torch.Tensor) else obj)
    return -math.inf if value <= algebra.FILL_AS_MINUS_INFINITY else value


def choose(t: Trace, cond: object, a: object, b: object, result) -> Value:
    """where(cond, a, b), cond a bool mask, a and b matrices or numbers, K = [cond]: a + keep(K) where b is −∞,
    b + keep(𝟏𝟏ᵀ − K) where a is, else a ⊙ K + b ⊙ (𝟏𝟏ᵀ − K)."""
    like = _shape_of(t, (cond, a, b))
    k = _indicator(t, cond, like)
    sides = []
    for obj in (a, b):
        number = _fill(t, obj)
        if number is None:
            if isinstance(obj, torch.Tensor) and not t.traced(obj) and obj.dtype == torch.bool:
                raise Refused("torch.where choosing a bool tensor (read: numbers or float tensors)")
            sides.append(_spread(t.value(obj), like))
        else:
            sides.append(number)
    if all(s == -math.inf for s in sides):
        raise Refused("torch.where choosing −inf on both sides")
    if sides[1] == -math.inf:
        return Value(algebra.BINARY["add"](sides[0], Keep(k)), tuple(result.shape), like.heads)
    if sides[0] == -math.inf:
        return Value(algebra.BINARY["add"](sides[1], Keep(_not(k))), tuple(result.shape), like.heads)
    held = cond if isinstance(cond, torch.Tensor) else torch.tensor(bool(cond))  # where a is chosen
    algebra.finite_choice(a, ~held)
    algebra.finite_choice(b, held)
    kept = [algebra.BINARY["mul"](t.number(s) if isinstance(s, float) else s, m) for s, m in zip(sides, (k, _not(k)))]
    return Value(algebra.BINARY["add"](*kept), tuple(result.shape), like.heads)


def _spread(v: Value, like: Value) -> Basic:
    """v's expression at like's matrix shape, a row or column of size 1 broadcast as torch does (a number as it is)."""
    if v.is_scalar:
        return v.expr
    v = matrix(v)
    if (v.rows != like.rows and v.rows != 1) or (v.cols != like.cols and v.cols != 1):
        raise Refused(f"a tensor of shape {tuple(v.shape)} meets a mask of shape {tuple(like.shape)}")
    expr = at_heads(v, same_heads(v, like, broadcast=True))
    expr = expr if v.rows == like.rows else product(OneMatrix(like.rows, 1), expr)
    return expr if v.cols == like.cols else product(expr, OneMatrix(1, like.cols))


def masked_fill(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """masked_fill(cond, fill) of a traced cond: where(cond, fill, A) (``choose``); of a constant one, A + M
    (``algebra.masked_fill``)."""
    mask, fill = argument(args, kwargs, 1, "mask"), argument(args, kwargs, 2, "value")
    if not t.traced(mask):
        return algebra.masked_fill(t, args, kwargs, result)
    if isinstance(fill, torch.Tensor) and (t.traced(fill) or fill.ndim > 0):
        raise Refused("a fill value that is a tensor (read: a number)")
    return choose(t, mask, fill, args[0], result)


def where(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.where(cond, a, b): of a traced cond or two traced sides, ``choose``; else ``algebra.where``."""
    cond, a, b = args[0], argument(args, kwargs, 1, "input"), argument(args, kwargs, 2, "other")
    if not t.traced(cond) and not (t.traced(a) and t.traced(b)):
        return algebra.where(t, args, kwargs, result)
    return choose(t, cond, a, b, result)


def _last_axis(dim: object, v: Value, name: str) -> None:
    if dim not in (-1, len(v.shape) - 1):
        raise Refused(f"{name} over dim={dim}; read: over the last axis (dim=-1, each row)")


def topk(t: Trace, args: tuple, kwargs: dict, result) -> tuple[Value, Value]:
    """topk(k, dim=-1, largest, sorted=True): its values a row's k largest (smallest) entries in order, read by
    ``column``; its indices unread."""
    v = matrix(t.value(args[0]))
    k, dim = argument(args, kwargs, 1, "k"), argument(args, kwargs, 2, "dim", -1)
    largest, ordered = argument(args, kwargs, 3, "largest", True), argument(args, kwargs, 4, "sorted", True)
    _last_axis(dim, v, "topk")
    if not ordered:
        raise Refused("topk with sorted=False (the order of its values is unspecified; read: sorted=True)")
    return _ordered(v, result, bool(largest), int(k))


def sort(t: Trace, args: tuple, kwargs: dict, result) -> tuple[Value, Value]:
    """sort(dim=-1, descending): its values each row's entries in order, read by ``column``; its indices unread."""
    v = matrix(t.value(args[0]))
    dim, descending = argument(args, kwargs, 1, "dim", -1), argument(args, kwargs, 2, "descending", False)
    _last_axis(dim, v, "sort")
    return _ordered(v, result, bool(descending), None)


def _ordered(v: Value, result, largest: bool, count: int | None) -> tuple[Value, Value]:
    """The values (``ORDERED``: largest first or smallest first, count of them or None for the whole row) and the
    indices (``INDICES``) of an order statistic of v."""
    values, indices = result
    ordered = Value(v.expr, tuple(values.shape), v.heads, pending=ORDERED, layout=(largest, count, False))
    return ordered, Value(v.expr, tuple(indices.shape), v.heads, pending=INDICES)


topk.several = sort.several = True  # (values, indices): ``tracer.record``


def kthvalue(t: Trace, args: tuple, kwargs: dict, result) -> tuple[Value, Value]:
    """kthvalue(k, dim=-1, keepdim=True): each row's k-th smallest entry, −kth_k(−A); its indices unread."""
    v = matrix(t.value(args[0]))
    k, dim, keep = (
        argument(args, kwargs, 1, "k"),
        argument(args, kwargs, 2, "dim", -1),
        argument(args, kwargs, 3, "keepdim"),
    )
    _last_axis(dim, v, "kthvalue")
    if not keep:
        raise Refused("kthvalue without keepdim=True (read: keepdim=True, a column)")
    values, indices = result
    smallest = product(-1, KthLargest(product(-1, v.expr), int(k)))
    return Value(smallest, tuple(values.shape), v.heads), Value(v.expr, tuple(indices.shape), v.heads, pending=INDICES)


kthvalue.several = True


def column(t: Trace, v: Value, index: object, result) -> Value:
    """values[..., j:j+1] of an order statistic's values (``ORDERED``): the r-th largest entry kth_r(A) or the r-th
    smallest −kth_r(−A) of each row, r counted from the end the place is counted from (a whole row sorted: j ≥ 0
    from its start, j < 0 from its end, so that the place means the same at every length)."""
    largest, count, stopped = v.layout
    index = index if isinstance(index, tuple) else (index,)
    if index[:1] == (Ellipsis,):
        index = (*(slice(None),) * (len(v.shape) - len(index) + 1), *index[1:])
    place = index[-1] if len(index) == len(v.shape) else None
    if not isinstance(place, slice) or any(i != slice(None) for i in index[:-1]) or place.step not in (None, 1):
        raise Refused(f"an index {index} of a top-k's or sort's values; read: the column of one place, [..., j:j+1]")
    start, stop = place.start or 0, place.stop
    same_end = (start >= 0 and stop is not None and stop >= 0) or (start < 0 and (stop is None or stop < 0))
    if len(range(v.shape[-1])[place]) != 1 or (count is None and not same_end):
        raise Refused(f"the places {place.start}:{stop} of a top-k's or sort's values; read: one, [..., j:j+1]")
    if count is not None:  # topk: k places, the same at every length
        rank, from_largest = range(count)[place][0] + 1, largest
    else:  # a whole row sorted: counted from the end the index counts from
        rank, from_largest = (start + 1, largest) if start >= 0 else (-start, not largest)
    expr = KthLargest(v.expr, rank) if from_largest else product(-1, KthLargest(product(-1, v.expr), rank))
    return Value(StopGradient(expr) if stopped else expr, tuple(result.shape), v.heads)


def _spellings(kind: str) -> tuple[str, ...]:
    """torch's names of a comparison: lt, lt_, less, __lt__, and __gt__ for the operator met reflected."""
    return (kind, f"{kind}_", *_SPELLINGS.get(kind, ()), f"__{kind}__")


# the op table's entries (trace.table)
OPS = {
    **{name: comparison(kind) for kind in COMPARISONS for name in _spellings(kind)},
    **{name: logical(kind) for kind in LOGICAL for name in (f"__{kind}__", f"__r{kind}__", f"__i{kind}__")},
    **{f"{prefix}_{kind}": logical(kind) for kind in LOGICAL for prefix in ("logical", "bitwise")},
    **dict.fromkeys(("__invert__", "logical_not", "bitwise_not"), negation),
    "topk": topk,
    "sort": sort,
    "kthvalue": kthvalue,
}
