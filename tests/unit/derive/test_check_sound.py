"""symattn check is sound: never "right" unless every trial was finite and within tolerance (issue 9).

Each test names the claim it is about; the claims of the issue are regression tests.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.cli import main
from symattn.derive.check import (
    DEFAULT_TRIALS,
    ENTRY_BUDGET,
    RIGHT,
    UNDECIDED,
    WRONG,
    _draw_sizes,
    namespace,
    size_ranges,
    spec_entries,
)
from symattn.errors import SymattnError
from symattn.lang.naming.parse import ParseError, parse
from symattn.numeric.verify import NonFiniteError, evaluate_finite, vjp_error

RIGHT_W_V = "X.T * P.T * G"  # ∂f/∂W_V = Xᵀ Pᵀ G for self_attention
# (1 + (n−2)(n−3)(n−4)(n−5)) ∂f/∂W_V: equal to the truth exactly when n ∈ {2, 3, 4, 5}
POLYNOMIAL_IN_N = "X.T*P.T*G*(1+(n-2)*(n-3)*(n-4)*(n-5))"


def check_w_v(claim: str, **kwargs) -> sa.CheckResult:
    return sa.check("self_attention", "W_V", claim, **kwargs)


# Right stays right, wrong stays wrong.


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_right_claim_is_right_at_every_seed(seed):
    # ∂f/∂W_V = Xᵀ Pᵀ G
    result = check_w_v(RIGHT_W_V, seed=seed, trials=8)
    assert result.status == RIGHT and result.right and bool(result)
    assert not result.wrong and not result.undecided and result.counterexample is None
    assert result.text().startswith("right:")


def test_a_wrong_claim_is_wrong_with_a_finite_counterexample():
    # seed 003: ∂L/∂W^V = Xᵀ ∂L/∂O (Pᵀ missing)
    result = check_w_v("X.T * G")
    assert result.status == WRONG and result.wrong and not result
    example = result.counterexample
    assert np.isfinite(example.claimed).all() and np.isfinite(example.true).all()
    assert np.isfinite(example.max_error) and example.max_error > 1e-3
    assert result.text().startswith("wrong:")


# NaN, ∞ and failed evaluations are "cannot be checked", never "right".


def test_a_claim_that_evaluates_to_nan_cannot_be_checked():
    # log of a matrix with negative entries is NaN; NaN > tol is False, so this used to be "right"
    result = check_w_v("log(X.T * P.T * G)")
    assert result.status == UNDECIDED and result.undecided
    assert not result and not result.right and not result.wrong
    assert "NaN" in result.reason and "n = " in result.reason
    assert result.text().startswith("cannot be checked: ")


def test_a_claim_that_evaluates_to_infinity_cannot_be_checked():
    # e^1000 overflows to ∞ in float64: Xᵀ Pᵀ G ⊙ e^1000 is never finite
    result = check_w_v("hadamard(X.T * P.T * G, exp(1000 * ones(d_model, d_v)))")
    assert result.status == UNDECIDED and "∞" in result.reason


def test_a_claim_too_large_to_evaluate_cannot_be_checked():
    # rowsum(e^0) over n⁴ columns is n⁴ · 𝟏, so the claim equals the truth; at n = 64 it needs 2²⁴-entry matrices
    claim = "X.T*P.T*G + rowsum(exp(zeros(d_model, n**4)))*ones(1, d_v)/n**4 - ones(d_model, d_v)"
    result = check_w_v(claim)
    assert result.status == UNDECIDED and "entries" in result.reason


def test_undecided_is_not_right_in_the_command_line(capsys):
    status = main(["check", "self_attention", "--wrt", "W_V", "log(X.T * P.T * G)"])
    assert status != 0
    assert capsys.readouterr().out.startswith("cannot be checked")


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (lambda: np.array([[np.nan, 1.0]]), "NaN"),
        (lambda: np.array([[np.inf, 1.0]]), "∞"),
        (lambda: np.array([[1j]]), "complex"),
        (lambda: 1 / 0, "ZeroDivisionError"),
        (lambda: float(10**400), "OverflowError"),
        (
            lambda: np.ones((1, 1)) / np.exp(np.array([[1000.0]])),
            "overflows on the way",
        ),  # 1/∞ = 0, but e^1000 overflowed
        (lambda: np.sqrt(np.array([[-1.0]])) * 0 + 1, "NaN"),
    ],
    ids=["nan", "inf", "complex", "zero division", "int overflow", "intermediate overflow", "sqrt(-1)"],
)
def test_evaluate_finite_names_every_kind_of_trouble(function, why):
    value, trouble = evaluate_finite(function, ())
    assert value is None and why in trouble


def test_evaluate_finite_accepts_finite_values_and_underflow():
    value, trouble = evaluate_finite(lambda a: a * np.exp(-1000.0), [np.ones((2, 2))])  # underflow to 0 is fine
    assert trouble == "" and value.dtype == np.float64 and not value.any()


def test_vjp_error_refuses_nan_instead_of_returning_it():
    # ⟨log(−eˣ), D⟩ is NaN: a NaN error would pass `error > tol` and fail `error < tol` alike
    n = sp.Symbol("n", positive=True, integer=True)
    x = sp.MatrixSymbol("X", n, n)
    with pytest.raises(NonFiniteError), np.errstate(invalid="ignore"):
        vjp_error(x, x, sa.log(-sa.exp(x)), {n: 3}, np.random.default_rng(0))
    assert vjp_error(x, x, sp.MatrixSymbol("G", n, n), {n: 3}, np.random.default_rng(0)) < 1e-7


# Dimensions are drawn from a wide range (Schwartz–Zippel), not just 2, 3, 4, 5.


@pytest.mark.parametrize("seed", range(8))
def test_a_claim_wrong_only_for_n_above_5_is_wrong_at_default_trials(seed):
    # (1 + (n−2)(n−3)(n−4)(n−5)) Xᵀ Pᵀ G: right at n ∈ {2, 3, 4, 5}, which are all the old check tried
    result = check_w_v(POLYNOMIAL_IN_N, seed=seed)
    assert result.status == WRONG, result.text()
    assert result.counterexample.dims["n"] not in (2, 3, 4, 5)


def test_the_default_trials_are_several():
    assert DEFAULT_TRIALS >= 5
    # the first point alone uses small sizes 2…5 and misses the stray factor: the random points find it
    assert check_w_v(POLYNOMIAL_IN_N, trials=1).status == RIGHT


def test_the_first_point_has_small_pairwise_different_sizes():
    ranges = size_ranges(sa.spec("self_attention"))
    sizes = _draw_sizes(ranges, np.random.default_rng(3), first=True)
    assert sorted(sizes.values()) == [2, 3, 4, 5]


def test_random_points_span_the_whole_range():
    ranges = size_ranges(sa.spec("self_attention"))
    assert set(ranges.values()) == {(2, 64)}
    rng = np.random.default_rng(0)
    drawn = [_draw_sizes(ranges, rng, first=False) for _ in range(300)]
    n_values = {sizes[sp.Symbol("n", positive=True, integer=True)] for sizes in drawn}
    assert min(n_values) == 2 and max(n_values) == 64 and len(n_values) > 50


@pytest.mark.parametrize("name", sa.specs())
def test_every_spec_fits_the_entry_budget_at_its_largest_sizes(name):
    s = sa.spec(name)
    ranges = size_ranges(s)
    assert all(2 < top <= 64 for _, top in ranges.values())
    assert spec_entries(s).xreplace({d: top for d, (_, top) in ranges.items()}) <= ENTRY_BUDGET


def test_grouped_query_heads_draw_a_divisor():
    s = sa.spec("mha", num_kv_heads="H_kv")
    ranges, rng = size_ranges(s), np.random.default_rng(0)
    for first in (True, False, False, False):
        sizes = {d.name: v for d, v in _draw_sizes(ranges, rng, first).items()}
        assert sizes["H"] % sizes["H_kv"] == 0


# trials, seed and claim are validated.


@pytest.mark.parametrize("trials", [0, -1, True, 2.0, "3", 10**6])
def test_trials_must_be_a_positive_integer(trials):
    with pytest.raises(SymattnError, match="trials"):
        check_w_v(RIGHT_W_V, trials=trials)


@pytest.mark.parametrize("seed", [-5, True, 1.5, "0"])
def test_seed_must_be_a_non_negative_integer(seed):
    with pytest.raises(SymattnError, match="seed"):
        check_w_v(RIGHT_W_V, seed=seed)


def test_negative_seed_on_the_command_line_is_one_line(capsys):
    assert main(["check", "self_attention", "--wrt", "W_V", "--seed", "-5", RIGHT_W_V]) == 2
    captured = capsys.readouterr()
    assert "seed" in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("claim", [42, 1.5, None, ["X.T * P.T * G"], np.ones((2, 2))])
def test_a_claim_that_is_neither_text_nor_sympy_is_refused(claim):
    with pytest.raises(SymattnError, match="claim must be"):
        check_w_v(claim)


def test_a_sympy_claim_is_taken_as_it_is():
    names = namespace(sa.spec("self_attention"))
    assert check_w_v(names["X"].T * names["P"].T * names["G"]).status == RIGHT


# Numbers, powers, division by zero and square roots of negatives are bounded or refused by the parser.


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        ("X.T*P.T*G*1e400", r"number 1e400 is out of range .* at column 11"),
        ("X.T*P.T*G*1e13", r"number 1e13 is out of range"),
        ("X.T*P.T*G*10000000000000", r"out of range"),
        ("X.T*P.T*G*1e-13", r"out of range"),
        ("X.T*P.T*G*10**10**10", r"exponent 10000000000 .* 64 .* at column 15"),
        ("X.T*P.T*G*2**65", r"exponent 65 .* 64"),
        ("X.T*P.T*G*10**-10**10", r"exponent -10000000000"),
        ("X.T*P.T*G*9**9**9**9", r"exponent"),
        ("X.T*P.T*G*(n**64)**64", r"combined exponent 4096"),
        ("X.T*P.T*G*((10**64)**64)**64", r"bits"),
        ("X.T*P.T*G*2**n", r"exponent must be a number"),
        ("X.T*P.T*G/0", r"division by zero at column 10"),
        ("X.T*P.T*G/(n-n)", r"division by zero"),
        ("X.T*P.T*G*0**-1", r"division by zero"),
        ("X.T*P.T*G*sqrt(-1)", r"not a real number .* at column 11"),
        ("X.T*P.T*G*(-1)**0.5", r"not a real number"),
        ("X.T*P.T*G*sqrt(-n)", r"not a real number"),
        ("eye(10**7) * X.T*P.T*G", r"size must be at most"),
    ],
)
def test_unbounded_or_undefined_numbers_are_refused_with_a_column(claim, message):
    with pytest.raises(ParseError, match=message):
        check_w_v(claim)


@pytest.mark.parametrize("claim", ["X.T*P.T*G*10**10**10", "X.T*P.T*G/0", "X.T*P.T*G*sqrt(-1)", "X.T*P.T*G*1e400"])
def test_refused_numbers_exit_2_with_one_line_on_the_command_line(claim, capsys):
    assert main(["check", "self_attention", "--wrt", "W_V", claim]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err


def test_a_power_tower_is_refused_without_being_computed():
    # 10**10**10 has 10¹⁰ digits; SymPy computing it hung for over ten minutes
    code = (
        "import symattn as sa\n"
        "try:\n"
        "    sa.check('self_attention', 'W_V', 'X.T*P.T*G*10**10**10')\n"
        "except sa.SymattnError as err:\n"
        "    print(type(err).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ParseError", done.stderr


def test_numbers_within_the_bounds_still_read_exactly():
    names = namespace(sa.spec("self_attention"))
    x = names["X"]
    assert parse("X * 0.1", names) == sp.Rational(1, 10) * x
    assert parse("X * 2**64", names) == 2**64 * x
    assert parse("X * 1e12 * 1e-12", names) == x
    assert parse("X / sqrt(d_k)**2", names) == x / names["d_k"]
    assert parse("X * 0", names) == 0 * x
