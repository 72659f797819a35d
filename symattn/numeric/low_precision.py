"""The precision of a float16 run of a generated NumPy module, as the torch and JAX modules keep a 16-bit one: the
n × m arrays (scores, P, dS) and the row statistics (max, log-sum-exp, D = rowsum(dO ⊙ O)) in float32, each product
accumulated in float32 by BLAS (of the factors widened: exact), an n × m factor never rounded (the product is, once),
sums over blocks of rows and over the batch in float32, and the public functions' results rounded to float16 once
(``_in_run_dtype``). Every helper leaves a float32 or float64 run exactly as plain NumPy computes it.

Real code, linted and tested; ``GeneratedNumPyPrinter`` copies the source of the ones a module calls (read with
``ast``) into it, so a generated NumPy module imports only numpy.
"""

from __future__ import annotations

import numpy as np


def _half(a):
    """Is a a 16-bit floating array (float16: a run the precision helpers compute in float32)?"""
    dtype = np.asarray(a).dtype
    return dtype.kind == "f" and dtype.itemsize == 2


def wide_matmul(a, b):
    """a @ b, a product much larger than its factors (the scores Q Kᵀ, dP = dO Vᵀ: n × m from n × d and d × m).
    Of 16-bit factors (float16) the product is float32, of the factors widened (the same values: 16-bit products
    are exact in float32; BLAS sums in float32, where NumPy's own float16 loop is some sixty times slower): the
    n × m arrays and what is made of them (P, L, dS) stay float32, as SDPA keeps them; the products that read them
    round once (``narrow_matmul``). Factors of a wider dtype (float32, float64 runs): a @ b."""
    if _half(a) or _half(b):
        return np.matmul(a.astype(np.float32), b.astype(np.float32))
    return a @ b


def narrow_matmul(a, b):
    """a @ b, where a factor may be a float32 n × m array of a float16 run (P, dS of ``wide_matmul``): both
    factors float32 (the float32 array never rounded, the 16-bit one widened exactly), the product accumulated in
    float32 and rounded to the 16-bit dtype once. Factors of one wider dtype (float32, float64 runs): a @ b."""
    low = next((x.dtype for x in (a, b) if _half(x)), None)
    if low is None:
        return a @ b
    return np.matmul(a.astype(np.float32, copy=False), b.astype(np.float32, copy=False)).astype(low)


def row_dot(a, b):
    """rowsum(a ⊙ b) as a column (..., n, 1), such as D = rowsum(dO ⊙ O), by np.vecdot (no a ⊙ b temporary): in
    float32 for 16-bit a or b (a statistic, kept as SDPA keeps it), else in their dtype."""
    if _half(a) or _half(b):
        a, b = a.astype(np.float32, copy=False), b.astype(np.float32, copy=False)
    return np.vecdot(a, b)[..., None]


def matmul_tn(a, b):
    """aᵀ b of an n × m a (dSᵀ Q, Pᵀ dO: the part of dK, dV that a block of rows adds, add_rows). Of a float16 run,
    the product of float32 factors, left float32 (as torch's matmul_tn keeps its float32_value): add_rows sums the
    parts in float32, and the public function rounds the sum once (``_in_run_dtype``). Else a.mT @ b."""
    if _half(a) or _half(b):
        return np.matmul(a.astype(np.float32, copy=False).mT, b.astype(np.float32, copy=False))
    return a.mT @ b


def add_blocks(total, part):
    """total + part, a sum over the blocks of rows (a weight's gradient, dW_Q += rows(Q_b)ᵀ rows(dQ_b)); total is 0
    before the first block. 16-bit parts are summed in float32 (an accumulation): the sum is float32, rounded once
    by the public function (``_in_run_dtype``). Wider parts: total += part, as before."""
    if _half(part):
        part = part.astype(np.float32)
    if isinstance(total, int):
        return total + part
    total += part
    return total


def _in_run_dtype(function):
    """function (backward, hvp, jvp) with its results in the dtype of its first array argument (the cotangent, the
    first input): a float16 run's float32 values (a product left wide, a sum over blocks of rows, dS summed to the
    mask's shape) rounded once to float16. A float32 or float64 run's results as they are."""

    def in_run_dtype(*args, **kwargs):
        results = function(*args, **kwargs)
        dtype = next((a.dtype for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)), None)
        return results if dtype is None or dtype.kind != "f" or dtype.itemsize != 2 else _narrowed(results, dtype)

    in_run_dtype.__name__, in_run_dtype.__qualname__ = function.__name__, function.__qualname__
    in_run_dtype.__doc__, in_run_dtype.__wrapped__ = function.__doc__, function
    return in_run_dtype


def _narrowed(value, dtype):
    """value (an array, or a dict or tuple of them and None) with each floating array of another dtype in dtype."""
    if isinstance(value, dict):
        return {name: _narrowed(v, dtype) for name, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_narrowed(v, dtype) for v in value)
    if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.dtype != dtype:
        return value.astype(dtype)
    return value


def column_sums(a):
    """𝟏ᵀ a: the sums of a's columns, as a row (``wide_sum``)."""
    return wide_sum(a, 0, keepdims=True)


def wide_sum(a, axis, keepdims=False):
    """a summed along axis; of a 16-bit a, accumulated in float32 and rounded once (NumPy sums a float16 array along
    an axis other than the last in float16, rounding at every addition)."""
    if _half(a):
        return a.sum(axis=axis, keepdims=keepdims, dtype=np.float32).astype(a.dtype)
    return a.sum(axis=axis, keepdims=keepdims)
