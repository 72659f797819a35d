"""The memory-efficient variant of a schedule: softmax blocks over query rows, P never stored whole.

The standard schedule keeps P = softmax(A) (n × m) from the forward for the
backward. Here the forward goes through blocks of query rows, computing for each
block A_b, P_b and O_b and keeping only O and the row log-sum-exp
L = log rowsum(exp(A)) (n × 1); the backward recomputes P_b = exp(A_b − L_b 𝟏ᵀ)
block by block. Each gradient that the standard schedule writes as rows of
row-local values (dQ = dA K) is collected block by block; each written as a
contraction over query rows (dK = dAᵀ Q, dV = Pᵀ dO) is summed over the blocks.
Extra memory: O(b·m) for a block of b rows plus O(n·d) for the collected rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions import MatMul, OneMatrix, Transpose

from symattn.errors import SymattnError
from symattn.ops import Exp, RowSoftmax
from symattn.schedule import Assignment, Schedule, _factors

BLOCK_SIZE = 64  # default query rows per block: 64 × m temporaries


@dataclass
class Loop:
    """A loop over blocks of query rows: slices, body, rows collected, sums accumulated."""

    rows_of: str
    slices: list[tuple[str, str]] = field(default_factory=list)
    body: list[Assignment] = field(default_factory=list)
    collect: list[tuple[str, str]] = field(default_factory=list)
    accumulate: list[Assignment] = field(default_factory=list)
    softmax: tuple[str, str, str] | None = None  # (P_b, L_b, A_b): P_b, L_b = row_softmax_lse(A_b)


@dataclass
class MemEffPlan:
    """The schedule cut around its softmax: forward and backward, each before, in and after a loop."""

    forward_pre: list[Assignment]
    forward_loop: Loop
    forward_post: list[Assignment]
    backward_pre: list[Assignment]
    backward_loop: Loop
    backward_post: list[Assignment]
    lse: MatrixSymbol
    saved: tuple[Basic, ...]


def _block(symbol: MatrixSymbol) -> MatrixSymbol:
    return MatrixSymbol(f"{symbol.name}_b", sp.Symbol("b", positive=True, integer=True), symbol.shape[1])


def plan(sched: Schedule) -> MemEffPlan:
    """Cut the schedule around its one row softmax P = softmax(A), A = c·X Zᵀ, O = P V."""
    forward = list(sched.forward)
    softmaxes = [i for i, a in enumerate(forward) if isinstance(a.value, RowSoftmax)]
    if len(softmaxes) != 1:
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant needs exactly one row softmax")
    i_p = softmaxes[0]
    p_assign = forward[i_p]
    a_sym = p_assign.value.arg
    i_a = next((i for i, a in enumerate(forward) if a.target == a_sym), None)
    i_o = next((i for i, a in enumerate(forward) if i > i_p and p_assign.target in a.value.atoms(MatrixSymbol)), None)
    if i_a is None or i_o is None or i_a + 1 != i_p or i_o != i_p + 1:
        raise SymattnError(f"spec {sched.spec.name}: expected A, P = softmax(A), O = P V in a row")
    a_assign, o_assign = forward[i_a], forward[i_o]
    _, a_mats = _factors(a_assign.value)
    _, o_mats = _factors(o_assign.value)
    if len(a_mats) != 2 or not isinstance(a_mats[1], Transpose) or o_mats[0] != p_assign.target or len(o_mats) != 2:
        raise SymattnError(f"spec {sched.spec.name}: expected A = c·X Zᵀ and O = P V")
    query, keys, values = a_mats[0], a_mats[1].arg, o_mats[1]
    full = {keys, values}
    n_rows = p_assign.target.shape[0]
    core = {a_sym, p_assign.target}

    def blocked(x: Basic) -> bool:
        return isinstance(x, MatrixSymbol) and x not in full and x.shape[0] == n_rows and x.name not in sched.weights

    lse = MatrixSymbol("L", n_rows, 1)
    table: dict[Basic, Basic] = {}

    def in_block(expr: Basic) -> Basic:
        syms = {x for x in expr.atoms(MatrixSymbol) if blocked(x) or x in core or x == lse}
        for x in syms:
            table.setdefault(x, _block(x))
            table.setdefault(x.T, _block(x).T)
        return expr.xreplace({x: table[x] for x in syms})

    # Forward: A_b, then P_b and L_b together, then O_b collected.
    floop = Loop(rows_of=str(query.name))
    floop.body.append(Assignment(_block(a_sym), in_block(a_assign.value)))
    floop.softmax = (f"{p_assign.target.name}_b", f"{lse.name}_b", f"{a_sym.name}_b")
    floop.body.append(Assignment(_block(o_assign.target), in_block(o_assign.value)))
    floop.collect = [(str(o_assign.target.name), f"{o_assign.target.name}_b"), (lse.name, f"{lse.name}_b")]
    floop.slices = [(f"{x.name}_b", str(x.name)) for x in sorted(_inputs_of(floop.body) & _blocked_set(blocked), key=str)]

    # Backward: recompute A_b and P_b = exp(A_b − L_b 𝟏ᵀ), then every value that reads P (or reads one that does).
    backward = list(sched.backward)
    for a in backward:
        if a.value.atoms(MatrixSymbol) & core:
            core.add(a.target)
    inside = [a for a in backward if a.target in core]
    needed_before = _closure(inside, backward) - core
    pre = [a for a in backward if a.target in needed_before]
    post = [a for a in backward if a.target not in core and a.target not in needed_before]
    bloop = Loop(rows_of=str(query.name))
    bloop.body.append(Assignment(_block(a_sym), in_block(a_assign.value)))
    ones = OneMatrix(1, p_assign.target.shape[1])
    bloop.body.append(Assignment(_block(p_assign.target), Exp(_block(a_sym) - _block(lse) * ones)))
    for a in inside:
        coeff, mats = _factors(a.value) if isinstance(a.value, MatMul) else (1, [])
        if len(mats) == 2 and isinstance(mats[0], Transpose) and _is_blocked(mats[0].arg, blocked, core):
            bloop.accumulate.append(Assignment(a.target, in_block(a.value), a.reduce_batch))
        elif blocked(a.target) or a.target.shape[0] == n_rows:
            bloop.body.append(Assignment(_block(a.target), in_block(a.value)))
            if a.target not in core or _read_after(a.target, post, sched):
                bloop.collect.append((str(a.target.name), f"{a.target.name}_b"))
        else:
            raise SymattnError(f"spec {sched.spec.name}: {a.target} = {a.value} is neither row-local nor a sum over rows")
    bloop.collect = [c for c in bloop.collect if _read_after(MatrixSymbol(c[0], 1, 1), post, sched)]
    bloop.slices = [
        (f"{x.name}_b", str(x.name))
        for x in sorted((_inputs_of(bloop.body + bloop.accumulate) & _blocked_set(blocked)) | {lse}, key=str)
    ]
    used = set().union(*(a.value.atoms(MatrixSymbol) for a in [*pre, *inside, *post]))
    used |= {a_assign.value.atoms(MatrixSymbol)} and a_assign.value.atoms(MatrixSymbol)
    saved = tuple(x for x in sched.saved if x not in core and (x in used or not isinstance(x, MatrixSymbol)))
    saved = (*saved, lse)
    return MemEffPlan(
        forward_pre=forward[:i_a],
        forward_loop=floop,
        forward_post=forward[i_o + 1 :],
        backward_pre=pre,
        backward_loop=bloop,
        backward_post=post,
        lse=lse,
        saved=saved,
    )


def _blocked_set(blocked) -> _Predicate:
    return _Predicate(blocked)


class _Predicate(set):
    """A set defined by a predicate, for intersections with sets of symbols."""

    def __init__(self, test) -> None:
        super().__init__()
        self.test = test

    def __rand__(self, other: set) -> set:
        return {x for x in other if self.test(x)}


def _inputs_of(body: list[Assignment]) -> set:
    """Full-size symbols a loop body reads (block symbols end in _b and are made in the loop)."""
    made = {a.target for a in body}
    read = set().union(*(a.value.atoms(MatrixSymbol) for a in body))
    return {MatrixSymbol(str(x.name)[:-2], *x.shape) for x in read - made if str(x.name).endswith("_b")}


def _is_blocked(x: Basic, blocked, core: set) -> bool:
    return blocked(x) or x in core


def _closure(inside: list[Assignment], backward: list[Assignment]) -> set:
    by_target = {a.target: a for a in backward}
    seen: set = set()
    stack = [x for a in inside for x in a.value.atoms(MatrixSymbol)]
    while stack:
        x = stack.pop()
        if x in seen or x not in by_target:
            continue
        seen.add(x)
        stack.extend(by_target[x].value.atoms(MatrixSymbol))
    return seen


def _read_after(target: MatrixSymbol, post: list[Assignment], sched: Schedule) -> bool:
    names = {str(x.name) for a in post for x in a.value.atoms(MatrixSymbol)}
    return str(target.name) in names or str(target.name) in {str(t.name) for _, t in sched.gradients}
