"""Interval bounds of an index formula over the positions: what a table read at positions is checked against."""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy import Basic, Expr
from sympy.core.relational import Relational

Bounds = tuple[Expr, Expr]  # (lowest, highest) value of a position formula over the positions

I = sp.Symbol("i", integer=True, nonnegative=True)  # noqa: E741  (the query position, a row index)
J = sp.Symbol("j", integer=True, nonnegative=True)  # the key position, a column index


def _lifted(e: Expr) -> Expr:
    """c + Min(a, b) as Min(c + a, c + b), and so for Max: a sum's Min or Max term taken outermost; −Max(a, b) as
    Min(−a, −b), −Min(a, b) as Max(−a, −b)."""
    if isinstance(e, sp.Mul) and e.args[0] == -1 and len(e.args) == 2 and isinstance(e.args[1], (sp.Min, sp.Max)):
        flipped = sp.Max if isinstance(e.args[1], sp.Min) else sp.Min
        return flipped(*(-a for a in e.args[1].args), evaluate=False)
    if isinstance(e, sp.Add):
        for term in e.args:
            if isinstance(term, (sp.Min, sp.Max)):
                rest = e - term
                return term.func(*(rest + a for a in term.args), evaluate=False)
    return e


def ordered(low: Expr, high: Expr) -> bool:
    """Whether low ≤ high for every size (True only when shown: Min and Max taken apart, then SymPy's assumptions)."""
    low, high = _lifted(low), _lifted(high)
    if isinstance(low, sp.Max):  # Max(a, b) ≤ high ⇔ a ≤ high and b ≤ high
        return all(ordered(a, high) for a in low.args)
    if isinstance(high, sp.Min):  # low ≤ Min(a, b) ⇔ low ≤ a and low ≤ b
        return all(ordered(low, a) for a in high.args)
    if isinstance(high, sp.Max) and any(ordered(low, a) for a in high.args):  # low ≤ a ≤ Max(a, b)
        return True
    if isinstance(low, sp.Min) and any(ordered(a, high) for a in low.args):  # Min(a, b) ≤ a ≤ high
        return True
    return bool(sp.expand(high - low).is_nonnegative)


def _monotone(bounds: Bounds, f: Callable[[Expr], Expr]) -> Bounds:
    return f(bounds[0]), f(bounds[1])


def _product(e: sp.Mul, inner: Callable[[Basic], Bounds]) -> Bounds:
    """A constant factor (numbers and dimensions) of known sign times varying ones; several varying factors only
    where each is shown nonnegative (then the ends multiply)."""
    sizes = {s for s in e.free_symbols if s.is_positive and s.is_integer}
    constant, varying = e.as_independent(*(e.free_symbols - sizes))
    parts = [inner(f) for f in sp.Mul.make_args(varying)]
    if len(parts) > 1 and not all(ordered(sp.S.Zero, lo) for lo, _ in parts):
        raise ValueError(e)
    lo, hi = sp.Mul(*(p[0] for p in parts)), sp.Mul(*(p[1] for p in parts))
    if constant.is_nonnegative:
        return constant * lo, constant * hi
    if constant.is_nonpositive:
        return constant * hi, constant * lo
    raise ValueError(e)


def _absolute(bounds: Bounds) -> Bounds:
    lo, hi = bounds
    if ordered(sp.S.Zero, lo):
        return lo, hi
    if ordered(hi, sp.S.Zero):
        return -hi, -lo
    return sp.S.Zero, sp.Max(-lo, hi)


BOUND_RULES: dict[type, Callable[[Basic, Callable[[Basic], Bounds]], Bounds]] = {
    sp.Add: lambda e, inner: tuple(sp.Add(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.Mul: _product,
    sp.Abs: lambda e, inner: _absolute(inner(e.args[0])),
    sp.Min: lambda e, inner: tuple(sp.Min(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.Max: lambda e, inner: tuple(sp.Max(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.floor: lambda e, inner: _monotone(inner(e.args[0]), sp.floor),  # increasing functions: ends to ends
    sp.ceiling: lambda e, inner: _monotone(inner(e.args[0]), sp.ceiling),
    sp.log: lambda e, inner: _monotone(inner(e.args[0]), sp.log),
    sp.exp: lambda e, inner: _monotone(inner(e.args[0]), sp.exp),
    sp.sign: lambda e, inner: (sp.S.NegativeOne, sp.S.One),
}


def _refined(known: dict, condition: Basic, inner: Callable[[Basic], Bounds]) -> dict:
    """known (bounds by subexpression) where condition holds: a comparison of a formula x with a constant c bounds x
    (x < c: x ≤ c − 1 for an integer x, ≤ c else), a conjunction each of its terms; any other condition nothing."""
    if isinstance(condition, sp.And):
        for term in condition.args:
            known = _refined(known, term, inner)
        return known
    if isinstance(condition, sp.Not) and isinstance(condition.args[0], Relational):
        condition = condition.args[0].negated
    if not isinstance(condition, Relational) or condition.rel_op in ("!=", "=="):
        return known
    x, c, op = condition.lhs, condition.rhs, condition.rel_op
    if c.free_symbols & {I, J}:
        x, c, op = c, x, {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
    if c.free_symbols & {I, J} or not x.free_symbols & {I, J}:
        return known
    strict = 1 if x.is_integer and c.is_integer else 0
    lo, hi = inner(x)
    if op in ("<", "<="):
        hi = sp.Min(hi, c - (strict if op == "<" else 0))
    else:
        lo = sp.Max(lo, c + (strict if op == ">" else 0))
    return {**known, x: (lo, hi)}


def read_bounds(index: Expr, ranges: dict[sp.Symbol, Bounds]) -> Bounds | None:
    """(lowest, highest) value of an index formula when each position symbol p runs over ranges[p] (dimensions and
    numbers fixed), by interval bounds per node (``BOUND_RULES``); a Piecewise's value bounded where its condition
    holds and the earlier ones do not (``_refined``). None where a node has no rule (say, a power)."""

    def bounded(known: dict) -> Callable[[Basic], Bounds]:
        def inner(e: Basic) -> Bounds:
            if e in known:
                return known[e]
            if not e.free_symbols & set(ranges):
                return e, e
            if isinstance(e, sp.Piecewise):
                return _branches(e, known, inner)
            rule = BOUND_RULES.get(type(e))
            if rule is None:
                raise ValueError(e)
            return rule(e, inner)

        return inner

    def _branches(e: sp.Piecewise, known: dict, inner: Callable[[Basic], Bounds]) -> Bounds:
        sides = []
        for value, condition in e.args:
            sides.append(bounded(_refined(known, condition, inner))(value))
            known = _refined(known, sp.Not(condition), inner)
            inner = bounded(known)
        return sp.Min(*(lo for lo, _ in sides)), sp.Max(*(hi for _, hi in sides))

    try:
        return bounded(dict(ranges))(index)
    except ValueError:
        return None


def integral(e: Basic) -> bool:
    """Whether e is an integer at every position: SymPy says so, a floor or ceiling, or a sum, product, Min, Max or
    Piecewise of such (an index made by cases, as T5's buckets)."""
    if e.is_integer or isinstance(e, (sp.floor, sp.ceiling)):
        return True
    if isinstance(e, sp.Piecewise):
        return all(integral(value) for value, _ in e.args)
    return isinstance(e, (sp.Add, sp.Mul, sp.Min, sp.Max)) and all(integral(a) for a in e.args)
