"""Which parenthesisation of a product chain is cheapest whatever the sizes the spec leaves open.

F₁ ⋯ F_k can be multiplied in Catalan(k − 1) orders; which one costs least depends on the dimensions.
A spec's dimensions are symbols (n, d_k, a user's g), known only when a module is called, so the
schedule may fix an order only where it wins at every size: ``order_at_every_size`` prices every order
(``cost.pair_flops``'s rule: 2·a·b·c a pairwise product, a·b·c against a block of ones, nothing for a
broadcast column) on a grid of sizes (each dimension symbol 8, 64, 512 or 4096, every combination) and
returns the order that is cheapest at all of them, or None. A chain with None is left whole and ordered
at call time from the arrays' shapes (the generated modules' runtime ``chain``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache

import numpy as np
import sympy as sp
from sympy import Basic
from sympy.matrices.expressions import MatMul, OneMatrix

__all__ = ["GRID", "cheapest_orders", "order_at_every_size", "priced_at_typical_sizes", "recording"]

GRID = (8, 64, 512, 4096)  # the sizes each dimension symbol takes (every combination)
MOST_FACTORS = 8  # Catalan(7) = 429 orders; a longer chain is ordered at call time
MOST_SYMBOLS = 6  # 4⁶ grid points

Tree = int | tuple  # a factor's index, or (left, right)
_RECORDS: list[list[tuple[Basic, ...]]] = []  # the open ``recording`` blocks' lists


@contextmanager
def recording() -> Iterator[list[tuple[Basic, ...]]]:
    """Within the block, the chains whose order a pass fixed at the typical sizes although the cheapest order
    depends on the sizes (``priced_at_typical_sizes``) are appended to the list it yields, each once."""
    found: list[tuple[Basic, ...]] = []
    _RECORDS.append(found)
    try:
        yield found
    finally:
        _RECORDS.remove(found)


def priced_at_typical_sizes(mats: Sequence[Basic]) -> None:
    """A pass is about to fix the order of mats at the typical sizes (``cost.sizes_at``'s table): recorded for
    ``recording`` when no order is the cheapest at every size (the decision is then the table's)."""
    if _RECORDS and order_at_every_size(mats) is None:
        for found in _RECORDS:
            if tuple(mats) not in found:
                found.append(tuple(mats))


def order_at_every_size(mats: Sequence[Basic]) -> Basic | None:
    """The nested binary product of mats (as ``cost.chain_order`` builds it) in the order that costs least at
    every size of the grid, or None when the cheapest order depends on the sizes. Among orders cheapest
    everywhere, the left-to-right one first, then the one with the latest splits."""
    shapes = tuple((m.shape[0], m.shape[1]) for m in mats)
    ones = tuple(isinstance(m, OneMatrix) for m in mats)
    tree = _winner(shapes, ones)
    return None if tree is None else _built(tree, list(mats))


def cheapest_orders(mats: Sequence[Basic], at: Mapping[Basic, np.ndarray]) -> np.ndarray:
    """At each point of a grid (at: every dimension symbol of mats → its sizes, one per point), the index of the
    cheapest parenthesisation of mats among ``_trees``' (ties: the earlier one, left to right first)."""
    count = len(next(iter(at.values())))
    if not 2 <= len(mats) <= MOST_FACTORS:
        return np.zeros(count, dtype=int)
    dims = [sp.sympify(r) for r, _ in (m.shape for m in mats)] + [sp.sympify(mats[-1].shape[1])]
    _, costs = _costs(dims, tuple(isinstance(m, OneMatrix) for m in mats), at, count)
    return costs.argmin(axis=0)


def _costs(dims: list, ones: tuple, at: Mapping[Basic, np.ndarray], count: int) -> tuple[list[Tree], np.ndarray]:
    """Every parenthesisation of the chain whose dimensions are dims (``_trees``' order) and its cost at each of
    count points (at: each dimension symbol → its sizes there)."""
    symbols = sorted(set().union(*(sp.sympify(d).free_symbols for d in dims)), key=str)
    values = sp.lambdify(symbols, dims)(*(at[s] for s in symbols))
    sizes = [np.broadcast_to(np.asarray(v, dtype=float), (count,)) for v in values]
    trees = _trees(0, len(dims) - 2)
    return trees, np.array([np.broadcast_to(_tree_cost(t, sizes, dims, ones)[0], (count,)) for t in trees])


def _built(tree: Tree, mats: list[Basic]) -> Basic:
    if isinstance(tree, int):
        return mats[tree]
    return Basic.__new__(MatMul, _built(tree[0], mats), _built(tree[1], mats))  # consecutive factors: no check


@cache
def _winner(shapes: tuple[tuple[Basic, Basic], ...], ones: tuple[bool, ...]) -> Tree | None:
    k = len(shapes)
    if k < 2:
        return 0
    if k > MOST_FACTORS:
        return None
    dims = [sp.sympify(r) for r, _ in shapes] + [sp.sympify(shapes[-1][1])]
    symbols = sorted(set().union(*(d.free_symbols for d in dims)), key=str)
    if len(symbols) > MOST_SYMBOLS:
        return None
    grid = list(itertools.product(GRID, repeat=len(symbols)))
    points = np.array(grid, dtype=float).reshape(len(grid), len(symbols))
    trees, costs = _costs(dims, ones, {s: points[:, i] for i, s in enumerate(symbols)}, len(points))
    cheapest = costs.min(axis=0)
    winners = [t for t, c in zip(trees, costs) if np.all(c <= cheapest * (1 + 1e-12))]
    return winners[0] if winners else None


@cache
def _trees(i: int, j: int) -> list[Tree]:
    """Every binary tree over factors i … j: the left-to-right one first, then by later splits first."""
    if i == j:
        return [i]
    return [(left, right) for s in range(j - 1, i - 1, -1) for left in _trees(i, s) for right in _trees(s + 1, j)]


def _tree_cost(tree: Tree, sizes: list, dims: list, ones: tuple) -> tuple:
    """(cost at every grid point, first factor, last factor) of a tree."""
    if isinstance(tree, int):
        return 0.0, tree, tree
    left_cost, i, s = _tree_cost(tree[0], sizes, dims, ones)
    right_cost, _, j = _tree_cost(tree[1], sizes, dims, ones)
    a, b, c = sizes[i], sizes[s + 1], sizes[j + 1]
    left_ones, right_ones = i == s and ones[i], s + 1 == j and ones[j]
    if right_ones and dims[s + 1] == 1:
        step = 0.0  # a column times 𝟏ᵀ: a broadcast
    elif left_ones or right_ones:
        step = a * b * c  # a sum of b terms per entry
    else:
        step = 2 * a * b * c
    return left_cost + right_cost + step, i, j
