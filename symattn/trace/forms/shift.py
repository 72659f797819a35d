"""A row's max as a softmax's shift: ``s - s.max(-1, keepdim=True).values``, then ``exp`` and a division by the row
sums (or ``softmax``, ``log_softmax``, or the row log-sum-exp subtracted), read as the softmax of s, exact by shift
invariance: softmax(s − m 𝟏ᵀ) = softmax(s) for any column m.

The max is never a value of the spec. A traced value that holds it carries a ``Shift`` (``Value.shift``): by how
many row maxes it is shifted (``added``: the value is t − a·m𝟏ᵀ for the unshifted t its expression holds) or scaled
(``scaled``: t ⊙ exp(−k·m)𝟏ᵀ). Each operation moves the count as the algebra says (exp turns a shift into a
scaling, log back, a product of scaled values adds their powers, a division subtracts them, ``@`` keeps the row
scaling), and a count of zero is the unshifted value itself, exact. A division of exp(s) (or exp(s) V) by the row
sums of exp(s) is written softmax(s) (or softmax(s) V), so the generated code computes the stable softmax, never
exp(s) alone. Any other use of a shifted value (returned, transposed, summed over another axis, the max read on its
own, the argmax) is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from sympy import Basic, MatMul, ZeroMatrix

from symattn.lang.algebra import product
from symattn.lang.functions import Exp, Log
from symattn.lang.rowwise import LogSoftmax, RowSoftmax, RowSum
from symattn.trace.layout import argument, matrix
from symattn.trace.tracer import Trace, tensors_in
from symattn.trace.values import Refused, Value

WHY = "a row max is read as a softmax's shift only: s − max, exp, a division by the row sums (or softmax, log_softmax)"


@dataclass(frozen=True)
class Shift:
    """How a traced value holds the row max m of ``source`` (the scores' expression): ``kind`` "max" (m itself),
    "indices" (the argmax: never read), "added" (t − count·m𝟏ᵀ) or "scaled" (t ⊙ exp(−count·m)𝟏ᵀ)."""

    source: Basic
    kind: str
    count: int = 0


def row_max(t: Trace, args: tuple, kwargs: dict, result) -> Value | tuple[Value, Value]:
    """max(dim=-1, keepdim=True) (values and indices) and amax(dim=-1, keepdim=True) of a matrix: the row max, held
    as a ``Shift`` of its matrix."""
    v = matrix(t.value(args[0]))
    axis, keep = argument(args, kwargs, 1, "dim"), argument(args, kwargs, 2, "keepdim", False)
    if axis not in (-1, len(v.shape) - 1) or not keep:
        raise Refused(f"max over dim={axis} (keepdim={keep}); read: the row max, dim=-1 with keepdim=True")
    column = ZeroMatrix(v.rows, 1)  # no expression of the spec: the shift cancels (read through Value.shift)
    values = Value(column, tuple(v.shape[:-1]) + (1,), v.heads, shift=Shift(v.expr, "max"))
    if isinstance(result, torch.Tensor):  # amax
        return values
    return values, replace(values, shift=Shift(v.expr, "indices"))


row_max.several = True  # max(dim=…) returns (values, indices)

SAME = frozenset({"contiguous", "clone", "detach", "data", "float", "double", "to", "type_as", "type"})
SUBTRACT = frozenset({"sub", "sub_", "__sub__", "__rsub__", "rsub", "__isub__"})
ADD = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
MULTIPLY = frozenset({"mul", "mul_", "__mul__", "__rmul__"})
DIVIDE = frozenset({"div", "div_", "true_divide", "__truediv__", "__rdiv__", "__rtruediv__"})
PRODUCT = frozenset({"matmul", "__matmul__", "bmm"})
KEPT = frozenset({"masked_fill", "masked_fill_", "where"})  # −inf or 0 fills: the shift or scaling stays


def follow(t: Trace, name: str, rule, args: tuple, kwargs: dict, result) -> Value:
    """The value of a call some of whose traced operands hold a row max (``Value.shift``), by the table above;
    Refused where the call is no step of a shifted softmax."""
    operands = [t.values[id(x)] for x in (*tensors_in(args), *tensors_in(kwargs)) if t.traced(x)]
    tags = [v.shift for v in operands if v.shift is not None]
    if any(s.kind == "indices" for s in tags) or len({s.source for s in tags}) > 1:
        raise Refused(WHY)
    if name in SAME:
        return replace(operands[0], shape=tuple(result.shape))
    if name in (RowSoftmax.function, LogSoftmax.function) and tags[0].kind == "added":
        return _plain(rule(t, args, kwargs, result))  # softmax(s − m𝟏ᵀ) = softmax(s)
    if name in KEPT:
        return _tagged(rule(t, args, kwargs, result), tags[0])
    ordered = [t.value(x) if isinstance(x, torch.Tensor) and t.traced(x) else None for x in args[:2]]
    if name in ("__rsub__", "rsub", "__radd__", "__rmul__", "__rdiv__", "__rtruediv__"):
        ordered.reverse()
    return _arithmetic(t, name, rule, args, kwargs, result, ordered, tags[0].source)


def _arithmetic(t, name, rule, args, kwargs, result, ordered, source) -> Value:
    left, right = (ordered + [None, None])[:2]
    kind = {id(v): v.shift for v in ordered if v is not None}
    lk, rk = (None if v is None else kind[id(v)] for v in (left, right))
    if name in SUBTRACT and rk is not None and rk.kind == "max" and lk is None and left.expr == source:
        return replace(left, shape=tuple(result.shape), shift=Shift(source, "added", 1))  # s − m
    if name in SUBTRACT | ADD and lk is not None and lk.kind == "added":
        if rk is None:  # (s − m) ± b: still shifted once
            return _tagged(rule(t, args, kwargs, result), lk)
        if name in SUBTRACT and rk.kind == "added":  # (s − m) − (log Σ exp(s − m)) = s − log Σ exp s
            return _log_softmax(left, right, result, lk.count - rk.count)
    if name == Exp.function and lk is not None and lk.kind == "added" and lk.count == 1:
        return _tagged(rule(t, args, kwargs, result), Shift(source, "scaled", 1))
    if name == Log.function and lk is not None and lk.kind == "scaled" and lk.count == 1:
        return _tagged(rule(t, args, kwargs, result), Shift(source, "added", 1))
    if name in ("sum", "mean") and lk is not None and lk.kind == "scaled" and result.shape[-1:] == (1,):
        return _tagged(rule(t, args, kwargs, result), lk)
    if name in PRODUCT and lk is not None and lk.kind == "scaled" and rk is None:
        return _tagged(rule(t, args, kwargs, result), lk)
    if name in DIVIDE and lk is not None and lk.kind == "scaled" and rk is not None and rk.kind == "scaled":
        return _softmax(left, right, result, lk.count - rk.count)
    if name in MULTIPLY | DIVIDE and all(k is None or k.kind == "scaled" for k in (lk, rk)) and (lk or rk):
        if name in DIVIDE and rk is not None:
            raise Refused(WHY)
        return _tagged(rule(t, args, kwargs, result), lk or rk)  # c ⊙ (t ⊙ e^{−m}) = (c ⊙ t) ⊙ e^{−m}
    raise Refused(WHY)


def _tagged(value: Value, shift: Shift) -> Value:
    return replace(value, shift=shift)


def _plain(value: Value) -> Value:
    return replace(value, shift=None)


def _softmax(numerator: Value, denominator: Value, result, count: int) -> Value:
    """exp(s) / rowsum(exp(s)) → softmax(s); (exp(s) V) / rowsum(exp(s)) → softmax(s) V (the scalings cancel)."""
    sums = denominator.expr
    if count != 0 or not isinstance(sums, RowSum) or not isinstance(sums.arg, Exp):
        raise Refused(WHY)
    scores = sums.arg.arg
    top = numerator.expr
    if top == sums.arg:
        return Value(RowSoftmax(scores), tuple(result.shape), numerator.heads)
    if isinstance(top, MatMul):
        coeff, mats = top.as_coeff_matrices()
        if mats[0] == sums.arg:
            return Value(product(coeff, RowSoftmax(scores), *mats[1:]), tuple(result.shape), numerator.heads)
    raise Refused(WHY)


def _log_softmax(shifted: Value, total: Value, result, count: int) -> Value:
    """(s − m) − log(rowsum(exp(s − m))) → log_softmax(s)."""
    lse = total.expr
    scores = shifted.expr
    if count != 0 or lse != Log(RowSum(Exp(scores))):
        raise Refused(WHY)
    return Value(LogSoftmax(scores), tuple(result.shape), shifted.heads)


__all__ = ["Shift", "follow", "row_max"]
