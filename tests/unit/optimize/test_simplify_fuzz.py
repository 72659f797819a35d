"""Random rectangular expressions: simplifying (alone, jointly, with a given) keeps every value and never adds FLOPs."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul, OneMatrix, Transpose

import symattn as sa
from symattn.lang.ops import RowSoftmax, RowSum
from symattn.optimize.cost import flops_value
from symattn.optimize.simplify import simplify, simplify_all

n, m, k = (sp.Symbol(s, positive=True, integer=True) for s in "nmk")
DIMS = (n, m, k)
SIZES = {n: 3, m: 4, k: 2}
SYMBOLS = {(r, c): [MatrixSymbol(f"X_{r}{c}_{i}", r, c) for i in range(2)] for r in DIMS for c in DIMS}


def leaf(rng: np.random.Generator, rows, cols):
    if rng.random() < 0.3:
        return Transpose(SYMBOLS[(cols, rows)][rng.integers(2)])
    return SYMBOLS[(rows, cols)][rng.integers(2)]


def random_expression(rng: np.random.Generator, rows, cols, depth: int):
    """An expression of shape rows × cols over the symbols, built from every kind of node the rules touch."""
    if depth == 0 or rng.random() < 0.15:
        return leaf(rng, rows, cols)

    def sub(r=rows, c=cols):
        return random_expression(rng, r, c, depth - 1)

    inner = DIMS[rng.integers(3)]
    return [
        lambda: MatMul(sub(rows, inner), sub(inner, cols)),
        lambda: MatAdd(sub(), sub()),
        lambda: HadamardProduct(sub(), sub()),
        lambda: Transpose(sub(cols, rows)),
        lambda: MatMul(sp.Rational(int(rng.integers(1, 5)), 3), sub()),
        lambda: MatMul(RowSum(sub(rows, inner)), OneMatrix(1, cols)),  # a broadcast row sum
        lambda: HadamardProduct(RowSoftmax(MatMul(sp.Rational(1, 4), sub())), sub()),
        lambda: MatMul(sub(rows, inner), OneMatrix(inner, cols)),  # a product with ones
        lambda: MatAdd(sub(), MatMul(-1, sub())),
    ][rng.integers(9)]()


def value(expr, symbols, arrays) -> np.ndarray:
    shape = tuple(int(d.xreplace(SIZES)) for d in expr.shape)
    dims = {s.name: v for s, v in SIZES.items()}
    return np.broadcast_to(sa.lambdify(symbols, expr, dims=dims)(*arrays), shape)


@pytest.mark.parametrize("seed", range(30))
def test_random_rectangular_expressions(seed):
    rng = np.random.default_rng(seed)
    rows, cols = DIMS[rng.integers(3)], DIMS[rng.integers(3)]
    exprs = [random_expression(rng, rows, cols, 4) for _ in range(2)]
    jointly = simplify_all(exprs)
    with_given = simplify(exprs[0], given=[exprs[1]])
    symbols = sorted(set().union(*(e.atoms(MatrixSymbol) for e in exprs)), key=lambda s: s.name)
    arrays = [0.5 * rng.standard_normal(tuple(int(d.xreplace(SIZES)) for d in s.shape)) for s in symbols]
    for before, after in [(exprs[0], jointly[0]), (exprs[1], jointly[1]), (exprs[0], with_given)]:
        np.testing.assert_allclose(value(after, symbols, arrays), value(before, symbols, arrays), rtol=1e-9, atol=1e-9)
    assert flops_value(jointly) <= flops_value(exprs)
