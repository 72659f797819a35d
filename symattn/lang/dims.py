"""Dimensions: positive integer symbols, and equality of symbolic sizes."""

from __future__ import annotations

import sympy as sp


def dim(name: str) -> sp.Symbol:
    """A dimension: a positive integer symbol."""
    return sp.Symbol(name, positive=True, integer=True)


def same_dim(a, b) -> bool:
    """True when two (possibly symbolic) dimensions are provably equal."""
    if a == b:
        return True
    return sp.simplify(sp.sympify(a) - sp.sympify(b)) == 0
