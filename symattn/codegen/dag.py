"""Named values: assignments, a hash-consing table of names, and the product helpers they share.

``Names`` maps subexpressions (as derived) to the symbols that name them; a lookup
replaces every named subexpression, matching products as contiguous runs of
factors (so Q Kᵀ is found inside scale·X W_Q W_Kᵀ Xᵀ) and transposed uses as
transposes of names (dAᵀ).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import MatMul, OneMatrix, Transpose

# Typical sizes of the dimensions, for choosing between equal forms (cost) and where a scalar goes.
TYPICAL_SIZES = {"n": 1024, "m": 1024, "H": 8, "b": 128}
TYPICAL_OTHER = 64


@dataclass(frozen=True)
class Assignment:
    """target = value; a weight's gradient is summed over leading batch dimensions."""

    target: MatrixSymbol
    value: Basic
    reduce_batch: bool = False
    comment: str = ""


def factors(expr: Basic) -> tuple[Basic, list[Basic]]:
    """(c, [F₁, …, F_k]) for a product c · F₁ ⋯ F_k."""
    scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
    return sp.Mul(*scalars), [a for a in expr.args if isinstance(a, MatrixExpr)]


def product(coeff: Basic, terms: list[Basic]) -> Basic:
    """coeff · F₁ ⋯ F_k as one flat MatMul (a single factor stays itself)."""
    flat: list[Basic] = []
    for f in terms:
        if isinstance(f, MatMul):
            c, inner = factors(f)
            coeff, flat = coeff * c, [*flat, *inner]
        else:
            flat.append(f)
    if coeff == 1 and len(flat) == 1:
        return flat[0]
    return MatMul(*([coeff] if coeff != 1 else []), *flat)


class Names:
    """A table from subexpressions (as derived) to the symbols that name them."""

    def __init__(self) -> None:
        self.table: dict[Basic, Basic] = {}

    def add(self, expr: Basic, symbol: MatrixSymbol) -> None:
        self.table[expr] = symbol
        self.table.setdefault(expr.T, symbol.T)

    def substitute(self, expr: Basic, skip: Basic | None = None) -> Basic:
        """expr with every named subexpression (but skip) replaced by its name."""
        if expr in self.table and expr != skip:
            return self.table[expr]
        if not expr.args or isinstance(expr, MatrixSymbol):
            return expr
        if isinstance(expr, MatMul):
            return self._substitute_product(expr, skip)
        return expr.func(*(self.substitute(a, skip) for a in expr.args))

    def _substitute_product(self, expr: MatMul, skip: Basic | None) -> Basic:
        coeff, mats = factors(expr)
        runs = sorted(
            ((k, v) for k, v in self.table.items() if isinstance(k, MatMul) and k != skip),
            key=lambda kv: -len(kv[0].args),
        )
        out: list[Basic] = []
        i = 0
        while i < len(mats):
            for key, name in runs:
                c, run = factors(key)
                if len(run) > 1 and tuple(mats[i : i + len(run)]) == tuple(run):
                    coeff = coeff / c
                    out.append(name)
                    i += len(run)
                    break
            else:
                out.append(self.substitute(mats[i], skip))
                i += 1
        return product(coeff, out)


def expand(expr: Basic, definitions: dict[Basic, Basic]) -> Basic:
    """expr with each symbol in definitions replaced by its definition, products flattened."""
    if expr in definitions:
        return definitions[expr]
    if not expr.args or isinstance(expr, MatrixSymbol):
        return expr
    args = [expand(a, definitions) for a in expr.args]
    if isinstance(expr, MatMul):
        coeff, mats = factors(MatMul(*args))
        return product(coeff, mats)
    return expr.func(*args)


def typical_size(size: Basic) -> int:
    """A dimension at typical sizes: sequence lengths n, m long, heads few, features short."""
    size = sp.sympify(size)
    return int(size.xreplace({s: TYPICAL_SIZES.get(s.name, TYPICAL_OTHER) for s in size.free_symbols}))


def is_trivial(expr: Basic) -> bool:
    """A name, a transposed name, ones, or a scalar: nothing worth naming or sharing."""
    if isinstance(expr, Transpose):
        expr = expr.arg
    return isinstance(expr, (MatrixSymbol, OneMatrix)) or not isinstance(expr, MatrixExpr)


def count_uses(values: Iterable[Basic]) -> Counter:
    """How often each subexpression occurs across the values (every occurrence counted)."""
    counts: Counter = Counter()
    for v in values:
        for node in sp.preorder_traversal(v):
            counts[node] += 1
    return counts


WEIGHT_PREFIXES = ("W_", "b_", "gamma_", "beta_")


def is_weight(symbol: MatrixSymbol) -> bool:
    """Parameters are the inputs named W_…, b_…, gamma_…, beta_… (CONTRACT.md); they carry no batch dimensions."""
    return isinstance(symbol, MatrixSymbol) and str(symbol.name).startswith(WEIGHT_PREFIXES)
