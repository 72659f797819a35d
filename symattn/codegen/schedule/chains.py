"""Products of several matrices: their cost in a given order, whether an order is left to right, and blocks of ones
split into a column and a row.

The schedule's reassociation compares a chain's cheapest order (``chain_order``) with left to right by these
costs, at typical sizes.
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import MatMul, OneMatrix

from symattn.codegen.schedule.dag import typical_size as schedule_size
from symattn.optimize.cost import pair_flops


def tree_flops(tree: Basic) -> int:
    """FLOPs of a binary tree of products at typical sizes."""
    if not (isinstance(tree, MatMul) and len(tree.args) == 2 and all(isinstance(a, MatrixExpr) for a in tree.args)):
        return 0  # a leaf (c F counts as a leaf: its scalar multiple is not a product)
    left, right = tree.args
    return tree_flops(left) + tree_flops(right) + schedule_size(pair_flops(left, right, sp.sympify))


def left_to_right_flops(mats: list[Basic]) -> int:
    """FLOPs of ((F₁ F₂) F₃) … at typical sizes."""
    tree = MatMul(*mats[:2])
    for m in mats[2:]:
        tree = MatMul(tree, m)
    return tree_flops(tree)


def left_to_right(tree: Basic) -> bool:
    """Is a binary product tree ((F₁ F₂) F₃) …: every right operand a factor, not a product?"""
    while isinstance(tree, MatMul) and len(tree.args) == 2:
        if isinstance(tree.args[1], MatMul) and len(tree.args[1].args) == 2:
            return False
        tree = tree.args[0]
    return True


def split_ones(m: Basic) -> list[Basic]:
    """𝟏 (k × c) as 𝟏_k 𝟏_cᵀ when neither is 1; any other factor as itself."""
    if isinstance(m, OneMatrix) and m.shape[0] != 1 and m.shape[1] != 1:
        return [OneMatrix(m.shape[0], 1), OneMatrix(1, m.shape[1])]
    return [m]
