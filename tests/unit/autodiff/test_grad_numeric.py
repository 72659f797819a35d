"""Every gradient of every built-in spec against a central finite difference, at random shapes.

JAX's check_vjp pattern in float64: for f = tr(Gᵀ Y) and one random direction D,
⟨∂f/∂W, D⟩ must equal (f(W + εD) − f(W − εD)) / 2ε. Shapes (sizes 1 to 4, so
degenerate one-row and one-column cases included), leading batch dimensions and
the random numbers are drawn by hypothesis, derandomized so CI is reproducible.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symattn as sa
from symattn.numeric.verify import dimension_symbols, vjp_error
from symattn.specs import dim

TOLERANCE = 1e-6
CHECK = settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# (spec name, options): the scale option of attention, and mha with fixed and symbolic H.
CASES = [
    ("attention", {}),
    ("attention", {"scale": 1}),
    ("self_attention", {}),
    ("mha", {"num_heads": 1}),
    ("mha", {"num_heads": 2}),
    ("mha", {"num_heads": 3}),
    ("mha", {}),
]
CASES += [(name, {}) for name in sa.specs() if name not in {case[0] for case in CASES}]  # specs added later


@cache
def derivation(name: str, options: tuple) -> sa.Derivation:
    return sa.derive(name, **dict(options))


@st.composite
def sizes(draw, symbols: list[sp.Symbol]) -> dict[sp.Symbol, int]:
    """A size for every dimension symbol: 1…4, heads H 1…3."""
    return {s: draw(st.integers(1, 3 if s.name == "H" else 4)) for s in symbols}


BATCHES = st.sampled_from([(), (2,), (3, 2)])
SEEDS = st.integers(0, 2**32 - 1)


@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_every_gradient_of_every_spec_at_random_shapes(name, options):
    d = derivation(name, tuple(options.items()))
    spec = d.spec
    symbols = dimension_symbols(spec.output)

    @CHECK
    @given(dims=sizes(symbols), batch=BATCHES, seed=SEEDS)
    def check(dims, batch, seed):
        rng = np.random.default_rng(seed)
        for symbol in spec.inputs:
            err = vjp_error(spec.output, symbol, d.tape.gradients[symbol], dims, rng, batch=batch)
            assert err < TOLERANCE, (name, options, symbol.name, dims, batch, err)

    check()


def shared_input_mha(num_heads) -> tuple[sp.MatrixExpr, sp.MatrixSymbol, sa.Derivation]:
    """mha with X fed as Q, K and V: (forward of X, X, mha's derivation)."""
    d = derivation("mha", (("num_heads", num_heads),))
    q = d.spec.input("Q")
    x = sp.MatrixSymbol("X", *q.shape)
    shared = {d.spec.input(name): x for name in ("Q", "K", "V")}
    return d.spec.output.xreplace(shared), x, d


@pytest.mark.parametrize("num_heads", [1, 2, None])
def test_self_attention_through_mha_sums_the_three_input_gradients(num_heads):
    # Q = K = V = X: by the chain rule dX = dQ + dK + dV evaluated at Q = K = V = X.
    forward, x, d = shared_input_mha(num_heads)
    spec = d.spec
    m, n = dim("m"), dim("n")
    shared = {spec.input(name): x for name in ("Q", "K", "V")}
    summed = sum((d.gradients[name] for name in ("Q", "K", "V")), start=sp.ZeroMatrix(*x.shape))
    summed = summed.xreplace(shared).xreplace({m: n})
    direct = sa.grad(forward, [x])[x]
    rng = np.random.default_rng(7)
    for batch in [(), (2,)]:
        dims = {s: int(rng.integers(1, 5)) for s in dimension_symbols(forward)}
        if num_heads is None:
            dims[dim("H")] = 2
        for gradient in (summed, direct):
            err = vjp_error(forward, x, gradient, dims, rng, batch=batch)
            assert err < TOLERANCE, (num_heads, batch, err)


def test_a_wrong_gradient_is_caught():
    # The check must be able to fail: dQ with its sign flipped (or dropped 1/√d_k) is rejected.
    d = derivation("attention", ())
    spec = d.spec
    q = spec.input("Q")
    rng = np.random.default_rng(3)
    dims = {s: 3 for s in dimension_symbols(spec.output)}
    assert vjp_error(spec.output, q, -d.gradients["Q"], dims, rng) > 1e-3
    assert vjp_error(spec.output, q, d.gradients["Q"] * sp.sqrt(dim("d_k")), dims, rng) > 1e-3
