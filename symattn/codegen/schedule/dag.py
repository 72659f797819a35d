"""Named values of a schedule: assignments, and what a schedule asks of its values.

An ``Assignment`` is one named value; ``expand`` writes names out again, ``count_uses``
finds what is shared, ``is_trivial`` what is not worth naming, ``is_weight`` which
inputs are parameters, ``entrywise`` which values a block of rows and keys makes from
its own blocks. The table of names is ``symattn.lang.naming.names.Names``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import (
    HadamardPower,
    HadamardProduct,
    MatAdd,
    MatMul,
    OneMatrix,
    Transpose,
    ZeroMatrix,
)

from symattn.lang.algebra import factors, product
from symattn.lang.functions import Elementwise
from symattn.lang.graph import children, matrix_symbols, nodes, postorder, rebuilt
from symattn.lang.ops import SplitHeads
from symattn.lang.positions import Entries
from symattn.optimize.cost import typical_size  # noqa: F401  (the printers place scalars by it)


@dataclass(frozen=True)
class Assignment:
    """target = value; a weight's gradient is summed over leading batch dimensions."""

    target: MatrixSymbol
    value: Basic
    reduce_batch: bool = False


def expand(expr: Basic, definitions: dict[Basic, Basic]) -> Basic:
    """expr with each symbol in definitions replaced by its definition, products flattened.

    Each distinct subexpression is rebuilt once, leaves first (no recursion as deep as expr).
    """
    done: dict[Basic, Basic] = {}
    for e in postorder(expr):
        args = children(e)
        if e in definitions:
            done[e] = definitions[e]
        elif not args:
            done[e] = e
        else:
            parts = [done[a] for a in args]
            done[e] = product(*parts, canonical=False, flatten=True) if isinstance(e, MatMul) else rebuilt(e, parts)
    return done[expr]


def is_trivial(expr: Basic) -> bool:
    """A name, a transposed name, ones, zeros, a name broadcast (𝟏 γ, u 𝟏ᵀ: printed as the name, which
    broadcasts), or a scalar: nothing worth naming or sharing (a shared zero gradient would alias two inputs'
    gradients, and lose the batch shape that each one's zeros_like gives)."""
    if isinstance(expr, Transpose):
        expr = expr.arg
    if isinstance(expr, MatMul) and len(expr.args) == 2 and any(isinstance(a, OneMatrix) for a in expr.args):
        return all(is_trivial(a) for a in expr.args)
    return isinstance(expr, (MatrixSymbol, OneMatrix, ZeroMatrix)) or not isinstance(expr, MatrixExpr)


def is_name(expr: Basic) -> bool:
    """X or Xᵀ with X a name."""
    return isinstance(expr.arg if isinstance(expr, Transpose) else expr, MatrixSymbol)


def is_scaled_name(expr: Basic) -> bool:
    """c·X or c·Xᵀ with X a name and c a scalar other than 1."""
    if not isinstance(expr, MatMul):
        return False
    coeff, mats = factors(expr)
    return len(mats) == 1 and coeff != 1 and is_name(mats[0])


def count_uses(values: Iterable[Basic]) -> Counter:
    """How often each subexpression occurs across the values, every occurrence in their trees counted.

    Counted on the DAG: each distinct node passes its count to its arguments once (parents
    before children), so the work is the number of distinct nodes, not the trees' size.
    """
    values = list(values)
    order = nodes(*values)
    counts: Counter = Counter(values)
    for node in reversed(order):  # every node before its arguments
        for a in children(node):
            counts[a] += counts[node]
    return counts


WEIGHT_PREFIXES = ("W_", "b_", "gamma_", "beta_")


def is_weight(symbol: MatrixSymbol, parameters: Collection[str] | None = None) -> bool:
    """Parameters are the inputs named W_…, b_…, gamma_…, beta_… (or, given, those named in ``parameters``:
    a spec's own list), and trainable scalars; they carry no batch dimensions."""
    if isinstance(symbol, sp.Symbol):
        return not symbol.is_integer
    if parameters is not None:
        return isinstance(symbol, MatrixSymbol) and str(symbol.name) in parameters
    return isinstance(symbol, MatrixSymbol) and str(symbol.name).startswith(WEIGHT_PREFIXES)


def reads_of(inside: Iterable[Assignment], assignments: Iterable[Assignment]) -> set:
    """Every target of assignments that the given assignments read, directly or through others of them."""
    by_target = {a.target: a for a in assignments}
    seen: set = set()
    stack = [x for a in inside for x in matrix_symbols(a.value)]
    while stack:
        x = stack.pop()
        if x in seen or x not in by_target:
            continue
        seen.add(x)
        stack.extend(matrix_symbols(by_target[x].value))
    return seen


def entrywise(value: Basic) -> bool:
    """Is each entry of value made from the same entry of the values it reads (sums, ⊙, powers, scalar
    multiples, entrywise functions, ones of its shape), so that its block of rows and keys is made from theirs?
    A transpose (Sᵀ, n × n like S), a product or a row-wise function (over every key) is not."""
    for node in sp.preorder_traversal(value):
        if not isinstance(node, MatrixExpr):
            continue
        if isinstance(node, MatMul):
            if sum(isinstance(f, MatrixExpr) for f in node.args) > 1:
                return False
        elif isinstance(node, OneMatrix):
            if node.shape != value.shape:
                return False
        elif not isinstance(node, (MatAdd, HadamardProduct, HadamardPower, MatrixSymbol, Elementwise, Entries)):
            if not score_term(node):  # (a matrix of positions: its block computed from the block's positions)
                return False
    return True


def score_term(t: Basic) -> bool:
    """Is t a term the scores may add to the product: a mask M, a matrix of positions (or its split into heads)?"""
    return isinstance(t, (MatrixSymbol, Entries)) or (isinstance(t, SplitHeads) and isinstance(t.arg, Entries))
