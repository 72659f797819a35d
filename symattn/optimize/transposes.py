"""Transposes pushed through products, sums and Hadamard products, and counted.

The simplifier prefers the orientation of an expression with fewer transposes;
``transposed`` builds eᵀ in normal form and the counts compare the two without
building both.
"""

from __future__ import annotations

import functools

from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, Identity, MatAdd, MatMul, OneMatrix, Transpose, ZeroMatrix

from symattn.lang.algebra import factors, product
from symattn.lang.graph import intern

CONSTANTS = (OneMatrix, ZeroMatrix, Identity)


@functools.lru_cache(maxsize=1 << 16)
def transposed(e: Basic) -> Basic:
    """eᵀ with the transpose pushed through products, sums, Hadamard products and constants (once per node)."""
    if isinstance(e, Transpose):
        return e.arg
    if isinstance(e, CONSTANTS):
        return type(e)(e.shape[1], e.shape[0]) if not isinstance(e, Identity) else e
    if isinstance(e, MatMul):
        coeff, mats = factors(e)
        return product(coeff, *(transposed(f) for f in reversed(mats)), canonical=False, drop_units=True)
    if isinstance(e, MatAdd):
        return intern(MatAdd(*(transposed(t) for t in e.args)))
    if isinstance(e, HadamardProduct):
        return intern(HadamardProduct(*(transposed(f) for f in e.args)))
    return intern(Transpose(e))


def count_transposes(e: Basic) -> int:
    """Number of Transpose nodes in e's tree (a subexpression used twice counts twice)."""
    if not isinstance(e, MatrixExpr) or isinstance(e, MatrixSymbol):
        return 0
    if e not in _TRANSPOSE_COUNTS:
        if len(_TRANSPOSE_COUNTS) > 100_000:
            _TRANSPOSE_COUNTS.clear()
        inner = sum(count_transposes(a) for a in e.args)
        _TRANSPOSE_COUNTS[e] = inner + 1 if isinstance(e, Transpose) else inner
    return _TRANSPOSE_COUNTS[e]


def count_transposes_of_transposed(e: Basic) -> int:
    """count_transposes(transposed(e)), without building transposed(e)."""
    if e not in _TRANSPOSED_COUNTS:
        if len(_TRANSPOSED_COUNTS) > 100_000:
            _TRANSPOSED_COUNTS.clear()
        if isinstance(e, Transpose):
            count = count_transposes(e.arg)
        elif isinstance(e, CONSTANTS):
            count = 0
        elif isinstance(e, (MatMul, MatAdd, HadamardProduct)):
            count = sum(count_transposes_of_transposed(a) for a in e.args if isinstance(a, MatrixExpr))
        else:
            count = 1 + count_transposes(e)
        _TRANSPOSED_COUNTS[e] = count
    return _TRANSPOSED_COUNTS[e]


_TRANSPOSE_COUNTS: dict[Basic, int] = {}  # trees share subtrees: count each distinct one once
_TRANSPOSED_COUNTS: dict[Basic, int] = {}


def is_column(e: Basic) -> bool:
    return e.shape[1] == 1
