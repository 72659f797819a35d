"""Sharing in a schedule: every subexpression used twice named and computed once, and assignments ordered.

``share`` finds repeated subexpressions largest first (so that the parts of a shared value are named only
where they are used elsewhere too) and names them (t1, t2, … or the label of the interior they are, dQW_Q);
``order`` puts assignments in an order in which every name is assigned before it is read.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import Counter

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import MatMul

from symattn.codegen.schedule.dag import Assignment, count_uses, is_trivial
from symattn.lang.algebra import factors, transpose
from symattn.lang.graph import bottom_up, children, matrix_symbols, sort_key
from symattn.lang.naming.names import Names


def share(
    values: list[Assignment], interior: dict[Basic, str], taken: frozenset[str] = frozenset()
) -> list[Assignment]:
    """Every subexpression used twice named (t1, t2, … or its interior label, dQW_Q) and computed once; a label
    in taken (the spec's names, the forward's values) is skipped.

    Largest first, so that the parts of a shared value are named only where used elsewhere too;
    a candidate whose uses the substitution does not all find (a transposed use written
    otherwise) is declined rather than named for one use.

    The uses are counted once and then kept up to date value by value: naming a candidate
    recounts only the values it was found in, and the candidates wait in a heap by weight,
    so a deep spec's many shared values cost what their values' sizes add up to.
    """
    serial, declined = 0, set()
    flat = Names()  # no names: products flattened, as every substitution below leaves them
    values = [Assignment(a.target, flat.substitute(a.value), a.reduce_batch) for a in values]
    holders: dict[Basic, set[int]] = {}  # symbol → the values that may read it (a superset: never removed)
    for i, a in enumerate(values):
        for x in matrix_symbols(a.value):
            holders.setdefault(x, set()).add(i)
    targets = {str(a.target.name) for a in values}
    candidates = _Candidates(frozenset(interior))
    candidates.update(count_uses(a.value for a in values))
    while (shared := candidates.pop(declined)) is not None:
        label = interior.get(shared, "")
        if not label or label in targets or label in taken:
            while f"t{serial + 1}" in taken:
                serial += 1
            label = f"t{serial + 1}"
        target = MatrixSymbol(label, *shared.shape)
        local = Names()
        local.add(shared, target)
        wanted = matrix_symbols(shared)  # a value without all of shared's leaves cannot contain it
        changed = {}
        for i in sorted(min((holders[x] for x in wanted), key=len)) if wanted else range(len(values)):
            if not wanted <= matrix_symbols(values[i].value):
                continue
            if (value := local.substitute(values[i].value)) != values[i].value:
                changed[i] = value
        before = count_uses(values[i].value for i in changed)
        after = count_uses(changed.values())
        if after[target] + after[transpose(target)] < 2:
            declined.add(shared)
            continue
        serial += label == f"t{serial + 1}"
        for i, value in changed.items():
            values[i] = Assignment(values[i].target, value, values[i].reduce_batch)
            for x in matrix_symbols(value):
                holders.setdefault(x, set()).add(i)
        values.append(Assignment(target, shared))
        targets.add(label)
        for x in wanted:
            holders[x].add(len(values) - 1)
        after.update(count_uses([shared]))
        after.subtract(before)
        candidates.update(after)
    return values


class _Candidates:
    """The subexpressions used more than once (a use of eᵀ is a use of e), the heaviest first.

    The weight of e is the size of the pair {e, eᵀ}, then the orientation with fewer transposes
    (P ⊙ dA, not Pᵀ ⊙ dAᵀ), then SymPy's sort key (the greatest first); labelled candidates
    (interior cotangents) come before all others. The uses are kept as a running count; the heap
    may hold stale entries, which pop checks against the count.
    """

    def __init__(self, labelled: frozenset) -> None:
        self.labelled = labelled
        self.counts: Counter = Counter()
        self.transposed: dict[Basic, Basic] = {}  # e → eᵀ as lang.algebra.transpose writes it
        self.transposed_from: dict[Basic, list[Basic]] = {}  # t → every e counted so far with eᵀ = t
        self.heap: list[tuple[tuple, int, Basic]] = []
        self.pushed = itertools.count()  # ties in the heap never compare expressions
        self.keys: dict[Basic, tuple] = {}

    def update(self, delta: Counter) -> None:
        """Add delta to the counts; e becomes a candidate again when its count or eᵀ's changed."""
        touched: set[Basic] = set()
        for e, c in delta.items():
            if not c:
                continue
            self.counts[e] += c
            if e not in self.transposed:
                self.transposed[e] = t = transpose(e)
                self.transposed_from.setdefault(t, []).append(e)
            touched.add(e)
            touched.update(self.transposed_from.get(e, ()))
        for e in touched:  # after every count has changed: e and eᵀ may both be in delta
            if self._shared(e):
                heapq.heappush(self.heap, (self._key(e), next(self.pushed), e))

    def _shared(self, e: Basic) -> bool:
        t = self.transposed[e]
        uses = self.counts[e] + (self.counts[t] if t != e else 0)
        return self.counts[e] > 0 and uses > 1 and isinstance(e, MatrixExpr) and not is_trivial(e)

    def _key(self, e: Basic) -> tuple:
        if e not in self.keys:
            size = _tree_size(e)
            order = _Descending(sort_key(e))
            self.keys[e] = (e not in self.labelled, -min(size, _tree_size(self.transposed[e])), size, order)
        return self.keys[e]

    def pop(self, declined: set) -> Basic | None:
        """The heaviest candidate still used more than once, if any."""
        while self.heap:
            _, _, e = heapq.heappop(self.heap)
            if e not in declined and self._shared(e):
                return e
        return None


@functools.total_ordering
class _Descending:
    """A sort key ordered the other way round (the heap pops the least; ties go to the greatest key)."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __lt__(self, other: _Descending) -> bool:
        return other.key < self.key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Descending) and self.key == other.key


_SIZES: dict[Basic, int] = {}  # expression → its tree size, kept across rounds and schedules


def _tree_size(e: Basic) -> int:
    """The number of nodes in e's tree (every occurrence counted), computed once per distinct node.

    A superexpression always weighs more than its parts, so the largest shared value is named first.
    """
    return bottom_up(e, _SIZES, children, lambda node, sizes: 1 + sum(sizes[a] for a in children(node)), 1 << 18)


def product_name(expr: Basic) -> str:
    """An identifier for the cotangent of an unnamed product such as Q W_Q: dQW_Q."""
    if isinstance(expr, sp.MatAdd):  # Q W_Q + 𝟏 b_Q: named after its product, dQW_Q
        products = [t for t in expr.args if isinstance(t, MatMul) and not t.has(sp.OneMatrix)]
        return product_name(products[0]) if len(products) == 1 else ""
    _, mats = factors(expr)
    if all(isinstance(m, MatrixSymbol) for m in mats):
        return "d" + "".join(str(m.name) for m in mats)
    return ""


def order(assignments: list[Assignment]) -> list[Assignment]:
    """Stable topological order: each assignment after those whose targets it reads, otherwise in the given order.

    Kahn's algorithm with the ready assignments in a heap by position: each value's reads are found once.
    """
    position = {a.target: i for i, a in enumerate(assignments)}
    readers: dict[int, list[int]] = {}
    waiting = []
    for i, a in enumerate(assignments):
        reads = {position[x] for x in matrix_symbols(a.value) if x in position} - {i}
        waiting.append(len(reads))
        for j in reads:
            readers.setdefault(j, []).append(i)
    ready = [i for i, w in enumerate(waiting) if not w]
    heapq.heapify(ready)
    placed: list[Assignment] = []
    while ready:
        i = heapq.heappop(ready)
        placed.append(assignments[i])
        for k in readers.get(i, ()):
            waiting[k] -= 1
            if not waiting[k]:
                heapq.heappush(ready, k)
    if len(placed) < len(assignments):  # pragma: no cover - names are introduced acyclically
        raise RuntimeError("cyclic schedule")
    return placed
