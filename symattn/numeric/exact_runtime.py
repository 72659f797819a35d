"""Runtime helpers of code printed by ``ExactPrinter``: entrywise functions on object arrays of SymPy numbers.

Real code, linted and tested; the printer copies the source of the ones an expression calls
(``inspect.getsource``) into the code it prints, which runs with ``np``, ``sp`` and ``ExpAtom``.
"""

from __future__ import annotations

import numpy as np
import sympy as sp
from sympy import Basic


class ExpAtom(sp.Function):
    """exp(x) kept opaque: no automatic exp(a)·exp(b) = exp(a + b), d/dx ExpAtom(x) = ExpAtom(x)."""

    def fdiff(self, argindex: int = 1) -> Basic:
        return self


def exp(a):
    """exp(x), entrywise, as an opaque atom."""
    return np.vectorize(ExpAtom, otypes=[object])(a)


def log(a):
    """log(x), entrywise."""
    return np.vectorize(sp.log, otypes=[object])(a)


def tanh(a):
    """tanh(x), entrywise."""
    return np.vectorize(sp.tanh, otypes=[object])(a)


def row_softmax(a):
    """exp(A) with each row divided by its sum (no max subtracted: exact numbers do not overflow)."""
    e = exp(a)
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(a):
    """1 / (1 + exp(-x)), entrywise."""
    return 1 / (1 + exp(-a))


def gelu(a):
    """x (1 + erf(x / √2)) / 2, entrywise."""
    return np.vectorize(lambda x: x * (1 + sp.erf(x / sp.sqrt(2))) / 2, otypes=[object])(a)


def gelu_grad(a):
    """GELU′(x) = (1 + erf(x / √2)) / 2 + x exp(−x² / 2) / √(2π), entrywise."""

    def entry(x):
        return (1 + sp.erf(x / sp.sqrt(2))) / 2 + x * sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi)

    return np.vectorize(entry, otypes=[object])(a)


def gelu_tanh(a):
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""

    def entry(x):
        return x * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Float("0.044715") * x**3))) / 2

    return np.vectorize(entry, otypes=[object])(a)


def gelu_tanh_grad(a):
    """The derivative of gelu_tanh: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2, t = tanh(k (x + c x³))."""

    def entry(x):
        k, c = sp.sqrt(2 / sp.pi), sp.Float("0.044715")
        t = sp.tanh(k * (x + c * x**3))
        return (1 + t) / 2 + x * (1 - t**2) * k * (1 + 3 * c * x**2) / 2

    return np.vectorize(entry, otypes=[object])(a)


def layer_norm(a, eps):
    """Each row standardised: (a − mean) / √(biased variance + eps), exactly."""
    c = a - a.sum(axis=-1, keepdims=True) / a.shape[-1]
    root = np.vectorize(lambda v: sp.sqrt(v + eps), otypes=[object])
    return c / root((c * c).sum(axis=-1, keepdims=True) / a.shape[-1])


def row_inv_std(a, eps):
    """1 / √(biased variance + eps) of each row, as a column, exactly."""
    c = a - a.sum(axis=-1, keepdims=True) / a.shape[-1]
    root = np.vectorize(lambda v: 1 / sp.sqrt(v + eps), otypes=[object])
    return root((c * c).sum(axis=-1, keepdims=True) / a.shape[-1])
