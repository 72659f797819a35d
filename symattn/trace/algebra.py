"""Rules for entrywise arithmetic, functions, row reductions and masks, with torch's broadcasting.

Operands broadcast as torch does: a 1 × d row (a bias, a 1-D tensor) along the rows as 𝟏 b, an n × 1 column
along the columns as c 𝟏ᵀ, a number everywhere. Entrywise A ⊙ B, A ⊘ B = A ⊙ B^∘(−1) and A^∘k are SymPy's
Hadamard nodes. A mask enters as the additive constant M (0 where allowed, −∞ where not):
masked_fill(mask, −∞) is A + M, as the attention specs write it.
"""

from __future__ import annotations

import math

import sympy as sp
import torch
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import HadamardPower, OneMatrix

from symattn.lang import ops
from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.functions import Softplus
from symattn.trace import frames
from symattn.trace.forms.head_parameters import folded, operand, widened
from symattn.trace.forms.heads import across_heads, fixed
from symattn.trace.layout import argument, at_heads, matrix, same_heads
from symattn.trace.tracer import MaskArgument, Trace
from symattn.trace.values import Refused, Value

FILL_AS_MINUS_INFINITY = -1e9  # a fill value at or below this is read as −∞ (see masked_fill)


def broadcast(t: Trace, x: object, y: object, prefer: tuple = ()) -> tuple[Basic, Basic, int | None, tuple]:
    """The two operands' expressions at one matrix shape (rows and columns of size 1 broadcast), their heads."""
    operand(t, x, y), operand(t, y, x)  # a parameter with a heads axis meeting per-head values: read per head
    a, b = t.value(x, prefer), t.value(y, prefer)
    if a.is_scalar or b.is_scalar:
        return a.expr, b.expr, a.heads if b.is_scalar else b.heads, ()
    heads = same_heads(matrix(a), matrix(b), broadcast=True)
    for length in ("rows", "cols"):
        la, lb = getattr(a, length), getattr(b, length)
        if la != 1 and lb != 1:
            t.dims.equate(la, lb)
    a, b = t.value(x, prefer), t.value(y, prefer)
    a, b = widened(a, b), widened(b, a)  # a value per head: made at the other's rows and columns
    ea, eb = at_heads(a, heads), at_heads(b, heads)
    if a.rows == 1 and b.rows != 1:
        ea = product(OneMatrix(b.rows, 1), ea)
    if b.rows == 1 and a.rows != 1:
        eb = product(OneMatrix(a.rows, 1), eb)
    if a.cols == 1 and b.cols != 1:
        ea = product(ea, OneMatrix(1, b.cols))
    if b.cols == 1 and a.cols != 1:
        eb = product(eb, OneMatrix(1, a.cols))
    return ea, eb, heads, (ea.shape[0], ea.shape[1])


def _fill(c: Basic, shape: tuple) -> Basic:
    """The number c as a matrix of this shape: c 𝟏𝟏ᵀ."""
    return product(c, OneMatrix(*shape))


def _add(ea: Basic, eb: Basic) -> Basic:
    ma, mb = isinstance(ea, MatrixExpr), isinstance(eb, MatrixExpr)
    if ma and mb:
        return total(ea, eb)
    if ma or mb:
        m, c = (ea, eb) if ma else (eb, ea)
        return m if c == 0 else total(m, _fill(c, m.shape))
    return ea + eb


def _mul(ea: Basic, eb: Basic) -> Basic:
    ma, mb = isinstance(ea, MatrixExpr), isinstance(eb, MatrixExpr)
    if ma and mb:
        return hadamard_product(ea, eb)
    if ma or mb:
        m, c = (ea, eb) if ma else (eb, ea)
        return m if c == 1 else product(c, m)
    return ea * eb


def _power(e: Basic, k: Basic) -> Basic:
    if isinstance(k, MatrixExpr):
        raise Refused("a power with a matrix exponent")
    if isinstance(e, MatrixExpr):
        return e if k == 1 else HadamardPower(e, k)
    return e**k


def _reciprocal(e: Basic) -> Basic:
    return _power(e, sp.Integer(-1))


BINARY = {
    "add": lambda a, b: _add(a, b),  # A + B
    "sub": lambda a, b: _add(a, _mul(sp.Integer(-1), b)),  # A − B
    "mul": lambda a, b: _mul(a, b),  # A ⊙ B, c A
    "div": lambda a, b: _mul(a, _reciprocal(b)),  # A ⊙ B^∘(−1)
    "pow": lambda a, b: _power(a, b),  # A^∘k
}


def binary(kind: str, reverse: bool = False):
    """The rule of an entrywise binary operation (reverse: other ∘ self, as __rsub__)."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        x, y = args[0], argument(args, kwargs, 1, "other", kwargs.get("exponent"))
        if kwargs.get("alpha", 1) != 1:
            raise Refused("alpha ≠ 1; write the multiple out")
        if result.dtype == torch.bool:  # (True + True is True)
            raise Refused("arithmetic of bool masks (read: &, |, ^ and ~ of them)")
        if reverse:
            x, y = y, x
        if kind == "add":
            _masks_added(t, x, y)
            mask = _additive_mask(t, x, y, result) or _additive_mask(t, y, x, result)
            if mask is not None:
                return mask
        for z, other in ((x, y), (y, x)):  # a float constant with batch or head axes (cos, sin, a bias table)
            if isinstance(z, torch.Tensor) and z.is_floating_point() and not t.traced(z) and t.traced(other):
                fixed(t, z, t.value(other))
        # a number is read with the length a product operand contracted first (Q Kᵀ / √d_k), then the operand's
        # columns (q * d_k ** -0.5)
        operands = [t.value(z) for z in (x, y) if t.traced(z) and not t.value(z).is_scalar]
        prefer = tuple(length for v in operands for length in (v.inner, v.cols) if length is not None)
        ea, eb, heads, _ = broadcast(t, x, y, prefer)
        if kind == "pow" and isinstance(eb, MatrixExpr):
            raise Refused("a number raised to a matrix power")
        expr = BINARY[kind](ea, eb)
        return Value(expr, tuple(result.shape), heads)

    rule.binary = True
    return rule


def _masks_added(t: Trace, x: object, y: object) -> None:
    """A float argument with batch axes added to another such argument or to a constant with batch axes (CLIP's
    attention_mask + causal_attention_mask, T5's zero position_bias + mask): masks combined, traced again as
    constants (``MaskArgument``), tentatively: where their sum is used otherwise than as a mask, they are inputs again
    (``source.trace``)."""
    for a, b in ((x, y), (y, x)):
        if t.traced(a) and id(a) in t.floats and isinstance(b, torch.Tensor) and b.is_floating_point() and b.ndim > 2:
            if not t.traced(b) or id(b) in t.floats:
                raise MaskArgument(t.floats[id(a)], tentative=True)


def _additive_mask(t: Trace, x: object, mask: object, result) -> Value | None:
    """x + mask, x per-head values and mask a float tensor with batch axes: x + M, M the additive mask (a constant).

    A float argument of the forward met here as it is signals a trace again with it a constant (``MaskArgument``);
    a constant (such an argument, or a tensor made from it) is M of x's matrix shape, which generated forward takes
    (n, m) or batched (B, n, m), where it is the same for every head (a (B, 1, 1, m) padding or (B, 1, n, m) causal
    mask; torch broadcasts it); one that varies over the heads is a per-head constant (``forms.heads``)."""
    if not (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.ndim > 2) or not t.traced(x):
        return None
    v = t.value(x)
    if v.heads is None or v.is_scalar:
        return None
    if t.traced(mask):
        if id(mask) in t.floats:
            raise MaskArgument(t.floats[id(mask)])
        return None
    v = matrix(v)
    per_head, mask = across_heads(t, mask, "as_is", v)
    if per_head is not None:
        return Value(total(v.expr, per_head), tuple(result.shape), v.heads)
    m = t.constant(mask, "as_is", like=v)
    return Value(total(v.expr, m.expr), tuple(result.shape), v.heads)


def negative(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    v = t.value(args[0])
    return Value(_mul(sp.Integer(-1), v.expr), tuple(result.shape), v.heads)


_POWERS = {  # entrywise powers torch names: A^∘k
    "sqrt": sp.Rational(1, 2),
    "rsqrt": sp.Rational(-1, 2),
    "reciprocal": sp.Integer(-1),
    "square": sp.Integer(2),
}


def function(record: type):
    """The rule of an entrywise function record (symattn.lang.functions): its node of a matrix, its scalar
    function (the record's ``scalar``) of a 0-d number."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        v = t.value(args[0])
        if record is Softplus and argument(args, kwargs, 1, "beta", 1) != 1:
            raise Refused("softplus with beta ≠ 1")
        if v.is_scalar:
            return Value(record.scalar(v.expr), ())
        return folded(v, record) or Value(record(matrix(v).expr), tuple(result.shape), v.heads)

    rule.record = record
    return rule


def power(name: str):
    """The rule of sqrt, rsqrt, reciprocal, square: A^∘k of a matrix, x^k of a number."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        v = t.value(args[0])
        return Value(_power(v.expr, _POWERS[name]), tuple(result.shape), v.heads)

    return rule


def clamp(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """clamp / clip of a 0-d tensor, exact where the clamp is inactive: it is the identity there (derivative 1).

    The example's value must lie inside the bounds (else the spec, the identity, would be wrong at the
    example already); beyond them torch's gradient is 0 and the spec's 1: keep the value inside.
    """
    v = t.value(args[0])
    if not v.is_scalar:
        raise Refused("clamp of a matrix (only a 0-d tensor, such as a learned logit scale, is read: as identity)")
    if not torch.equal(result, args[0]):
        raise Refused(f"the clamp is active at the example (value {args[0].item():.6g}): the identity would be wrong")
    return Value(v.expr, ())


def row_function(record: type):
    """softmax / log_softmax over the last axis: the row-wise record's node."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        v = matrix(t.value(args[0]))
        axis = argument(args, kwargs, 1, "dim")
        if axis is None or axis not in (-1, len(v.shape) - 1):
            raise Refused(f"{record.function} over dim={axis}; symattn's is over the last axis (dim=-1, each row)")
        _precision(t, kwargs.get("dtype", next((a for a in args[2:] if isinstance(a, torch.dtype)), None)))
        return Value(record(v.expr), tuple(result.shape), v.heads)

    return rule


def _precision(t: Trace, dtype: torch.dtype | None) -> None:
    """softmax(…, dtype=torch.float32): the same function, computed in float32; the spec is the exact function, so
    it is right, and the call's line is kept (``Trace.upcast``). A narrower dtype would round the probabilities."""
    if dtype is None:
        return
    if not dtype.is_floating_point or torch.finfo(dtype).bits < 32:
        raise Refused(f"dtype={dtype} rounds the result below float32; read: dtype=torch.float32 or wider, or none")
    t.upcast.append(frames.location() or "?")


def reduction(kind: str):
    """sum / mean over the last axis with keepdim=True (a column: rowsum(A), rowsum(A)/d), or of every entry of
    a tensor without batch axes (the number sum(A))."""

    def rule(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        v = matrix(t.value(args[0]))
        axis = argument(args, kwargs, 1, "dim")
        keep = argument(args, kwargs, 2, "keepdim", False)
        axis = tuple(axis) if isinstance(axis, (tuple, list)) else axis
        last = axis in (-1, len(v.shape) - 1, (-1,), (len(v.shape) - 1,))
        divisor = v.cols if kind == "mean" else 1
        if last and keep:
            return Value(product(1 / sp.sympify(divisor), ops.rowsum(v.expr)), tuple(result.shape), v.heads)
        if result.ndim == 0 and v.heads is None and (axis is None or (last and len(v.shape) == 1)):
            return Value(ops.sum(v.expr) / (divisor * (v.rows if kind == "mean" else 1)), ())
        raise Refused(f"{kind} over dim={axis} (keepdim={keep}); read: the last axis with keepdim=True, or all")

    return rule


def norm(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """The Euclidean norm of each row, keepdim=True: (rowsum(A^∘2))^∘½, an n × 1 column."""
    v = matrix(t.value(args[0]))
    p = kwargs.get("p", kwargs.get("ord", args[1] if len(args) > 1 and not isinstance(args[1], int) else 2))
    axis, keep = kwargs.get("dim", -1), kwargs.get("keepdim", False)
    if p not in (2, 2.0, "fro") or axis not in (-1, len(v.shape) - 1, (-1,)) or not keep:
        raise Refused("a norm other than the 2-norm of each row with keepdim=True")
    return Value(HadamardPower(ops.rowsum(HadamardPower(v.expr, 2)), sp.Rational(1, 2)), tuple(result.shape), v.heads)


def normalize(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.normalize over the last axis: A ⊙ (rowsum(A^∘2)^∘(−½) 𝟏ᵀ), each row divided by its norm.

    torch divides by max(‖row‖, eps): exact wherever every row's norm exceeds eps (1e-12 by default).
    """
    v = matrix(t.value(args[0]))
    p, axis = argument(args, kwargs, 1, "p", 2.0), argument(args, kwargs, 2, "dim", 1)
    if p != 2 or axis not in (-1, len(v.shape) - 1):
        raise Refused(f"normalize with p={p}, dim={axis}; read: p=2 over the last axis (dim=-1)")
    inverse = HadamardPower(ops.rowsum(HadamardPower(v.expr, 2)), sp.Rational(-1, 2))
    expr = hadamard_product(v.expr, product(inverse, OneMatrix(1, v.cols)))
    return Value(expr, tuple(result.shape), v.heads)


def finite_choice(value: object, dropped: torch.Tensor) -> None:
    """Refuse a choice written A ⊙ K (+ B ⊙ (𝟏𝟏ᵀ − K)) where value (A or B) is infinite at an entry it is multiplied
    by 0 at the example (dropped: True there): 0·∞ = NaN where torch picks the other side (a finite fill of masked
    scores)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and bool((value.isinf() & dropped).any()):
        raise Refused(
            "a finite fill (or where) over values that are infinite where it fills (masked scores): 0·∞ would be NaN "
            "where torch gives the fill; not read (fill with -inf, or fill before masking)"
        )


def _masked(t: Trace, x: object, mask: torch.Tensor, fill: object, masked_when: bool, result) -> Value:
    """x with the entries where mask == masked_when replaced by fill: x + M for fill −∞ (M: 0 or −∞), else
    x ⊙ K + fill·(𝟏𝟏ᵀ − K) with K 1 where kept, 0 where filled."""
    if t.traced(mask):
        raise Refused("a mask computed from traced values (it would not be a constant)")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise Refused("the mask must be a bool tensor (True where the fill applies)")
    v = matrix(t.value(x))
    value = fill.item() if isinstance(fill, torch.Tensor) and not t.traced(fill) else fill
    if isinstance(value, torch.Tensor):
        raise Refused("a fill value computed from traced values")
    value = float(value)
    t.program.ref(mask)
    additive = value == -math.inf or value <= FILL_AS_MINUS_INFINITY
    form = ("additive" if additive else "keep") + ("" if masked_when else "_false")
    per_head, mask = across_heads(t, mask, form, v)  # a (…, H, n, m) mask that varies over the heads: per head
    if additive:
        m = per_head if per_head is not None else t.constant(mask, form, like=v).expr
        return Value(total(v.expr, m), tuple(result.shape), v.heads)
    finite_choice(x, mask if masked_when else ~mask)
    k = per_head if per_head is not None else t.constant(mask, form, like=v).expr
    expr = hadamard_product(v.expr, k)
    if value != 0:
        expr = total(expr, product(t.number(value), total(OneMatrix(*k.shape), product(-1, k))))
    return Value(expr, tuple(result.shape), v.heads)


def masked_fill(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """masked_fill(mask, −∞): A + M, M the additive mask (a fill at or below −10⁹ is read as −∞: after a softmax
    both give exactly 0 unless a whole row is masked)."""
    mask, fill = argument(args, kwargs, 1, "mask"), argument(args, kwargs, 2, "value")
    return _masked(t, args[0], mask, fill, True, result)


def where(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.where(mask, A, fill) or torch.where(mask, fill, A): masked_fill where the fill applies."""
    cond, a, b = args[0], argument(args, kwargs, 1, "input"), argument(args, kwargs, 2, "other")
    if t.traced(a) and not t.traced(b):
        return _masked(t, a, cond, b, False, result)
    if t.traced(b) and not t.traced(a):
        return _masked(t, b, cond, a, True, result)
    raise Refused("torch.where choosing between two traced tensors (read: one side a number, such as -inf)")
