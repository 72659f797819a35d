"""Shape checking with symbolic dimensions (SymPy barely checks them itself).

``check_shapes`` walks an expression once and raises ShapeMismatchError naming both
shapes at the first operation whose operands do not fit.
"""

from __future__ import annotations

import itertools

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul, MatPow, Trace

from symattn.errors import ShapeMismatchError
from symattn.lang.dims import same_dim
from symattn.lang.ops import SplitHeads


def _check_matmul(node: MatMul) -> None:
    mats = [a for a in node.args if isinstance(a, MatrixExpr)]
    for left, right in itertools.pairwise(mats):
        if not same_dim(left.shape[1], right.shape[0]):
            raise ShapeMismatchError("matrix product", left.shape, right.shape, node)


def _check_elementwise_operands(node: Basic, operation: str) -> None:
    mats = [a for a in node.args if isinstance(a, MatrixExpr)]
    for other in mats[1:]:
        if not all(same_dim(x, y) for x, y in zip(mats[0].shape, other.shape)):
            raise ShapeMismatchError(operation, mats[0].shape, other.shape, node)


def _check_square(node: Basic, operation: str) -> None:
    arg = node.args[0]
    if not same_dim(arg.shape[0], arg.shape[1]):
        raise ShapeMismatchError(operation + " (needs a square matrix)", arg.shape, arg.shape[::-1], node)


def _check_power(node: MatPow) -> None:
    """A*A…, which SymPy folds into A**k without checking: the product's shapes must fit."""
    base = node.args[0]
    if not same_dim(base.shape[0], base.shape[1]):
        raise ShapeMismatchError(f"matrix product {base}*{base} (SymPy's {node})", base.shape, base.shape, None)


def _check_heads(node: Basic) -> None:
    arg, heads = node.args
    cols = arg.shape[1]
    if heads.is_Integer and cols.is_Integer and cols % heads:
        raise ShapeMismatchError(f"split into {heads} heads", arg.shape, (arg.shape[0], f"{cols}/{heads}"), node)


SHAPE_RULES = {
    MatMul: _check_matmul,  # adjacent factors: columns of the left = rows of the right
    MatAdd: lambda node: _check_elementwise_operands(node, "matrix sum"),
    HadamardProduct: lambda node: _check_elementwise_operands(node, "hadamard product"),
    MatPow: lambda node: _check_power(node),
    Trace: lambda node: _check_square(node, "trace"),
    SplitHeads: _check_heads,  # H must divide the number of columns
}


def dimension_symbols(*exprs: Basic) -> list[sp.Symbol]:
    """Every symbol in a shape (or standing as a scalar) in the expressions, by name.

    Walks each distinct subexpression once, so shared (DAG) expressions stay cheap.
    """
    found: set[sp.Symbol] = set()
    seen: set[Basic] = set()
    stack = [sp.sympify(e) for e in exprs]
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, Basic):
            continue
        seen.add(node)
        if isinstance(node, MatrixExpr):
            for d in node.shape:
                found |= sp.sympify(d).free_symbols
        elif isinstance(node, sp.Symbol):
            found.add(node)
        elif isinstance(node, sp.Lambda):  # a matrix of positions' formula: its dimensions, not its i and j
            found |= {s for s in node.free_symbols if isinstance(s, sp.Symbol)}
            stack.extend(node.atoms(sp.MatrixSymbol))  # the tables it reads: their sizes
            continue
        stack.extend(node.args)
    return sorted(found, key=lambda s: s.name)


def check_shapes(expr: Basic) -> None:
    """Raise ShapeMismatchError at the first ill-shaped operation in expr."""
    seen: set[Basic] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, Basic):
            continue
        seen.add(node)
        rule = SHAPE_RULES.get(type(node))
        if rule is not None:
            rule(node)
        stack.extend(node.args)
