"""The trace's dimensions and numbers: lengths merged only where an operation needs them equal; a float read as
√d or 1/√d of a dimension at the example, any other number as its exact form."""

from __future__ import annotations

import math

import pytest
import sympy as sp

from symattn.trace.values import Dims, Refused, literal, number


def dims_with(*sizes: int) -> tuple[Dims, list, list[dict]]:
    merges: list[dict] = []
    dims = Dims(merges.append)
    return dims, [dims.fresh(s, ("cols", f"x{i}")) for i, s in enumerate(sizes)], merges


def test_a_size_one_axis_is_the_number_one():
    _, (one,), _ = dims_with(1)
    assert one == 1


def test_equal_sizes_stay_apart_until_equated_and_the_later_symbol_goes():
    dims, (a, b), merges = dims_with(4, 4)
    assert a != b
    dims.equate(a, b)
    assert merges == [{b: a}] and set(dims.sizes) == {a}


def test_lengths_of_different_sizes_cannot_be_equated():
    dims, (a, b), _ = dims_with(4, 5)
    with pytest.raises(Refused):
        dims.equate(a, b)


def test_a_length_split_into_heads_becomes_a_multiple_of_a_new_dimension():
    # d = 6 split into 2 heads: d := 2 t, each head t wide
    dims, (d,), merges = dims_with(6)
    width = dims.divisible(d, 2)
    (t,) = width.free_symbols
    assert merges == [{d: 2 * t}] and width == t and dims.size(t) == 3


def test_multiples_of_two_dimensions_meet_at_a_common_one():
    # 2 a = 3 b (both 12): a := 3 t, b := 2 t, t = 2
    dims, (a, b), merges = dims_with(6, 4)
    dims.equate(2 * a, 3 * b)
    (t,) = merges[0][a].free_symbols
    assert merges == [{a: 3 * t, b: 2 * t}] and dims.size(t) == 2


@pytest.mark.parametrize(
    "x, expected",
    [(1 / math.sqrt(7), "1/sqrt(d)"), (math.sqrt(7), "sqrt(d)"), (7**-0.5, "1/sqrt(d)"), (0.1, "1/10"), (3, "3")],
)
def test_a_number_is_read_as_a_root_of_a_dimension_or_exactly(x, expected):
    dims = Dims(lambda m: None)
    d = dims.fresh(7, ("cols", "x"))
    got = number(x, dims)
    assert got == sp.sympify(expected).xreplace({sp.Symbol("d"): d})


def test_a_literal_is_exact_when_it_rounds_back_and_a_float_otherwise():
    assert literal(1e-5) == sp.Rational(1, 100000)
    assert literal(math.sqrt(2 / math.pi)) == sp.sqrt(2) / sp.sqrt(sp.pi)
    assert float(literal(0.044715)) == 0.044715
    with pytest.raises(Refused):
        literal(float("inf"))
