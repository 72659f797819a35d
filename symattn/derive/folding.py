"""Scalar factors folded into one coefficient per product: the exact rewrites behind textbook algebra.

A backward pass multiplies cotangents by constants at every scaled node, so the raw
cotangents carry ``(1/(50√d)) Xᵀ ((50 Ā) ⊙ M) K``. ``fold_scalars`` pulls every
scalar multiple out of the nodes it passes through and multiplies the scalars into
the coefficient of the nearest product, giving ``(1/√d) Xᵀ (Ā ⊙ M) K``. Each rule is
an identity of linear algebra (``RULES``, one per node type); the derivation prints
the folded expressions and ``--verify`` evaluates them, so a wrong rule shows as a
failed equality. Forward values (``keep``) are left as they are: they are printed
by name and must stay equal to their definitions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatMul, Transpose

from symattn.lang.algebra import factors, product
from symattn.lang.graph import children, intern, rebuilt
from symattn.lang.ops import RowSum, SumEntries

ONE = sp.Integer(1)


def scaled(expr: Basic, keep: Collection[Basic] = ()) -> tuple[Basic, Basic]:
    """(c, M) with expr = c M and M carrying no coefficient of its own (a kept value is not split)."""
    if expr in keep:
        return ONE, expr
    coeff, mats = factors(expr)
    if coeff == 1:
        return ONE, expr
    return coeff, mats[0] if len(mats) == 1 else MatMul(*mats)


def fold_product(node: MatMul, keep: Collection[Basic] = ()) -> Basic:
    """c₁ A (c₂ B C) D = (c₁ c₂) A B C D: nested products spliced, their scalars multiplied."""
    coeff, mats = factors(node)
    flat: list[Basic] = []
    for m in mats:
        c, inner = factors(m) if isinstance(m, MatMul) and m not in keep else (ONE, [m])
        coeff, flat = coeff * c, [*flat, *inner]
    return product(coeff, *flat, canonical=False)


def fold_transpose(node: Transpose, keep: Collection[Basic] = ()) -> Basic | None:
    """(c A)ᵀ = c Aᵀ."""
    c, m = scaled(node.arg, keep)
    return None if c == 1 else product(c, Transpose(m), canonical=False)


def fold_hadamard(node: HadamardProduct, keep: Collection[Basic] = ()) -> Basic | None:
    """(c₁ A) ⊙ (c₂ B) = (c₁ c₂) (A ⊙ B)."""
    parts = [scaled(a, keep) for a in node.args]
    coeff = sp.Mul(*(c for c, _ in parts))
    return None if coeff == 1 else product(coeff, intern(HadamardProduct(*(m for _, m in parts))), canonical=False)


def fold_power(node: HadamardPower, keep: Collection[Basic] = ()) -> Basic | None:
    """(c A)^∘p = c^p A^∘p."""
    base, p = node.args
    c, m = scaled(base, keep)
    return None if c == 1 else product(c**p, intern(HadamardPower(m, p)), canonical=False)


def fold_linear(node: Basic, keep: Collection[Basic] = ()) -> Basic | None:
    """L(c A) = c L(A) for a linear node of one argument (row sums, the sum of entries)."""
    c, m = scaled(node.args[0], keep)
    return None if c == 1 else product(c, intern(type(node)(m)), canonical=False)


# node type → rule(node, keep); the folded node, or None when there is nothing to fold
RULES: dict[type, Callable[..., Basic | None]] = {
    MatMul: fold_product,
    Transpose: fold_transpose,
    HadamardProduct: fold_hadamard,
    HadamardPower: fold_power,
    RowSum: fold_linear,
    SumEntries: fold_linear,
}


def fold_scalars(expr: Basic, keep: Collection[Basic] = ()) -> Basic:
    """expr with its scalar factors folded bottom-up (``RULES``); the nodes in keep are not entered.

    Each distinct subexpression is folded once, on an explicit stack (no recursion limit).
    """
    out: dict[Basic, Basic] = {}
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if node in out:
            continue
        if not expanded:
            if node in keep or isinstance(node, MatrixSymbol) or not node.args or not isinstance(node, MatrixExpr):
                out[node] = node
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in children(node) if a not in out)
            continue
        args = [out[a] for a in children(node)]
        new = rebuilt(node, args)
        rule = RULES.get(type(new))
        folded = rule(new, keep) if rule is not None else None
        out[node] = new if folded is None else folded
    return out[expr]


__all__ = ["RULES", "fold_scalars", "scaled"]
