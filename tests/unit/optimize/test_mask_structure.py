"""A mask's structure (``optimize.mask_structure``): the key window of a block of rows, checked against the formula
evaluated at every (i, j).

For each mask and every block [r₀, r₁) of small sizes (n ≠ m both ways): no key outside [lo, hi) is visible to a
row of the block, every key of [open_lo, open_hi) is visible to all of them, every_row holds only where every row
sees a key, and for the masks whose visible set is one clause (causal, windows, band, offsets) the ranges and
every_row are exactly what brute force finds. A formula
the analysis cannot read (a floor, a trainable scalar in a condition, a −∞ reached through a Min or an exp)
falls back to every key and no open range.
"""

from __future__ import annotations

import pytest
import sympy as sp

from symattn.lang.positions import I, J
from symattn.optimize.mask_structure import (
    KeyWindow,
    clauses,
    hidden,
    intersection,
    key_window,
    of_sizes,
    pure_mask,
    row_window,
    unmasked,
    width,
)

N, M = sp.Symbol("n", integer=True, positive=True), sp.Symbol("m", integer=True, positive=True)
R0, R1 = sp.Symbol("r0", integer=True, nonnegative=True), sp.Symbol("r1", integer=True, positive=True)
TAU = sp.Symbol("tau", real=True)


def _mask(condition):
    return sp.Piecewise((0, condition), (-sp.oo, True))


# name → (formula, exact: one clause, so that the ranges are exactly brute force's)
MASKS = {
    "causal": (_mask(J <= I), True),
    "window-1": (_mask((J <= I) & (I - J < 1)), True),
    "window-4": (_mask((J <= I) & (I - J < 4)), True),
    "window-abs": (_mask(sp.Abs(I - J) < 3), False),  # |i − j| < 3: split by sign into two clauses
    "prefix-lm": (_mask((J < 3) | (J <= I)), False),
    "band": (_mask((J >= I - 2) & (J <= I + 1)), True),
    "offset": (_mask(J <= I + M - N), True),  # bottom-right causal when n ≠ m
    "strided": (_mask((2 * I - 2 * J >= 0) & (I - J <= 5)), True),  # coefficients scaled to ±1
    "not-diagonal": (sp.Piecewise((-sp.oo, sp.Eq(I, J)), (0, True)), False),
    "alibi-window": (-sp.Abs(I - J) / 2 + _mask((J <= I) & ~(I - J >= 3)), True),  # ~ of a relation
    "learned": (-TAU * sp.Abs(I - J) + _mask(J <= I + 2), True),
    "rows-too": (_mask((I >= 4) & (J <= I)), True),  # rows 0 … 3 see nothing
    "two-masks": (_mask(J <= I) + _mask(I - J < 3), True),
    "nested": (sp.Piecewise((_mask(J <= I), I >= 2), (0, True)), False),
}
FALLBACKS = {
    "floor": _mask(sp.floor(I / 2) >= J),
    "learned-condition": _mask(TAU * I >= J),
    "min-of-mask": sp.Min(_mask(J <= I), I - J),  # a −∞ through a Min
    "exp-of-mask": sp.exp(_mask(J <= I)),
    "half-j": _mask(2 * J <= I),  # a coefficient of j other than ±1
}
SIZES = [(9, 9), (7, 11), (11, 6)]


def _visible(formula, rows, cols):
    """The set of (i, j) where the formula is not −∞, by evaluating it at each position."""
    f = formula.subs({N: rows, M: cols, TAU: sp.Rational(3, 10)})
    return {(i, j) for i in range(rows) for j in range(cols) if f.subs({I: i, J: j}) != -sp.oo}


def _evaluated(window: KeyWindow, r0, r1, rows, cols):
    values = {R0: r0, R1: r1, N: rows, M: cols}
    return [int(x.subs(values)) for x in (window.lo, window.hi, window.open_lo, window.open_hi)]


def _every_row(window: KeyWindow, r0, r1, rows, cols) -> bool:
    return bool(sp.sympify(window.every_row).subs({R0: r0, R1: r1, N: rows, M: cols}))


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("name", MASKS)
def test_the_key_window_holds_every_visible_key_and_opens_only_visible_ones(name, size):
    formula, exact = MASKS[name]
    rows, cols = size
    visible = _visible(formula, rows, cols)
    window = key_window(formula, R0, R1, M)
    for r0 in range(rows):
        for r1 in range(r0 + 1, min(rows, r0 + 4) + 1):
            lo, hi, open_lo, open_hi = _evaluated(window, r0, r1, rows, cols)
            seen = sorted({j for i, j in visible if r0 <= i < r1})
            everywhere = sorted(j for j in range(cols) if all((i, j) in visible for i in range(r0, r1)))
            assert all(lo <= j < hi for j in seen), (r0, r1, lo, hi, seen)
            assert set(range(open_lo, open_hi)) <= set(everywhere), (r0, r1, open_lo, open_hi)
            every_row = all(any((i, j) in visible for j in range(cols)) for i in range(r0, r1))
            assert every_row or not _every_row(window, r0, r1, rows, cols), (r0, r1)
            if exact:
                assert (lo, hi) == (seen[0], seen[-1] + 1) if seen else lo >= hi, (r0, r1, lo, hi, seen)
                full = (everywhere[0], everywhere[-1] + 1) if everywhere else None
                assert (open_lo, open_hi) == full if full else open_lo >= open_hi, (r0, r1, open_lo, open_hi)
                assert _every_row(window, r0, r1, rows, cols) == every_row, (r0, r1)


def test_known_windows_in_closed_form():
    # a causal window of w keys: rows r₀ … r₁ − 1 see keys r₀ − w + 1 … r₁ − 1, all of them r₁ − w … r₀
    window = key_window(MASKS["window-4"][0], R0, R1, M)
    assert (window.lo, window.hi) == (sp.Max(0, R0 - 3), sp.Min(M, R1))
    assert (window.open_lo, window.open_hi) == (sp.Max(0, R1 - 4), sp.Min(M, R0 + 1))
    causal = key_window(MASKS["causal"][0], R0, R1, M)
    assert (causal.lo, causal.hi, causal.open_lo, causal.open_hi) == (0, sp.Min(M, R1), 0, sp.Min(M, R0 + 1))
    offset = key_window(MASKS["offset"][0], R0, R1, M)
    assert offset.hi == sp.Min(M, R1 + M - N)


@pytest.mark.parametrize("name", FALLBACKS)
def test_what_the_analysis_cannot_read_falls_back_to_every_key(name):
    formula = FALLBACKS[name]
    window = key_window(formula, R0, R1, M)
    assert (window.lo, window.hi) == (0, M)
    assert (window.open_lo, window.open_hi) == (0, 0) and window.every_row == sp.false


def test_a_formula_without_minus_infinity_hides_nothing():
    assert hidden(-sp.Abs(I - J) / 2) == sp.false
    assert clauses(-sp.Abs(I - J) / 2) == [[]]
    window = key_window(-sp.Abs(I - J) / 2, R0, R1, M)
    assert (window.lo, window.hi, window.open_lo, window.open_hi) == (0, M, 0, M)


def test_a_mask_hiding_everything_leaves_an_empty_window():
    window = key_window(sp.Piecewise((-sp.oo, I >= 0), (0, True)), R0, R1, M)
    assert _evaluated(window, 2, 5, 9, 9)[0] >= _evaluated(window, 2, 5, 9, 9)[1]


def test_the_intersection_of_two_windows_is_the_window_of_the_sum():
    causal, window = key_window(MASKS["causal"][0], R0, R1, M), key_window(_mask(I - J < 3), R0, R1, M)
    both = intersection([causal, window])
    summed = key_window(MASKS["two-masks"][0], R0, R1, M)
    for r0, r1 in ((0, 4), (3, 7), (5, 9)):
        assert _evaluated(both, r0, r1, 9, 9)[:2] == _evaluated(summed, r0, r1, 9, 9)[:2]


def test_a_pure_mask_is_known_by_its_hidden_condition():
    # 0 or −∞ only: −∞ written where the condition holds; anything else added (a bias, a mask with a bias)
    def same(condition, want):
        grid = [{I: i, J: j} for i in range(7) for j in range(7)]
        return all(bool(condition.subs(at)) == bool(want.subs(at)) for at in grid)

    assert same(pure_mask(_mask(J <= I)), J > I)
    assert same(pure_mask(_mask((J <= I) & (I - J < 4))), (J > I) | (I - J >= 4))
    assert not pure_mask(_mask((J <= I) & (I - J < 4))).has(sp.Not)  # (negations pushed into the relations)
    assert pure_mask(MASKS["alibi-window"][0]) is None
    assert pure_mask(sp.Piecewise((1, J <= I), (-sp.oo, True))) is None
    assert pure_mask(-sp.Abs(I - J)) is None


def test_a_window_of_the_head_or_a_scalar_is_not_evaluated_per_block():
    head = sp.Symbol("h", integer=True, nonnegative=True)
    assert of_sizes(key_window(MASKS["window-4"][0], R0, R1, M), R0, R1)
    assert not of_sizes(key_window(_mask((J <= I) & (I - J <= head)), R0, R1, M), R0, R1)


# transposed, 2j ≤ i and ⌊i/2⌋ ≥ j are bounds on i (2i ≤ j): readable as rows of a block of keys
TRANSPOSED = {name: formula for name, (formula, _) in MASKS.items()} | {k: FALLBACKS[k] for k in ("half-j", "floor")}


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("name", TRANSPOSED)
def test_the_row_window_holds_every_row_that_sees_a_key_and_opens_only_rows_seeing_all(name, size):
    # the transposed question, for a block of keys [c₀, c₁): the rows that see one of them, the rows that see all
    formula, exact = TRANSPOSED[name], MASKS.get(name, (None, False))[1]
    rows, cols = size
    visible = _visible(formula, rows, cols)
    window = row_window(formula, R0, R1, N)
    for c0 in range(cols):
        for c1 in range(c0 + 1, min(cols, c0 + 4) + 1):
            lo, hi, open_lo, open_hi = _evaluated(window, c0, c1, rows, cols)
            seeing = sorted({i for i, j in visible if c0 <= j < c1})
            all_of = sorted(i for i in range(rows) if all((i, j) in visible for j in range(c0, c1)))
            assert all(lo <= i < hi for i in seeing), (c0, c1, lo, hi, seeing)
            assert set(range(open_lo, open_hi)) <= set(all_of), (c0, c1, open_lo, open_hi)
            if exact:
                assert (lo, hi) == (seeing[0], seeing[-1] + 1) if seeing else lo >= hi, (c0, c1, lo, hi, seeing)


@pytest.mark.parametrize("name", ["learned-condition", "min-of-mask", "exp-of-mask"])
def test_a_row_window_the_analysis_cannot_read_is_every_row(name):
    window = row_window(FALLBACKS[name], R0, R1, N)
    assert (window.lo, window.hi, window.open_lo, window.open_hi) == (0, N, 0, 0)


@pytest.mark.parametrize("name", MASKS)
def test_the_unmasked_formula_equals_the_formula_wherever_it_is_visible(name):
    # f without its −∞ branches: f at every visible (i, j), and no −∞ left
    formula, _ = MASKS[name]
    bare = unmasked(formula)
    assert not bare.has(-sp.oo)
    values = {N: 9, M: 11, TAU: sp.Rational(3, 10)}
    for i, j in _visible(formula, 9, 11):
        at = {**values, I: i, J: j}
        assert sp.simplify(bare.subs(at) - formula.subs(at)) == 0, (i, j)


def test_a_formula_whose_minus_infinity_the_analysis_cannot_read_is_left_as_it_is():
    for formula in (FALLBACKS["min-of-mask"], FALLBACKS["exp-of-mask"]):
        assert unmasked(formula) == formula
    assert unmasked(-sp.Abs(I - J)) == -sp.Abs(I - J)
    assert unmasked(MASKS["alibi-window"][0]) == -sp.Abs(I - J) / 2


@pytest.mark.parametrize(
    ("name", "keys"),
    [("window-1", 1), ("window-4", 4), ("window-abs", 5), ("band", 4), ("strided", 6), ("alibi-window", 3)]
    + [("causal", None), ("prefix-lm", None), ("offset", None), ("learned", None)],
)
def test_a_rows_window_width_is_its_number_of_keys_or_none_where_it_grows(name, keys):
    # a row far from the edges sees w keys under a sliding window; causal (every earlier key) grows with the sizes
    assert width(key_window(MASKS[name][0], R0, R1, M), R0, R1) == keys
