"""The memory-efficient variant of a schedule: the softmax goes through blocks of query rows.

The standard schedule keeps P = softmax(A) (n × m) from the forward for the
backward. Here the forward goes through blocks of b query rows, computing A_b, P_b
and O_b for each and keeping only O and the row log-sum-exp
L = log rowsum(exp(A)) (n × 1); the backward recomputes P_b = exp(A_b − L_b 𝟏ᵀ)
block by block. A backward value made of rows of row-local values (dQ = dA K) is
collected block by block; one that contracts over query rows (dK = dAᵀ Q,
dV = Pᵀ dO) is summed over the blocks. Extra memory: O(b·m) for the block's
temporaries plus O(n·d) for the collected rows, never O(n·m).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions import MatMul, OneMatrix, Transpose

from symattn.codegen.schedule.build import Schedule
from symattn.codegen.schedule.dag import Assignment
from symattn.errors import SymattnError
from symattn.lang.algebra import factors
from symattn.lang.graph import matrix_symbols
from symattn.lang.ops import Exp, RowSoftmax

BLOCK_SIZE = 128  # default query rows per block: 128 × m temporaries (2 MiB each at m = 4096, float32)
BLOCK_ROWS = sp.Symbol("b", positive=True, integer=True)


@dataclass
class Loop:
    """A loop over blocks of the query rows of ``rows_of``.

    ``slices``: (block symbol, full symbol) read in the loop; ``body``: assignments
    to block symbols; ``collect``: (full, block) rows gathered into a full value;
    ``accumulate``: values summed over the blocks.
    """

    rows_of: str
    slices: list[tuple[MatrixSymbol, MatrixSymbol]] = field(default_factory=list)
    body: list[Assignment] = field(default_factory=list)
    collect: list[tuple[MatrixSymbol, MatrixSymbol]] = field(default_factory=list)
    accumulate: list[Assignment] = field(default_factory=list)
    softmax: tuple[MatrixSymbol, MatrixSymbol, MatrixSymbol] | None = None  # P_b, L_b from A_b


@dataclass
class Plan:
    """The schedule cut around its softmax: forward and backward, each before, in and after a loop."""

    forward: tuple[list[Assignment], Loop, list[Assignment]]
    backward: tuple[list[Assignment], Loop, list[Assignment]]
    lse: MatrixSymbol
    saved: tuple[Basic, ...]


def _attention_core(sched: Schedule) -> tuple[int, Basic, set]:
    """Where P = softmax(A) is among the forward assignments, X of A = c·X Zᵀ, and {Z, V} of O = P V."""
    forward = list(sched.forward)
    where = [i for i, a in enumerate(forward) if isinstance(a.value, RowSoftmax)]
    if len(where) != 1 or where[0] == 0 or where[0] + 1 >= len(forward):
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant needs one row softmax")
    i = where[0]
    a_def, p_def, o_def = forward[i - 1], forward[i], forward[i + 1]
    _, a_mats = factors(_scores(a_def.value))
    _, o_mats = factors(o_def.value)
    if (
        p_def.value.arg != a_def.target
        or len(a_mats) != 2
        or not isinstance(a_mats[1], Transpose)
        or o_mats[:1] != [p_def.target]
        or len(o_mats) != 2
    ):
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant needs A = c·X Zᵀ, P, O = P V")
    return i, a_mats[0], {a_mats[1].arg, o_mats[1]}


def plan(sched: Schedule) -> Plan:
    """Cut the schedule around its one row softmax: A = c·X Zᵀ (+ M), P = softmax(A), O = P V.

    An additive n × m mask M is row-local: each block reads its rows M_b.
    """
    forward = list(sched.forward)
    i, query, full = _attention_core(sched)
    a_def, p_def, o_def = forward[i - 1], forward[i], forward[i + 1]
    n_rows = p_def.target.shape[0]
    lse = MatrixSymbol("L", n_rows, 1)
    blocks: dict[MatrixSymbol, MatrixSymbol] = {}

    def row_local(x: Basic) -> bool:
        return isinstance(x, MatrixSymbol) and x not in full and x.shape[0] == n_rows and x.name not in sched.weights

    def block(x: MatrixSymbol) -> MatrixSymbol:
        return blocks.setdefault(x, MatrixSymbol(f"{x.name}_b", BLOCK_ROWS, x.shape[1]))

    def in_block(expr: Basic) -> Basic:
        local = sorted((x for x in matrix_symbols(expr) if row_local(x)), key=str)  # a fixed order: same bytes
        return expr.xreplace({x: block(x) for x in local})

    # Forward: A_b; P_b and L_b together; O_b. O and L are collected.
    floop = Loop(rows_of=str(query.name), softmax=(block(p_def.target), block(lse), block(a_def.target)))
    floop.body = [
        Assignment(block(a_def.target), in_block(a_def.value)),
        Assignment(block(o_def.target), in_block(o_def.value)),
    ]
    floop.collect = [(o_def.target, block(o_def.target)), (lse, block(lse))]
    floop.slices = _slices(floop, blocks)

    # Backward: A_b and P_b = exp(A_b − L_b 𝟏ᵀ) again, then each value that reads P or a row-local value
    # made from it; a value that reads a sum over the blocks comes after the loop.
    bloop = Loop(rows_of=str(query.name))
    ones = OneMatrix(1, p_def.target.shape[1])
    bloop.body = [
        Assignment(block(a_def.target), in_block(a_def.value)),
        Assignment(block(p_def.target), Exp(block(a_def.target) - block(lse) * ones)),
    ]
    propagating, summed, later = {a_def.target, p_def.target}, set(), set()
    inside: list[Assignment] = []
    for a in sched.backward:
        reads = matrix_symbols(a.value)
        _, mats = factors(a.value)
        # n × m values (dP = dO Vᵀ) are made block by block too, never whole
        if reads & (summed | later) or not (reads & propagating or a.target.shape == p_def.target.shape):
            if reads & (summed | later):
                later.add(a.target)
            continue
        inside.append(a)
        column_sums = len(mats) == 2 and isinstance(mats[0], OneMatrix) and mats[0].shape[0] == 1  # 𝟏ᵀ dQW_Q
        if len(mats) == 2 and ((isinstance(mats[0], Transpose) and row_local(mats[0].arg)) or column_sums):
            bloop.accumulate.append(Assignment(a.target, in_block(a.value), a.reduce_batch))
            summed.add(a.target)
        elif row_local(a.target):
            bloop.body.append(Assignment(block(a.target), in_block(a.value)))
            propagating.add(a.target)
        else:
            raise SymattnError(f"spec {sched.spec.name}: {a.target} = {a.value} is neither row-local nor a row sum")
    core = {a.target for a in inside} | {a_def.target, p_def.target}
    before = _reads(inside, sched.backward) - core
    pre = [a for a in sched.backward if a.target in before]
    post = [a for a in sched.backward if a.target not in core and a.target not in before]
    read_after = {x for a in post for x in matrix_symbols(a.value)} | {t for _, t in sched.gradients}
    bloop.collect = [(a.target, block(a.target)) for a in inside if a.target in propagating and a.target in read_after]
    bloop.slices = _slices(bloop, blocks)

    reads = {x for a in (*pre, *bloop.body, *bloop.accumulate, *post) for x in a.value.free_symbols}
    reads |= {full for _, full in bloop.slices}
    made = {a.target for a in (*pre, *inside, *post)}
    saved = tuple(x for x in sched.saved if x in reads and x not in made and x not in core)
    return Plan((forward[: i - 1], floop, forward[i + 2 :]), (pre, bloop, post), lse, (*saved, lse))


def _scores(value: Basic) -> Basic:
    """c·X Zᵀ of A = c·X Zᵀ + M (an additive mask), or A's value itself."""
    if isinstance(value, sp.MatAdd):
        products = [t for t in value.args if isinstance(t, MatMul)]
        if len(products) == 1 and all(isinstance(t, MatrixSymbol) for t in value.args if t is not products[0]):
            return products[0]
    return value


def _slices(loop: Loop, blocks: dict[MatrixSymbol, MatrixSymbol]) -> list[tuple[MatrixSymbol, MatrixSymbol]]:
    """(block, full) for each block symbol the loop reads but does not compute."""
    made = {a.target for a in loop.body}
    if loop.softmax is not None:
        made |= set(loop.softmax[:2])
    read = {x for a in (*loop.body, *loop.accumulate) for x in matrix_symbols(a.value)}
    return [(b, full) for full, b in blocks.items() if b in read and b not in made]


def _reads(inside: list[Assignment], backward: tuple[Assignment, ...]) -> set:
    """Every backward target that the given assignments read, directly or not."""
    by_target = {a.target: a for a in backward}
    seen: set = set()
    stack = [x for a in inside for x in matrix_symbols(a.value)]
    while stack:
        x = stack.pop()
        if x in seen or x not in by_target:
            continue
        seen.add(x)
        stack.extend(matrix_symbols(by_target[x].value))
    return seen
