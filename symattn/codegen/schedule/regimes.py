"""One schedule per size regime: the orders a schedule fixes where the cheapest one depends on the sizes.

A schedule names the inner products of a chain in its cheapest order (P X W_V as P (X W_V), XW_V saved for
the backward), and that choice is made before the sizes are known. Where the cheapest order of such a chain
depends on dimensions the spec leaves open (``optimize.orders.recording`` lists them), the schedule is built
once per *regime*: each point of the grid (every open dimension of those chains at 8, 64, 512 or 4096; a size
the user stated, fixed) gives the vector of the chains' cheapest orders there; each distinct vector is a
regime, built at its point nearest the typical sizes (``cost.sizes_at``). The generated module computes
every regime's FLOPs (forward and backward, a polynomial in the dimensions) from the arrays' shapes and runs the
cheapest: no guessed size decides what a user pays.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import sympy as sp
from sympy import Basic

from symattn.codegen.schedule.build import Schedule
from symattn.lang.graph import rewrite
from symattn.optimize.cost import TYPICAL_OTHER, TYPICAL_SIZES, flops, sizes_at
from symattn.optimize.orders import GRID, cheapest_orders, recording

__all__ = ["MOST_REGIMES", "Regime", "regimes"]

MOST_REGIMES = 4  # the regimes covering the most grid points; the rest run the cheapest of these
MOST_SYMBOLS = 7  # 4⁷ grid points; a spec with more open dimensions in such chains keeps one schedule


@dataclass(frozen=True)
class Regime:
    """A schedule and its cost: FLOPs of one forward and backward, a polynomial in the spec's dimensions."""

    schedule: Schedule
    flops: Basic


def regimes(build: Callable[[], Schedule], stated: Mapping[str, int] | None = None) -> list[Regime]:
    """The schedules of build's spec, one per size regime, the one at the typical sizes first; a single one when
    no product order depends on the sizes the user did not state. build makes the schedule under the current size
    table (``cost.sizes_at``) and must not be cached: each call decides again."""
    with recording() as chains:
        first = build()
    stated = dict(stated or {})
    symbols = sorted({s for c in chains for m in c for d in m.shape for s in sp.sympify(d).free_symbols}, key=str)
    open_symbols = [s for s in symbols if str(s) not in stated]
    if not chains or not open_symbols or len(open_symbols) > MOST_SYMBOLS:
        return [Regime(first, _flops(first))]
    points = np.array(list(itertools.product(GRID, repeat=len(open_symbols))), dtype=float)
    at = {s: points[:, i] for i, s in enumerate(open_symbols)} | {
        s: np.full(len(points), float(stated[str(s)])) for s in symbols if str(s) in stated
    }
    vectors = np.stack([cheapest_orders(c, at) for c in chains], axis=1)  # (points, chains)
    typical = np.array([math.log2(TYPICAL_SIZES.get(str(s), TYPICAL_OTHER)) for s in open_symbols])
    distance = np.abs(np.log2(points) - typical).sum(axis=1)
    groups: dict[tuple, list[int]] = {}
    for i, vector in enumerate(map(tuple, vectors)):
        groups.setdefault(vector, []).append(i)
    nearest = min(range(len(points)), key=lambda i: distance[i])
    first_vector = tuple(vectors[nearest])
    ranked = sorted((v for v in groups if v != first_vector), key=lambda v: -len(groups[v]))
    found = [Regime(first, _flops(first))]
    for vector in ranked[: MOST_REGIMES - 1]:
        point = min(groups[vector], key=lambda i: distance[i])
        table = stated | {str(s): int(points[point, j]) for j, s in enumerate(open_symbols)}
        with sizes_at(table):
            made = build()
        if all(not _same(made, r.schedule) for r in found):
            found.append(Regime(made, _flops(made)))
    return _cheapest_somewhere(found, {str(s): points[:, j] for j, s in enumerate(open_symbols)})


def _cheapest_somewhere(found: list[Regime], grid: dict[str, np.ndarray]) -> list[Regime]:
    """The first regime, and each other that costs least (its FLOPs over the whole schedule) at some point of the
    grid: a regime whose chains' orders differ but whose schedule never wins is left out. A dimension off the grid
    is at its size in the table (``cost.sizes_at``)."""
    costs = []
    for r in found:
        symbols = sorted(r.flops.free_symbols, key=str)
        values = [grid.get(str(s), TYPICAL_SIZES.get(str(s), TYPICAL_OTHER)) for s in symbols]
        costs.append(
            np.broadcast_to(
                np.asarray(sp.lambdify(symbols, r.flops)(*values), dtype=float), (len(grid[next(iter(grid))]),)
            )
        )
    winners = set(np.argmin(np.stack(costs), axis=0).tolist())
    return [r for i, r in enumerate(found) if i == 0 or i in winners]


def _same(a: Schedule, b: Schedule) -> bool:
    """The same assignments in the same order (a regime whose orders change nothing is not kept)."""
    return a.forward == b.forward and a.backward == b.backward


def _flops(sched: Schedule) -> Basic:
    """FLOPs of the schedule's forward and backward, each named value once, as a polynomial in the dimensions."""
    values: dict[Basic, Basic] = {}
    for a in (*sched.forward, *sched.backward):
        values[a.target] = rewrite(a.value, values.get)
    forward = [values[a.target] for a in sched.forward]
    backward = [values[a.target] for a in sched.backward]
    return sp.expand(flops(forward) + flops(backward, given=forward))
