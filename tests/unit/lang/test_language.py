"""The expression language: each node's shape, and its value under lambdify against NumPy.

Values are checked with leading batch dimensions (2, 3), so every printed node must
broadcast: transposes swap the last two axes, reductions use negative axes, and a
per-batch scalar such as tr(A) multiplies its own batch entry's matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import HadamardPower, MatPow, MatrixSymbol, OneMatrix, Trace, hadamard_product

import symattn as sa
from symattn.specs import dim

n, d, H = dim("n"), dim("d"), dim("H")
X = MatrixSymbol("X", n, d)
Y = MatrixSymbol("Y", n, d)
S = MatrixSymbol("S", n, n)
BATCH = (2, 3)
SIZES = {"n": 4, "d": 6}


def softmax_rows(a: np.ndarray) -> np.ndarray:
    e = np.exp(a)
    return e / e.sum(axis=-1, keepdims=True)


def per_batch(f, *arrays: np.ndarray) -> np.ndarray:
    """f applied to each batch entry's matrices separately (the reference for broadcasting)."""
    out = [f(*(a[i, j] for a in arrays)) for i in range(BATCH[0]) for j in range(BATCH[1])]
    return np.array(out).reshape(BATCH + np.shape(out[0]))


def blocks(a: np.ndarray, heads: int) -> list[np.ndarray]:
    return np.split(a, heads, axis=-1)


CASES = [
    ("softmax", sa.softmax(X), lambda x, y, s: softmax_rows(x)),
    ("exp", sa.exp(X), lambda x, y, s: np.exp(x)),
    ("log", sa.log(sa.sigmoid(X)), lambda x, y, s: np.log(1 / (1 + np.exp(-x)))),
    ("tanh", sa.tanh(X), lambda x, y, s: np.tanh(x)),
    ("rowsum", sa.rowsum(X), lambda x, y, s: x.sum(axis=1, keepdims=True)),
    ("rowsum broadcast", sa.rowsum(X) * OneMatrix(1, d), lambda x, y, s: np.repeat(x.sum(1, keepdims=True), 6, 1)),
    ("sum", sa.sum(X), lambda x, y, s: x.sum()),
    ("trace", Trace(S), lambda x, y, s: np.trace(s)),
    ("transpose product", X.T * S * Y, lambda x, y, s: x.T @ s @ y),
    ("difference", X - 2 * Y, lambda x, y, s: x - 2 * y),
    ("scaled", X / sp.sqrt(d), lambda x, y, s: x / np.sqrt(6)),
    ("hadamard", sa.hadamard(X, Y, X), lambda x, y, s: x * y * x),
    ("hadamard power", hadamard_product(X, X), lambda x, y, s: x**2),
    ("matrix power", S * S * S, lambda x, y, s: s @ s @ s),
    ("trace times matrix", Trace(S) * X, lambda x, y, s: np.trace(s) * x),
    ("sum times ones", sa.sum(Y) * OneMatrix(n, n), lambda x, y, s: y.sum() * np.ones((4, 4))),
    ("trace product", Trace(S) * sa.sum(X) * Y, lambda x, y, s: np.trace(s) * x.sum() * y),
    (
        "heads",
        sa.merge_heads(sa.softmax(sa.split_heads(X, 2) * sa.split_heads(Y, 2).T) * sa.split_heads(Y, 2), 2),
        lambda x, y, s: np.hstack([softmax_rows(a @ b.T) @ b for a, b in zip(blocks(x, 2), blocks(y, 2))]),
    ),
]


@pytest.mark.parametrize(("expr", "reference"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_node_evaluates_with_batch_dimensions(expr, reference):
    rng = np.random.default_rng(2)
    x, y, s = (rng.standard_normal(BATCH + shape) for shape in [(4, 6), (4, 6), (4, 4)])
    value = sa.lambdify([X, Y, S], expr)(x, y, s)
    assert np.allclose(value, per_batch(reference, x, y, s), rtol=1e-12, atol=1e-12)


def test_symbolic_heads_bind_from_dims():
    expr = sa.merge_heads(sa.tanh(sa.split_heads(X, H)), H)
    x = np.random.default_rng(4).standard_normal((2, 4, 6))
    assert np.allclose(sa.lambdify([X], expr, dims={"H": 3})(x), np.tanh(x))
    assert sa.split_heads(MatrixSymbol("Z", n, H * d), H).shape == (n, d)
    assert sa.merge_heads(X, H).shape == (n, H * d)


def test_sympy_rewrites_that_the_language_accepts():
    # X X of a square X is MatPow; X ⊙ X through hadamard_product is HadamardPower.
    assert isinstance(S * S, MatPow)
    assert isinstance(hadamard_product(X, X), HadamardPower)
    assert sa.rowsum(X).shape == (n, 1)
    assert not isinstance(sa.sum(X), sp.MatrixExpr)


def test_exact_backend_keeps_rationals_and_opaque_exps():
    from symattn.numeric.printers import ExpAtom

    x = np.array([[sp.Rational(1, 2), 3], [sp.Rational(-2, 3), 1]], dtype=object)
    value = sa.lambdify([S], Trace(S) * S + sa.exp(S), backend="exact")(x)
    assert value[0, 0] == sp.Rational(3, 4) + ExpAtom(sp.Rational(1, 2))
    assert value[1, 0] == sp.Rational(-1, 1) + ExpAtom(sp.Rational(-2, 3))
