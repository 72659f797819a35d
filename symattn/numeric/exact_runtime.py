"""Runtime helpers of code printed by ``ExactPrinter``: entrywise functions on object arrays of SymPy numbers.

Real code, linted and tested; the printer copies the source of the ones an expression calls
(read with ``ast``) into the code it prints, which runs with ``np``, ``sp`` and ``ExpAtom``.
"""

from __future__ import annotations

import numpy as np
import sympy as sp
from sympy import Basic


class ExpAtom(sp.Function):
    """exp(x) kept opaque: no automatic exp(a)·exp(b) = exp(a + b), d/dx ExpAtom(x) = ExpAtom(x)."""

    def fdiff(self, argindex: int = 1) -> Basic:
        return self

    def _eval_evalf(self, prec: int) -> Basic:
        return sp.exp(self.args[0])._eval_evalf(prec)


def exp(a):
    """exp(x), entrywise, as an opaque atom."""
    return np.vectorize(ExpAtom, otypes=[object])(a)


def row_softmax(a):
    """exp(A) with each row divided by its sum (no max subtracted: exact numbers do not overflow)."""
    e = exp(a)
    return e / e.sum(axis=-1, keepdims=True)


def entrywise(a, name, *parameters):
    """f(x) entrywise for the function record called name, from its scalar f with the node's parameters (clamp's
    bounds) (exp as an opaque atom)."""
    from symattn.lang.functions import FUNCTIONS

    x = sp.Dummy("x")
    f = FUNCTIONS[name].scalar(x, *parameters).replace(sp.exp, ExpAtom)
    return np.vectorize(lambda v: f.xreplace({x: v}), otypes=[object])(a)


def kth_largest(a, k):
    """The k-th largest entry of each row, as a column (…, n, 1), exactly (the entries ordered by their values)."""
    order = np.vectorize(lambda v: float(sp.N(v, 30)), otypes=[float])(a).argsort(axis=-1, kind="stable")
    return np.take_along_axis(a, order[..., -k:][..., :1], axis=-1)


def log_softmax(a):
    """A − log(rowsum(exp(A))) 𝟏ᵀ, exactly (exp an opaque atom)."""
    return a - np.vectorize(sp.log, otypes=[object])(exp(a).sum(axis=-1, keepdims=True))


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


def table_scatter(w, index, rows, cols):
    """[Σ_{(i, j): index(i, j) = (k, l)} w_ij]_kl, rows × cols, exactly: each table entry collects w at the positions
    that read it (index of SymPy integers)."""
    sums = np.zeros((rows, cols), dtype=int).astype(object)
    for i in range(w.shape[-2]):
        for j in range(w.shape[-1]):
            r, c = index(sp.Integer(i), sp.Integer(j))
            sums[int(r), int(c)] += w[i, j]
    return sums


def indexed_entry(table, row, col, name, source):
    """table[row, col] at one position, the indices read from a constant (source): each an integer inside the table
    (name), else ValueError naming the constant and the value."""
    for index, size, what in ((row, table.shape[-2], "row"), (col, table.shape[-1], "column")):
        if not (sp.sympify(index).is_integer and 0 <= index <= size - 1):
            raise ValueError(
                f"{source} gives {name} the {what} index {index!r}: an index read from a "
                f"constant is an integer in [0, {size - 1}] ({name} has {size} {what}s)"
            )
    return table[int(row), int(col)]


def fixed_dropout_mask(a, p):
    """Dropout's mask exactly: NumPy evaluation's fixed draw for a's shape, its entries 0 or 1/(1 − p) as
    rationals (p read as its shortest decimal)."""
    keep = np.random.default_rng(list(np.shape(a))).random(np.shape(a)) >= p
    scale = 1 / (1 - sp.Rational(repr(float(p))))
    return np.where(keep, scale, sp.S.Zero).astype(object)
