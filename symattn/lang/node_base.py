"""What every node of symattn's language shares: the argument check and the shape of an argument."""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr

from symattn.errors import NotAMatrixError

# id(expression) → (expression, its shape), computed leaves first (SymPy recomputes it recursively). Keyed by
# identity, the expression kept alive with its entry: a lookup never compares two expressions, which SymPy
# does down the whole tree when they are equal but distinct objects (as a spec file's subtrees often are)
_SHAPES: dict[int, tuple[Basic, tuple]] = {}
_SHAPES_MAX = 1 << 19


def shape_of(expr: Basic) -> tuple:
    """expr.shape, each subexpression's shape computed once, leaves first, without deep recursion.

    SymPy's MatMul.shape asks its first factor, whose shape asks its own, … so the shape of a
    200-deep chain recursed 200 levels; symattn's nodes read their argument's shape here.
    """
    found = _SHAPES.get(id(expr))
    if found is not None and found[0] is expr:
        return found[1]
    if len(_SHAPES) > _SHAPES_MAX:
        _SHAPES.clear()
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if _known(node):
            continue
        if expanded or isinstance(node, sp.MatrixSymbol) or not node.args:
            if isinstance(node, MatrixExpr):
                _SHAPES[id(node)] = (node, node.shape)
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in node.args if isinstance(a, MatrixExpr) and not _known(a))
    return _SHAPES[id(expr)][1]


def _known(expr: Basic) -> bool:
    found = _SHAPES.get(id(expr))
    return found is not None and found[0] is expr


def require_matrix(arg: Basic, what: str) -> None:
    """Refuse a scalar where a node takes a matrix expression."""
    if not isinstance(arg, MatrixExpr):
        raise NotAMatrixError(f"{what} takes a matrix expression, got {type(arg).__name__} {arg}")
