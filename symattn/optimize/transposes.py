"""Transposes pushed through products, sums and Hadamard products, and counted.

The simplifier prefers the orientation of an expression with fewer transposes;
``transposed`` builds eᵀ in normal form and the counts compare the two without
building both.
"""

from __future__ import annotations

from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, Identity, MatAdd, MatMul, OneMatrix, Transpose, ZeroMatrix

from symattn.lang.algebra import factors, product
from symattn.lang.graph import bottom_up, intern, memo_table

CONSTANTS = (OneMatrix, ZeroMatrix, Identity)


def transposed(e: Basic) -> Basic:
    """eᵀ with the transpose pushed through products, sums, Hadamard products and constants (once per node).

    Leaves first on an explicit stack (a deep DAG is no deeper for Python), each node's transpose kept.
    """
    return bottom_up(e, _TRANSPOSED, _pushed_through, _transposed_node)


def _pushed_through(e: Basic) -> tuple[Basic, ...]:
    """The parts of e that eᵀ transposes in turn."""
    if isinstance(e, MatMul):
        return tuple(factors(e)[1])
    if isinstance(e, (MatAdd, HadamardProduct)):
        return e.args
    return ()


def _transposed_node(e: Basic, t: dict[Basic, Basic]) -> Basic:
    """eᵀ from the transposes t of its parts (see _pushed_through)."""
    if isinstance(e, Transpose):
        return e.arg
    if isinstance(e, CONSTANTS):
        return type(e)(e.shape[1], e.shape[0]) if not isinstance(e, Identity) else e
    if isinstance(e, MatMul):
        coeff, mats = factors(e)
        return product(coeff, *(t[f] for f in reversed(mats)), canonical=False, drop_units=True)
    if isinstance(e, MatAdd):
        return intern(MatAdd(*(t[x] for x in e.args)))
    if isinstance(e, HadamardProduct):
        return intern(HadamardProduct(*(t[f] for f in e.args)))
    return intern(Transpose(e))


def count_transposes(e: Basic) -> int:
    """Number of Transpose nodes in e's tree (a subexpression used twice counts twice)."""
    if not isinstance(e, MatrixExpr) or isinstance(e, MatrixSymbol):
        return 0
    return bottom_up(e, _TRANSPOSE_COUNTS, _matrix_args, _transpose_count)


def _matrix_args(e: Basic) -> tuple[Basic, ...]:
    return tuple(a for a in e.args if isinstance(a, MatrixExpr) and not isinstance(a, MatrixSymbol))


def _transpose_count(e: Basic, counts: dict[Basic, int]) -> int:
    inner = sum(counts[a] for a in _matrix_args(e))
    return inner + 1 if isinstance(e, Transpose) else inner


def count_transposes_of_transposed(e: Basic) -> int:
    """count_transposes(transposed(e)), without building transposed(e)."""
    return bottom_up(e, _TRANSPOSED_COUNTS, _counted_through, _transposed_count)


def _counted_through(e: Basic) -> tuple[Basic, ...]:
    if isinstance(e, (MatMul, MatAdd, HadamardProduct)) and not isinstance(e, CONSTANTS):
        return tuple(a for a in e.args if isinstance(a, MatrixExpr))
    return ()


def _transposed_count(e: Basic, counts: dict[Basic, int]) -> int:
    if isinstance(e, Transpose):
        return count_transposes(e.arg)
    if isinstance(e, CONSTANTS):
        return 0
    if isinstance(e, (MatMul, MatAdd, HadamardProduct)):
        return sum(counts[a] for a in e.args if isinstance(a, MatrixExpr))
    return 1 + count_transposes(e)


_TRANSPOSED: dict[Basic, Basic] = memo_table({})
_TRANSPOSE_COUNTS: dict[Basic, int] = memo_table({})  # trees share subtrees: count each distinct one once
_TRANSPOSED_COUNTS: dict[Basic, int] = memo_table({})


def is_column(e: Basic) -> bool:
    return e.shape[1] == 1
