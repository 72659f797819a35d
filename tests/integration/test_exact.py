"""Closed forms equal entrywise derivatives of explicit forwards, in exact arithmetic.

At small explicit sizes each forward is rebuilt entry by entry as a SymPy Matrix of
symbols (independently of symattn's specs), with exp an opaque ExpAtom so that
exp(a)·exp(b) never merges. f = Σ_ij G_ij Y_ij is differentiated entrywise with
sympy.diff; the closed form is evaluated with lambdify(backend="exact") at the same
random Rationals. Every ExpAtom(r) atom — the same atoms on both sides, since their
arguments are exact numbers — is then replaced by one random positive Rational, and
the difference must be exactly 0. The inputs not being differentiated are
substituted before diff, which keeps the expressions small (SYMPY_NOTES).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.numeric.printers import ExpAtom

pytestmark = pytest.mark.slow  # exact rational arithmetic

Forward = Callable[[dict[str, sp.Matrix]], sp.Matrix]


def symbol_matrix(name: str, rows: int, cols: int) -> sp.Matrix:
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}{j}"))


def row_softmax(a: sp.Matrix) -> sp.Matrix:
    """exp(a_ij) / Σ_k exp(a_ik) with opaque exp atoms."""
    e = a.applyfunc(ExpAtom)
    return sp.Matrix(a.rows, a.cols, lambda i, j: e[i, j] / sum(e[i, k] for k in range(a.cols)))


def explicit_attention(q: sp.Matrix, k: sp.Matrix, v: sp.Matrix, scale) -> sp.Matrix:
    return row_softmax(scale * (q * k.T)) * v


def explicit_self_attention(m: dict[str, sp.Matrix]) -> sp.Matrix:
    x = m["X"]
    scale = 1 / sp.sqrt(m["W_Q"].cols)
    return explicit_attention(x * m["W_Q"], x * m["W_K"], x * m["W_V"], scale)


def explicit_mha(num_heads: int) -> Forward:
    """Heads are column blocks of W_Q, W_K, W_V; their outputs are concatenated, then times W_O."""

    def forward(m: dict[str, sp.Matrix]) -> sp.Matrix:
        d_k = m["W_Q"].cols // num_heads
        heads = []
        for h in range(num_heads):
            cols = slice(h * d_k, (h + 1) * d_k)
            q, k, v = (m[x] * m["W_" + x][:, cols] for x in ("Q", "K", "V"))
            heads.append(explicit_attention(q, k, v, 1 / sp.sqrt(d_k)))
        return sp.Matrix.hstack(*heads) * m["W_O"]

    return forward


def exact_mismatches(
    spec: sa.Spec,
    forward: Forward,
    shapes: dict[str, tuple[int, int]],
    gradients: dict[str, sp.Basic],
    seed: int,
    dims: dict | None = None,
) -> dict[str, int]:
    """For each gradient: how many entries differ from the entrywise derivative (0 = exact match)."""
    rnd = random.Random(seed)

    def rational() -> sp.Rational:
        return sp.Rational(rnd.randint(-9, 9), rnd.randint(1, 6))

    symbols = {name: symbol_matrix(name, *shape) for name, shape in shapes.items()}
    values = {s: rational() for mat in symbols.values() for s in mat}
    out_shape = forward({name: mat.xreplace(values) for name, mat in symbols.items()}).shape
    g = sp.Matrix(*out_shape, lambda i, j: rational())
    arrays = [np.array(symbols[name].xreplace(values).tolist(), dtype=object) for name in spec.input_names]
    g_array = np.array(g.tolist(), dtype=object)

    mismatches = {}
    for name, closed_form in gradients.items():
        wrt = symbols[name]
        others = {s: v for s, v in values.items() if s not in wrt.free_symbols}
        y = forward({n: mat.xreplace(others) for n, mat in symbols.items()})
        f = sum(g[i, j] * y[i, j] for i in range(y.rows) for j in range(y.cols))
        entrywise = [f.diff(s).xreplace(values) for s in wrt]
        evaluate = sa.lambdify(
            [*spec.inputs, sp.MatrixSymbol("G", *spec.output.shape)], closed_form, "exact", dims=dims
        )
        closed = [sp.sympify(e) for e in evaluate(*arrays, g_array).flat]
        atoms = set().union(*(e.atoms(ExpAtom) for e in entrywise))
        assert atoms == set().union(*(e.atoms(ExpAtom) for e in closed)), "both sides share their exp atoms"
        positive = {a: sp.Rational(rnd.randint(1, 40), rnd.randint(1, 40)) for a in sorted(atoms, key=str)}
        mismatches[name] = sum((a - b).xreplace(positive) != 0 for a, b in zip(entrywise, closed))
    return mismatches


def run_exact(name: str, forward: Forward, shapes: dict, seed: int, dims: dict | None = None, **options) -> None:
    start = time.perf_counter()
    derivation = sa.derive(name, **options)
    assert set(derivation.gradients) == set(shapes)
    mismatches = exact_mismatches(derivation.spec, forward, shapes, derivation.gradients, seed, dims)
    sizes = ", ".join(f"{k} {r}×{c}" for k, (r, c) in shapes.items())
    print(f"\nexact {name} {options or ''} [{sizes}]: {time.perf_counter() - start:.2f} s")
    assert mismatches == dict.fromkeys(shapes, 0)


@pytest.mark.parametrize(
    ("scale", "factor"), [(1, sp.Integer(1)), (None, 1 / sp.sqrt(3))], ids=["scale 1", "scale 1/sqrt(d_k)"]
)
def test_attention_exact(scale, factor):
    shapes = {"Q": (4, 3), "K": (4, 3), "V": (4, 3)}

    def forward(m):
        return explicit_attention(m["Q"], m["K"], m["V"], factor)

    run_exact("attention", forward, shapes, seed=1, scale=scale)


def test_attention_exact_rectangular():
    # n ≠ m and d_k ≠ d_v, so a transposed or swapped factor cannot pass.
    shapes = {"Q": (2, 3), "K": (4, 3), "V": (4, 1)}

    def forward(m):
        return explicit_attention(m["Q"], m["K"], m["V"], 1 / sp.sqrt(3))

    run_exact("attention", forward, shapes, seed=2)


def test_self_attention_exact():
    shapes = {"X": (3, 2), "W_Q": (2, 2), "W_K": (2, 2), "W_V": (2, 2)}  # n = 3: exact exp sums stay small
    run_exact("self_attention", explicit_self_attention, shapes, seed=3)


@pytest.mark.parametrize("symbolic", [False, True], ids=["H=2", "symbolic H bound to 2"])
def test_mha_exact_two_heads(symbolic):
    shapes = {"Q": (2, 4), "K": (3, 4), "V": (3, 4)} | {w: (4, 4) for w in ("W_Q", "W_K", "W_V", "W_O")}
    if symbolic:
        run_exact("mha", explicit_mha(2), shapes, seed=4, dims={"H": 2})
    else:
        run_exact("mha", explicit_mha(2), shapes, seed=4, num_heads=2)


def test_exact_check_catches_a_dropped_softmax_term():
    # dQ without the −rowsum(G Vᵀ ⊙ P) 𝟏ᵀ term of the softmax VJP must be found wrong.
    spec = sa.spec("attention", scale=1)
    q, k, v = spec.inputs
    g = sp.MatrixSymbol("G", *spec.output.shape)
    p = sa.softmax(q * k.T)
    wrong = sa.hadamard(p, g * v.T) * k
    shapes = {"Q": (2, 2), "K": (3, 2), "V": (3, 2)}

    def forward(m):
        return explicit_attention(m["Q"], m["K"], m["V"], 1)

    mismatches = exact_mismatches(spec, forward, shapes, {"Q": wrong}, seed=5)
    assert mismatches["Q"] > 0
