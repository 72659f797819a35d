"""Short names for long subexpressions: the spec's intermediates (S, A, P, O, …) put back in.

``Abbreviations`` rewrites an expression bottom-up, replacing every occurrence of an
intermediate's definition (or of its transpose) by the intermediate's symbol, so
``1/√d_k · X W_Q W_Kᵀ Xᵀ`` reads ``A``. Products are flattened by SymPy, so a
definition that is itself a product is also found as a run of consecutive factors
(``G W_Vᵀ Xᵀ`` → ``G Vᵀ``). Display only: the verifier never sees abbreviations.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import MatMul

from symattn.lang.safe import expression


def _split(expr: Basic) -> tuple[Basic, list[Basic]]:
    """(scalar coefficient, matrix factors) of a product; (1, [expr]) for anything else."""
    if isinstance(expr, MatMul):
        scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
        return sp.Mul(*scalars), [a for a in expr.args if isinstance(a, MatrixExpr)]
    return sp.Integer(1), [expr]


def _join(coeff: Basic, mats: list[Basic]) -> Basic:
    if coeff == 1 and len(mats) == 1:
        return mats[0]
    return MatMul(*([coeff] if coeff != 1 else []), *mats)


class Abbreviations:
    """Replace the named intermediates of a spec (in forward order) by their symbols."""

    def __init__(self, named: Sequence[tuple[str, MatrixExpr]]) -> None:
        # (replacement, coefficient, factors): each definition and its transpose
        self.patterns: list[tuple[Basic, Basic, list[Basic]]] = []
        self.symbols: dict[str, MatrixSymbol] = {}
        self.definitions: list[tuple[MatrixSymbol, Basic]] = []  # name = definition, in forward order
        for name, expr in named:
            short = self(expr)
            symbol = MatrixSymbol(name, *expr.shape)
            self.symbols[name] = symbol
            self.definitions.append((symbol, short))
            coeff, mats = _split(short)
            self.patterns.append((symbol, coeff, mats))
            self.patterns.append((symbol.T, coeff, _transposed(mats)))

    def __call__(self, expr: Basic) -> Basic:
        memo: dict[Basic, Basic] = {}

        def walk(e: Basic) -> Basic:
            if e in memo:
                return memo[e]
            if isinstance(e, MatrixSymbol) or not e.args:
                out = e
            else:
                args = [walk(a) for a in e.args]
                out = e.func(*args) if args != list(e.args) else e
                out = self._match(out)
            memo[e] = out
            return out

        return walk(expression(expr))

    def _match(self, e: Basic) -> Basic:
        """e with every run of factors that spells a definition replaced by its name."""
        if not isinstance(e, MatrixExpr):
            return e
        coeff, mats = _split(e)
        changed = True
        while changed:
            changed = False
            for replacement, p_coeff, p_mats in self.patterns:
                found = _find(mats, p_mats)
                if found is None:
                    continue
                rest = coeff / p_coeff
                if p_coeff != 1 and not rest.is_number:
                    continue
                mats = mats[:found] + [replacement] + mats[found + len(p_mats) :]
                coeff, changed = rest, True
                break
        return _join(coeff, mats)


def _transposed(mats: list[Basic]) -> list[Basic]:
    return [m.T for m in reversed(mats)]


def _find(mats: list[Basic], target: list[Basic]) -> int | None:
    """Index where target occurs as consecutive factors of mats."""
    k = len(target)
    first = target[0]
    for i in range(len(mats) - k + 1):
        if mats[i] == first and mats[i : i + k] == target:
            return i
    return None
