"""Shape consistency of a schedule, checked where the schedule is made: an inconsistent plan is symattn's error.

The schedule's passes rebuild products without SymPy's validation (``MatMul(..., canonical=False)`` and
``xreplace`` keep a product's factors as they are given), so a pass that got a factor's shape wrong would make
a product F₁ ⋯ F_k whose shape SymPy reads off its first and last factors only, and a generated module that
fails at run time (``matmul: … mismatch in its core dimension``). Every product of every assignment is checked:
each factor's columns are the next one's rows. The check costs one walk of each value's nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import MatMul

from symattn.codegen.schedule.dag import Assignment
from symattn.errors import SymattnError
from symattn.lang import graph


def _differ(a: Basic, b: Basic) -> bool:
    """Are the dimensions a and b different for every value of the symbols they hold (n and d, 1 and n)?"""
    return a != b and sp.expand(a - b) != 0


def mismatched_product(value: Basic) -> tuple[Basic, Basic, Basic] | None:
    """(the product, its left factor, its right factor) of the first product in value whose left factor's columns
    are not its right factor's rows; None when every product is consistent."""
    for node in graph.nodes(value):
        if not isinstance(node, MatMul):
            continue
        mats = [a for a in node.args if isinstance(a, MatrixExpr)]
        for left, right in pairwise(mats):
            if _differ(left.shape[1], right.shape[0]):
                return node, left, right
    return None


def check_products(assignments: Iterable[Assignment], where: str) -> None:
    """Raise SymattnError naming the first assignment (of the schedule's part where: forward, backward) that holds
    a product of factors whose inner dimensions differ: an inconsistent schedule is never printed as a module."""
    for a in assignments:
        found = mismatched_product(a.value)
        if found is not None:
            node, left, right = found
            raise SymattnError(
                f"inconsistent schedule: the {where} assignment {a.target.name} = {sp.sstr(a.value)} multiplies "
                f"{sp.sstr(left)} ({left.shape[0]} × {left.shape[1]}) by {sp.sstr(right)} "
                f"({right.shape[0]} × {right.shape[1]}) in {sp.sstr(node)}"
            )
