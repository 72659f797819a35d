"""Numeric checks of closed forms: random sizes and matrices, finite evaluation, JAX-style VJP checks.

``vjp_error`` compares ⟨∂f/∂W, D⟩ with the central difference
(f(W + εD) − f(W − εD)) / 2ε of f = tr(Gᵀ Y) along one random direction D, in
float64; the tests use it. ``evaluate_finite`` evaluates a compiled expression and
says why its value cannot be trusted (NaN, ±∞, complex values, an arithmetic error,
an overflow or invalid operation on the way); ``symattn check`` uses it.

A comparison ``error > tol`` is False for error = NaN, so a check built on it would
pass a claim that evaluates to NaN. Neither helper returns NaN: ``vjp_error`` raises
NonFiniteError, ``evaluate_finite`` reports the trouble instead of a value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.autodiff.grad import default_seed
from symattn.errors import SymattnError
from symattn.lang.graph import nodes
from symattn.lang.shapes import dimension_symbols
from symattn.numeric.lambdify import lambdify


class NonFiniteError(SymattnError, ArithmeticError):
    """A numeric check met a value that is not a finite real number, so it proves nothing."""


def evaluate_finite(function: Callable, args: Iterable) -> tuple[np.ndarray | None, str]:
    """function(*args) as a float64 array and "", or None and why it is not a finite real value.

    Why, as a phrase: "evaluates to NaN", "evaluates to ∞", "has complex values",
    "overflows on the way (numpy: overflow)", "raises ZeroDivisionError: …".
    Underflow to 0 is accepted; overflow, division by zero and invalid operations
    in any intermediate step are not, even when the final value is finite.
    """
    events: list[str] = []
    try:
        with np.errstate(
            over="call", divide="call", invalid="call", under="ignore", call=lambda e, _: events.append(e)
        ):
            raw = function(*args)
            if np.iscomplexobj(raw):
                return None, "has complex values"
            value = np.asarray(raw, dtype=np.float64)
    except SymattnError:
        raise  # bad input (a shape, an unknown dimension) is the caller's error, not a value
    except (ArithmeticError, ValueError, TypeError) as err:  # 1/0, int too large for a float, sqrt(-1), complex
        message = str(err).splitlines()[0] if str(err) else ""
        return None, f"raises {type(err).__name__}" + (f" ({message})" if message else "")
    if np.isnan(value).any():
        return None, "evaluates to NaN"
    if not np.isfinite(value).all():
        return None, "evaluates to ∞"
    if events:
        return None, f"overflows on the way (numpy: {events[0]})"
    return value, ""


def random_dims(
    exprs: Sequence[Basic], rng: np.random.Generator, low: int = 2, high: int = 5, fixed: Mapping | None = None
) -> dict[sp.Symbol, int]:
    """Random sizes in [low, high] for every dimension symbol (fixed ones kept); a length a node needs at least k of
    (``least_sizes``: a row's k-th largest entry) in [max(low, k), max(high, k)]."""
    fixed = {(sp.Symbol(k) if isinstance(k, str) else k).name: v for k, v in (fixed or {}).items()}
    least = least_sizes(exprs)
    sizes = {}
    for s in dimension_symbols(*exprs):
        floor = least.get(s, low)
        sizes[s] = int(fixed.get(s.name, rng.integers(max(low, floor), max(high, floor) + 1)))
    return sizes


def least_sizes(exprs: Sequence[Basic]) -> dict[sp.Symbol, int]:
    """The smallest size of each dimension symbol that the nodes of exprs need (a node's ``least_sizes()``: the
    k-th largest entry of a row needs rows of k entries); a length that is no single symbol is not bounded here."""
    least: dict[sp.Symbol, int] = {}
    for node in nodes(*exprs):
        for length, size in getattr(node, "least_sizes", dict)().items():
            if isinstance(length, sp.Symbol):
                least[length] = max(least.get(length, 0), size)
    return least


def concrete_shape(symbol: MatrixExpr, dims: Mapping[sp.Symbol, int]) -> tuple[int, int]:
    return tuple(int(sp.sympify(d).xreplace(dims)) for d in symbol.shape)


def random_matrix(symbol: MatrixExpr, dims: Mapping, rng: np.random.Generator, batch: tuple = ()) -> np.ndarray:
    return rng.standard_normal(batch + concrete_shape(symbol, dims))


def random_constant(symbol: MatrixExpr, dims: Mapping, rng: np.random.Generator, indices: Mapping) -> np.ndarray:
    """A random value of a constant: standard normal entries, or for one read inside a table read's index (Swin's idx
    of T[idx[i, j], h]) integers 0 … s − 1, s = indices[symbol] the least table dimension it indexes (the output's
    ``lang.positions.index_sizes``)."""
    size = indices.get(symbol)
    if size is None:
        return random_matrix(symbol, dims, rng)
    return rng.integers(0, int(sp.sympify(size).xreplace(dims)), concrete_shape(symbol, dims)).astype(np.float64)


def vjp_error(
    expr: Basic,
    symbol: MatrixSymbol,
    gradient: Basic,
    dims: Mapping[sp.Symbol, int],
    rng: np.random.Generator,
    cotangent: Basic | None = None,
    eps: float = 1e-6,
    batch: tuple = (),
) -> float:
    """Relative error of ⟨gradient, D⟩ against a central difference of tr(Gᵀ expr) along D.

    Every input (and G) gets the leading ``batch`` dimensions; the error is
    |analytic − numeric| / max(1, |numeric|). A value that is not finite (NaN, ±∞)
    raises NonFiniteError: NaN would make both ``error < tol`` and ``error > tol`` false.
    """
    seed = default_seed(expr, cotangent)
    inputs = sorted(expr.atoms(MatrixSymbol) | {symbol}, key=lambda s: s.name)
    inputs = [s for s in inputs if s != seed]
    uses_seed = isinstance(seed, MatrixSymbol)
    fixed = {s.name: v for s, v in dims.items()}
    forward = lambdify(inputs, expr, dims=fixed)
    args_g = inputs + ([seed] if uses_seed else [])
    backward = lambdify(args_g, gradient, dims=fixed)
    values = {s: random_matrix(s, dims, rng, batch) for s in inputs}
    g = random_matrix(seed, dims, rng, batch) if uses_seed else None

    def objective(vals: dict) -> float:
        y = forward(*(vals[s] for s in inputs))
        if g is not None:
            return float(np.sum(g * y))
        return float(np.sum(y))

    direction = rng.standard_normal(np.shape(values[symbol]))
    plus, minus = dict(values), dict(values)
    plus[symbol] = values[symbol] + eps * direction
    minus[symbol] = values[symbol] - eps * direction
    numeric = (objective(plus) - objective(minus)) / (2 * eps)
    grad_value = backward(*(values[s] for s in inputs), *([g] if g is not None else []))
    analytic = float(
        np.sum(np.broadcast_to(grad_value, np.broadcast_shapes(np.shape(grad_value), direction.shape)) * direction)
    )
    if not (np.isfinite(analytic) and np.isfinite(numeric)):
        raise NonFiniteError(f"vjp_error of {symbol.name}: analytic {analytic}, central difference {numeric}")
    return abs(analytic - numeric) / max(1.0, abs(numeric))
