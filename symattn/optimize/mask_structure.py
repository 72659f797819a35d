"""A mask's structure, known before any number is: which keys a block of query rows may see.

A position formula f(i, j) (``lang.positions``) is −∞ where a Piecewise picks a −∞ branch; added to the scores it
hides key j from query i. When the conditions are relations linear in i and j (with sizes, integers, ``&``, ``|``,
``~``, and ``|x|`` of a linear x, split into its two signs), the set V of visible (i, j) is a union of clauses,
each a conjunction of bounds  j ≥ Lₖ(i),  j ≤ Uₖ(i)  (Lₖ, Uₖ linear in i with integer coefficients) and of
conditions on i alone. For a block of rows [r₀, r₁):

- ``lo, hi``: every key j ∉ [lo, hi) is hidden from every row of the block, so it is never computed. A clause's
  keys lie in [maxₖ min(Lₖ(r₀), Lₖ(r₁ − 1)), minₖ max(Uₖ(r₀), Uₖ(r₁ − 1)) + 1) (a linear bound is monotone, so its
  extremes over the block are at its end rows); the range is the hull of its clauses' (those empty for the block
  left out).
- ``open_lo, open_hi``: every key in [open_lo, open_hi) is visible to every row of the block (the mask need not be
  applied there): a clause's [maxₖ max(Lₖ(r₀), Lₖ(r₁ − 1)), minₖ min(Uₖ(r₀), Uₖ(r₁ − 1)) + 1) where its conditions
  on i hold at both end rows (a linear condition holding at both ends holds between them), the union of two
  clauses' where they overlap, else the wider.
- ``every_row``: a condition under which every row of the block sees some key (its softmax needs no care for rows
  of −∞): for some clause, its conditions on i hold and its bounds leave a key at both end rows.

Conservative: what is not such a relation (a table read at positions, ``floor``, a trainable scalar, a coefficient
of j other than ±1) is dropped from the bounds (more keys, never fewer) and empties its clause's open range; a
formula whose −∞ is not reached through sums, positive multiples and Piecewise branches has no structure: every
key, the mask applied everywhere. The results are SymPy expressions of r₀, r₁ and the sizes; the memory-efficient
modules evaluate them per block, and the Triton kernels per tile. The transposed question, the rows that see a block
of keys (``row_window``), is the key window of fᵀ(i, j) = f(j, i); on the keys every row sees, f equals its formula
without −∞ branches (``unmasked``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import sympy as sp
from sympy import Expr
from sympy.core.relational import Relational
from sympy.logic.boolalg import Boolean, BooleanFalse, BooleanTrue, to_nnf
from sympy.matrices.expressions import MatAdd

from symattn.lang.positions import I, J
from symattn.optimize.position_blocks import HEAD, EntriesBlock

# a bound of a clause: ("lower" | "upper", a, c) for j ≥ a·i + c or j ≤ a·i + c; ("rows", a, c) for a·i + c ≥ 0;
# ("unknown",) for an atom whose truth the bounds cannot state (dropped from the hull, empties the open range)
Bound = tuple


@dataclass(frozen=True)
class KeyWindow:
    """The keys of a block of rows [r₀, r₁): [lo, hi) holds every key some row sees; [open_lo, open_hi) (empty
    when open_lo ≥ open_hi) holds keys every row sees unmasked; every_row, a condition that holds only if every row
    sees some key. SymPy expressions of r₀, r₁ and the sizes."""

    lo: Expr
    hi: Expr
    open_lo: Expr
    open_hi: Expr
    every_row: Boolean = sp.false  # true only where every row of the block sees a key (no row all −∞)


def hidden(formula: Expr) -> Boolean | None:
    """The condition under which f(i, j) = −∞, or None when −∞ is reached otherwise than through sums, positive
    multiples and Piecewise branches (no structure known). false: f is never −∞."""
    if not formula.has(-sp.oo):
        return sp.false
    if formula == -sp.oo:
        return sp.true
    if isinstance(formula, sp.Add) and not formula.has(sp.oo):  # (finite terms but the −∞ ones)
        parts = [hidden(t) for t in formula.args]
        return None if any(p is None for p in parts) else sp.Or(*parts)
    if isinstance(formula, sp.Mul):
        coefficient, rest = formula.as_coeff_Mul()
        return hidden(rest) if coefficient.is_positive and rest != formula else None
    if isinstance(formula, sp.Piecewise):
        found, before = [], sp.true
        for value, condition in formula.args:
            inner = hidden(value)
            if inner is None:
                return None
            found.append(sp.And(before, condition, inner))
            before = sp.And(before, sp.Not(condition))
        return sp.Or(*found)
    return None


def pure_mask(formula: Expr) -> Boolean | None:
    """The condition under which f(i, j) = −∞ where f is 0 elsewhere (a Piecewise of 0 and −∞ only: added to the
    scores, a fill of −∞), else None."""
    if not isinstance(formula, sp.Piecewise) or any(v not in (0, -sp.oo) for v, _ in formula.args):
        return None
    condition = hidden(formula)
    return None if condition in (None, sp.false) else to_nnf(condition, simplify=False)  # (~(a ∧ b): ¬a ∨ ¬b)


def _without_abs(relation: Relational) -> Boolean:
    """relation with each |x| of its sides split into x ≥ 0 and x < 0 (exact): e op 0, e = c|x| + r, is
    (x ≥ 0 ∧ c·x + r op 0) ∨ (x < 0 ∧ −c·x + r op 0)."""
    difference = relation.lhs - relation.rhs
    absolutes = sorted(difference.atoms(sp.Abs), key=sp.default_sort_key)
    if not absolutes:
        return relation
    inner = absolutes[0].args[0]
    positive = relation.func(difference.xreplace({absolutes[0]: inner}), 0)
    negative = relation.func(difference.xreplace({absolutes[0]: -inner}), 0)
    return (sp.Ge(inner, 0) & _split(positive)) | (sp.Lt(inner, 0) & _split(negative))


def _split(condition: Boolean) -> Boolean:
    """condition with every relation's |x| split by sign (``_without_abs``)."""
    if isinstance(condition, Relational):
        return _without_abs(condition)
    if isinstance(condition, (sp.And, sp.Or, sp.Not)):
        return condition.func(*(_split(a) for a in condition.args))
    return condition


def _integer_linear(e: Expr) -> tuple[Expr, Expr, Expr] | None:
    """(a, b, c) with e = s·(a·i + b·j + c) for some number s > 0, a and b coprime integers (with c's numbers), c
    integer-valued: e ≥ 0 is then a·i + b·j + c ≥ 0 over the integers; None when e is not linear that way."""
    if e.has(sp.floor, sp.ceiling, sp.Abs) or not e.is_polynomial(I, J):
        return None
    poly = sp.Poly(e, I, J)
    if poly.total_degree() > 1:
        return None
    a, b = poly.coeff_monomial(I), poly.coeff_monomial(J)
    c = sp.expand(e - a * I - b * J)
    coefficients = [t.as_coeff_Mul()[0] for t in sp.Add.make_args(c)]
    if not all(x.is_Rational for x in (a, b, *coefficients)):
        return None
    scale = sp.ilcm(*(sp.fraction(x)[1] for x in (a, b, *coefficients)))
    a, b, c = a * scale, b * scale, sp.expand(c * scale)
    common = sp.igcd(a, b, *(t.as_coeff_Mul()[0] for t in sp.Add.make_args(c)))  # 2i − 2j ≥ 0 is i − j ≥ 0
    a, b, c = a / common, b / common, sp.expand(c / common)
    return (a, b, c) if c.is_integer else None


def _atom(relation: Relational) -> list[list[Bound]]:
    """A relation without |x| as clauses of bounds (a disjunction of conjunctions): e ≥ 0 one bound, e = 0 two,
    e ≠ 0 two clauses; a relation that is not integer-linear in i and j one unknown bound."""
    ops = {">=": [(1, 0)], ">": [(1, -1)], "<=": [(-1, 0)], "<": [(-1, -1)]}
    ops |= {"==": [(1, 0), (-1, 0)]}
    found = _integer_linear(relation.lhs - relation.rhs)
    if found is None or relation.rel_op not in (*ops, "!="):
        return [[("unknown",)]]
    if relation.rel_op == "!=":  # e ≤ −1 or e ≥ 1
        return [[_bound(found, 1, -1)], [_bound(found, -1, -1)]]
    return [[_bound(found, sign, shift) for sign, shift in ops[relation.rel_op]]]


def _bound(found: tuple[Expr, Expr, Expr], sign: int, shift: int) -> Bound:
    """sign·(a·i + b·j + c) + shift ≥ 0 as a bound: on j where b = ±1, on i where b = 0, else unknown."""
    a, b, c = (sign * x for x in found)
    c = c + shift
    if b == 0:
        return ("rows", a, c)
    if b == 1:  # j ≥ −a·i − c
        return ("lower", -a, -c)
    if b == -1:  # j ≤ a·i + c
        return ("upper", a, c)
    return ("unknown",)


def clauses(formula: Expr) -> list[list[Bound]] | None:
    """The visible set {f(i, j) ≠ −∞} as a disjunction of clauses of bounds, or None (no structure known)."""
    condition = hidden(formula)
    if condition is None:
        return None
    visible = sp.to_dnf(_split(sp.Not(condition)), simplify=False)
    if isinstance(visible, BooleanTrue):
        return [[]]
    if isinstance(visible, BooleanFalse):
        return []
    found = []
    for clause in sp.Or.make_args(visible):
        combined: list[list[Bound]] = [[]]
        for literal in sp.And.make_args(clause):
            if isinstance(literal, sp.Not) or not isinstance(literal, Relational):
                parts = [[("unknown",)]]
            else:
                parts = _atom(literal)
            combined = [c + p for c in combined for p in parts]
        found += combined
    return sorted(found, key=str)  # (one order whatever the hash seed: the printed bounds are deterministic)


def _at(bound: Bound, row: Expr) -> Expr:
    return bound[1] * row + bound[2]


def _least(bound: Bound, first: Expr, last: Expr) -> Expr:
    """The bound's least value over the rows first … last: at first if it grows with i, else at last."""
    return _at(bound, first if bound[1] >= 0 else last)


def _greatest(bound: Bound, first: Expr, last: Expr) -> Expr:
    return _at(bound, last if bound[1] >= 0 else first)


def _clause_window(clause: list[Bound], first: Expr, last: Expr, cols: Expr) -> tuple[Expr, ...]:
    """(lo, hi, open_lo, open_hi) of one clause over the rows first … last (both included)."""
    lowers = [b for b in clause if b[0] == "lower"]
    uppers = [b for b in clause if b[0] == "upper"]
    # the rows the clause holds on: i ≥ −c (a = 1), i ≤ c (a = −1), c ≥ 0 (a = 0); other rows bounds left to the
    # open range (a clause holding on more rows than it does: more keys, never fewer)
    since = sp.Max(first, *(-b[2] for b in clause if b[0] == "rows" and b[1] == 1))
    until = sp.Min(last, *(b[2] for b in clause if b[0] == "rows" and b[1] == -1))
    holds = sp.And(*(sp.Ge(b[2], 0) for b in clause if b[0] == "rows" and b[1] == 0))
    if (since, until) != (first, last):  # (a block has a row: first ≤ last)
        holds = sp.And(holds, sp.Le(since, until))
    lo = sp.Max(0, *(_least(b, since, until) for b in lowers))
    hi = sp.Min(cols, *(_greatest(b, since, until) + 1 for b in uppers))
    if holds != sp.true:
        lo, hi = sp.Piecewise((lo, holds), (cols, True)), sp.Piecewise((hi, holds), (0, True))
    if any(b[0] == "unknown" for b in clause):
        return lo, hi, sp.S.Zero, sp.S.Zero, sp.false
    open_lo = sp.Max(0, *(_greatest(b, first, last) for b in lowers))
    open_hi = sp.Min(cols, *(_least(b, first, last) + 1 for b in uppers))
    rows = sp.And(*(sp.Ge(_at(b, r), 0) for b in clause if b[0] == "rows" for r in (first, last)))
    if rows != sp.true:
        open_lo, open_hi = sp.Piecewise((open_lo, rows), (0, True)), sp.Piecewise((open_hi, rows), (0, True))
    # row i sees a key where max(0, Lₖ(i)) ≤ min(cols − 1, Uₖ(i)): a minimum of linear functions of i, concave, so
    # at least 0 over the block where it is at both end rows
    sees = [
        sp.Le(sp.Max(0, *(_at(b, r) for b in lowers)), sp.Min(cols - 1, *(_at(b, r) for b in uppers)))
        for r in (first, last)
    ]
    return lo, hi, open_lo, open_hi, sp.And(rows, *sees)


def _union(one: tuple[Expr, Expr], other: tuple[Expr, Expr]) -> tuple[Expr, Expr]:
    """[a₁, b₁) ∪ [a₂, b₂) as one range: their hull where they overlap (an empty one inside the other leaves it),
    else the wider."""
    (a1, b1), (a2, b2) = one, other
    overlap = sp.And(sp.Le(a2, b1), sp.Le(a1, b2))
    wider = sp.Ge(b1 - a1, b2 - a2)
    lo = sp.Piecewise((sp.Min(a1, a2), overlap), (a1, wider), (a2, True))
    hi = sp.Piecewise((sp.Max(b1, b2), overlap), (b1, wider), (b2, True))
    return lo, hi


def key_window(formula: Expr, first: Expr, end: Expr, cols: Expr) -> KeyWindow:
    """The key window (``KeyWindow``) of the rows first … end − 1 of [f(i, j)] with cols keys: first and end are
    SymPy expressions (the block's row bounds r₀, r₁, symbols for code that evaluates them per block)."""
    found = clauses(formula)
    if found is None:  # no structure: every key, the mask applied everywhere
        return KeyWindow(sp.S.Zero, cols, sp.S.Zero, sp.S.Zero, sp.false)
    if not found:  # every entry −∞: no key (a reader reads one, its probability zero)
        return KeyWindow(sp.S.Zero, sp.S.Zero, sp.S.Zero, sp.S.Zero, sp.false)
    windows = [_clause_window(c, first, end - 1, cols) for c in found]
    if len(windows) == 1:
        return KeyWindow(*windows[0])
    lo = sp.Min(*(sp.Piecewise((w[0], sp.Lt(w[0], w[1])), (cols, True)) for w in windows))
    hi = sp.Max(*(sp.Piecewise((w[1], sp.Lt(w[0], w[1])), (0, True)) for w in windows))
    open_lo, open_hi = reduce(_union, [(w[2], w[3]) for w in windows])
    return KeyWindow(lo, hi, open_lo, open_hi, sp.Or(*(w[4] for w in windows)))


def intersection(windows: list[KeyWindow]) -> KeyWindow:
    """The window of a sum of masks (a key hidden by one is hidden): lo the largest, hi the smallest, the open
    range every mask leaves open, and no row known to see a key."""
    if len(windows) == 1:
        return windows[0]
    return KeyWindow(
        sp.Max(*(w.lo for w in windows)),
        sp.Min(*(w.hi for w in windows)),
        sp.Max(*(w.open_lo for w in windows)),
        sp.Min(*(w.open_hi for w in windows)),
        sp.false,  # (each mask leaving a row a key leaves it none in common, maybe)
    )


def window_of_scores(scores: Expr, first: Expr, end: Expr) -> KeyWindow | None:
    """The key window of scores A = … + E₁ + E₂ (a value of blocks: its terms EntriesBlock) for the rows
    first … end − 1: the intersection of the windows of its terms that mask (a −∞ added to the scores hides its
    key, whatever the other terms); None when no term masks, or a mask's window reads the head (one window for
    every head) or a symbol that is no size."""
    terms = [t for t in MatAdd.make_args(scores) if isinstance(t, EntriesBlock) and t.formula.has(-sp.oo)]
    windows = [key_window(t.formula, first, end, t.shape[1]) for t in terms]
    if any(not of_sizes(w, first, end) for w in windows):
        return None
    return intersection(windows) if windows else None


def row_window(formula: Expr, first: Expr, end: Expr, rows: Expr) -> KeyWindow:
    """The query rows of the keys first … end − 1 of [f(i, j)] with rows query rows, as ``key_window`` finds keys:
    the key window of the transpose fᵀ(i, j) = f(j, i) (its rows the keys), from the same linear conditions. [lo, hi)
    holds every row that sees some key of the block, [open_lo, open_hi) rows that see every key of it unmasked."""
    return key_window(formula.xreplace({I: J, J: I}), first, end, rows)


def unmasked(formula: Expr) -> Expr:
    """f where it is not −∞: each Piecewise's −∞ branches dropped (its last kept branch made its default), through
    the sums, positive multiples and branches ``hidden`` reads. Equal to f wherever f ≠ −∞ when ``hidden(f)`` is not
    None (every −∞ of f reached that way); f itself otherwise."""
    if hidden(formula) is None or not formula.has(-sp.oo):
        return formula
    return _without_minus_infinity(formula)


def _without_minus_infinity(e: Expr) -> Expr:
    if not e.has(-sp.oo):
        return e
    if isinstance(e, sp.Piecewise):
        kept = [(_without_minus_infinity(v), c) for v, c in e.args if v != -sp.oo]
        if not kept:  # (−∞ everywhere: no visible entry reads it)
            return sp.S.Zero
        return sp.Piecewise(*kept[:-1], (kept[-1][0], True))
    return e.func(*(_without_minus_infinity(a) for a in e.args))


def of_sizes(window: KeyWindow, first: Expr, end: Expr) -> bool:
    """Is the window made of the block's row bounds and sizes alone (not of a head h, a trainable scalar), so that
    code can evaluate it once for a block of rows?"""
    parts = (window.lo, window.hi, window.open_lo, window.open_hi, sp.sympify(window.every_row))
    symbols = set().union(*(x.free_symbols for x in parts)) - {first, end}
    return not any(s == HEAD or not (s.is_integer and s.is_positive) for s in symbols)


FAR = 10**9  # a row and sizes far beyond any window written as a number: where a row's window is its own width


def width(window: KeyWindow, first: Expr, end: Expr) -> int | None:
    """The number of keys a row far from the edges sees, when it is a number (a sliding window of w keys: w);
    None when it grows with the sizes (causal: every earlier key) or reads a symbol. The row r = FAR of FAR² keys
    and rows, so that a bound of a size (min(m, r + 1)) is the window's own."""
    far = {first: FAR, end: FAR + 1}
    span = (window.hi - window.lo).xreplace(far)
    sizes = {s: sp.Integer(FAR**2) for s in span.free_symbols if s.is_integer and s.is_positive}
    span = span.xreplace(sizes)  # (a span of a size alone, n: the Integer itself)
    return int(span) if span.is_Integer and 0 < span < FAR // 2 else None
