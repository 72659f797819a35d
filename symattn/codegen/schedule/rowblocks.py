"""The memory-efficient variant of a schedule: the softmax goes through blocks of query rows.

The standard schedule keeps P = softmax(A) (n × m) from the forward for the backward. Here the forward goes through
blocks of b query rows, computing A_b, P_b and O_b for each and keeping only O and the row log-sum-exp
L = log rowsum(exp(A)) (n × 1); the backward recomputes P_b = exp(A_b − L_b 𝟏ᵀ) block by block. A backward value made
of rows of row-local values (dQ = dA K) is collected block by block; one that contracts over query rows (dK = dAᵀ Q,
dV = Pᵀ dO) is summed over the blocks. Extra memory: O(b·m) for the block's temporaries plus O(n·d) for the collected
rows, never O(n·m).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions import (
    BlockMatrix,
    MatAdd,
    MatMul,
    OneMatrix,
    Transpose,
)

from symattn.codegen.schedule.build import Schedule
from symattn.codegen.schedule.dag import Assignment, entrywise, reads_of, score_term
from symattn.errors import SymattnError
from symattn.lang.algebra import factors
from symattn.lang.graph import matrix_symbols, nodes
from symattn.lang.ops import Exp, RowSoftmax
from symattn.lang.positions import Entries, Scatter, tables_read
from symattn.optimize.block_tests import block_test
from symattn.optimize.mask_structure import KeyWindow, window_of_scores
from symattn.optimize.position_blocks import EntriesBlock, ScatterBlock, in_blocks

BLOCK_SIZE = 128  # default query rows per block: 128 × m temporaries (2 MiB each at m = 4096, float32)
BLOCK_ROWS = sp.Symbol("b", positive=True, integer=True)
FIRST_ROW, END_ROW = sp.Symbol("r_0", integer=True, nonnegative=True), sp.Symbol("r_1", integer=True, positive=True)


@dataclass
class Loop:
    """A loop over blocks of the query rows of ``rows_of``.

    ``slices``: (block symbol, full symbol) read in the loop; ``body``: assignments to block symbols; ``collect``:
    (full, block) rows gathered into a full value; ``accumulate``: values summed over the blocks.
    """

    rows_of: str
    slices: list[tuple[MatrixSymbol, MatrixSymbol]] = field(default_factory=list)
    body: list[Assignment] = field(default_factory=list)
    collect: list[tuple[MatrixSymbol, MatrixSymbol]] = field(default_factory=list)
    accumulate: list[Assignment] = field(default_factory=list)
    softmax: tuple[MatrixSymbol, MatrixSymbol, MatrixSymbol] | None = None  # P_b, L_b from A_b
    # Blocks of keys (a spec with a mask): the keys no row of the block sees are skipped. ``keys``: (slice, full)
    # of the values of m key rows read whole (K, V), each read as its rows in the block's key range (none: the
    # loop reads every key); ``scores``: A_b where the loop makes it, the causal part of the mask written into
    # it; ``keyed``: the n × m slices (M_b, P_b), collected values (P, dM) and sums of m rows (dK, dV) that take
    # the key range too.
    keys: list[tuple[MatrixSymbol, MatrixSymbol]] = field(default_factory=list)
    scores: MatrixSymbol | None = None
    keyed: set = field(default_factory=set)
    # a matrix of positions in the scores: ``window`` the keys its mask leaves a block (``optimize.mask_structure``, of
    # FIRST_ROW and END_ROW), ``masked`` whether some score may be −∞ (a softmax for rows of −∞)
    window: KeyWindow | None = None
    masked: bool = False
    maps: tuple = ()  # the masks on data among the scores' terms (EntriesBlock): each a block map per call


@dataclass
class Plan:
    """The schedule cut around its softmax: forward and backward, each before, in and after a loop."""

    forward: tuple[list[Assignment], Loop, list[Assignment]]
    backward: tuple[list[Assignment], Loop, list[Assignment]]
    lse: MatrixSymbol
    saved: tuple[Basic, ...]


@dataclass
class Core:
    """The attention core of a schedule: the scores chain S = c·X Zᵀ (+ n × m terms), … , A (+ M), each an n × m
    value made entrywise from the ones before it; P = softmax(A) at ``softmax`` (an index into the forward);
    ``weights``, the n × m values made entrywise from P alone (dropout's Z_p(P), P ⊙ Z_p(P)); O = W V at ``output``
    (W P or one of the weights); ``query`` X (its rows the loop's) and ``full`` {Z, V} (read whole); ``tables``, the
    names of the matrices read at positions (b, ḃ, doc: read whole, each block at its own positions)."""

    chain: list[Assignment]
    softmax: int
    output: int
    query: Basic
    full: set
    weights: list[Assignment]
    tables: frozenset[str]


def _attention_core(sched: Schedule) -> Core:
    """The schedule's attention core (``Core``), or SymattnError naming what it lacks."""
    forward = list(sched.forward)
    where = [i for i, a in enumerate(forward) if isinstance(a.value, RowSoftmax)]
    if len(where) != 1 or where[0] == 0 or where[0] + 1 >= len(forward):
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant needs one row softmax")
    i = where[0]
    p_def = forward[i]
    chain = _chain(forward[:i], p_def.value.arg)
    weights = _weights(forward, i)
    weighed = {p_def.target, *(a.target for a in weights)}
    outputs = [j for j in range(i + 1, len(forward)) if set(factors(forward[j].value)[1][:1]) & weighed]
    _, s_mats = factors(_scores(chain[0].value)) if chain else (None, [])
    _, o_mats = factors(forward[outputs[0]].value) if outputs else (None, [])
    if (
        not chain
        or len(s_mats) != 2
        or not isinstance(s_mats[1], Transpose)
        or not outputs
        or len(o_mats) != 2
        or any(t in matrix_symbols(a.value) for a in forward[i + 1 :] for t in _targets(chain))
        or (sched.mask is not None and any(sched.mask in matrix_symbols(a.value) for a in chain[:-1]))
    ):
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant needs A = c·X Zᵀ, P, O = P V or W V")
    made = {a.target for a in forward[:i]} - {a.target for a in chain}
    outside = [x for a in chain for x in matrix_symbols(a.value) if x in made and x.shape == p_def.target.shape]
    if outside:  # (made whole before the loop, from the inputs: the backward's blocks would neither save nor remake it)
        why = f"reads no n × m value made before its loop ({outside[0]}: a mask computed from the inputs)"
        raise SymattnError(f"spec {sched.spec.name}: the memory-efficient variant {why}; use the standard one")
    tables = frozenset(str(t.name) for a in forward for t in tables_read(a.value))
    return Core(chain, i, outputs[0], s_mats[0], {s_mats[1].arg, o_mats[1]}, weights, tables)


def _weights(forward: list[Assignment], softmax: int) -> list[Assignment]:
    """The n × m values right after P = softmax(A) (at index softmax), each made entrywise of P and of the ones
    before it alone (Z = Z_p(P), W = Z ⊙ P: the weights O = W V reads); [] where the next value is none."""
    made, found, shape = {forward[softmax].target}, [], forward[softmax].target.shape
    for a in forward[softmax + 1 :]:
        if a.target.shape != shape or not matrix_symbols(a.value) <= made or not entrywise(a.value):
            return found
        made.add(a.target)
        found.append(a)
    return found


def _chain(before: list[Assignment], scores: Basic) -> list[Assignment]:
    """The assignments from the scores product to the softmax's argument (in order): A, and the n × m values A is
    made of entrywise (S = c·X Zᵀ, T = tanh(S), A = 50 T + M); [] when the argument is not such a value or a
    later value of the chain reads anything but values of its shape and scalars."""
    by_target = {a.target: a for a in before}
    if scores not in by_target:
        return []
    found, todo = {}, [scores]
    while todo:
        a = by_target[todo.pop()]
        if a.target in found:
            continue
        found[a.target] = a
        if _product(a.value):  # the product: where the chain starts
            continue
        reads = matrix_symbols(a.value)
        if any(x.shape != scores.shape for x in reads) or not entrywise(a.value):
            return []
        todo += [x for x in reads if x in by_target]
    chain = [a for a in before if a.target in found]
    products = [a for a in chain if _product(a.value)]
    return chain if products == chain[:1] else []


def _product(value: Basic) -> bool:
    """Is value a product of matrices (c·X Zᵀ), maybe plus n × m values, rather than a scalar times one?"""
    return len(factors(_scores(value))[1]) >= 2


def _targets(chain: list[Assignment]) -> set:
    """The chain's values but the last (A, which the softmax reads)."""
    return {a.target for a in chain[:-1]}


def plan(sched: Schedule, keep: bool = False) -> Plan:
    """Cut the schedule around its one row softmax: A = c·X Zᵀ (+ M), P = softmax(A), O = P V.

    An additive n × m mask M is row-local: each block reads its rows M_b. keep: the forward keeps P (n × m,
    written block by block, zero on the keys a block skips) and the backward reads its blocks instead of
    recomputing them from L: the standard variant of a spec with a mask, whose blocks skip masked keys.
    """
    forward = list(sched.forward)
    core = _attention_core(sched)
    full = core.full | {t for x, t in sched.tangents if x in core.full}  # K̇ and V̇ are read whole, as K and V
    for a in forward:  # and what is made of them alone: a forward mode's [K̇ | K] (schedule.passes.stack_products)
        if isinstance(a.value, BlockMatrix) and a.value.free_symbols and a.value.free_symbols <= full:
            full.add(a.target)
    a_def, p_def = core.chain[-1], forward[core.softmax]
    n_rows = p_def.target.shape[0]
    lse = MatrixSymbol("L", n_rows, 1)
    blocks: dict[MatrixSymbol, MatrixSymbol] = {}

    def rows(x: Basic) -> bool:  # a value with a row per query, which a block can slice (X, read whole as keys too)
        return isinstance(x, MatrixSymbol) and x.shape[0] == n_rows and x.name not in sched.weights | core.tables

    def row_local(x: Basic) -> bool:
        return rows(x) and x not in full

    def block(x: MatrixSymbol) -> MatrixSymbol:
        return blocks.setdefault(x, MatrixSymbol(f"{x.name}_b", BLOCK_ROWS, x.shape[1]))

    def in_block(expr: Basic) -> Basic:
        """expr for a block of rows: its row-local values' blocks, and a ones matrix of n rows (1 − T², 𝟏 b) b."""
        local = sorted((x for x in matrix_symbols(expr) if row_local(x)), key=str)  # a fixed order: same bytes
        ones = {o: OneMatrix(BLOCK_ROWS, o.shape[1]) for o in expr.atoms(OneMatrix) if o.shape[0] == n_rows}
        return in_blocks(expr.xreplace({x: block(x) for x in local} | ones), BLOCK_ROWS)

    ahead, floop, after = _forward_cut(sched, core, lse, blocks, (row_local, block, in_block))

    # Backward: A_b and P_b = exp(A_b − L_b 𝟏ᵀ) again, then each value that reads P or a row-local value
    # made from it; a value that reads a sum over the blocks comes after the loop.
    bloop = Loop(rows_of=str(core.query.name))
    ones = OneMatrix(1, p_def.target.shape[1])
    bloop.body = [
        *(Assignment(block(a.target), in_block(a.value)) for a in core.chain),
        Assignment(block(p_def.target), Exp(block(a_def.target) - block(lse) * ones)),
        *(Assignment(block(a.target), in_block(a.value)) for a in core.weights),  # (Z_b drawn again: its seed's)
    ]
    # keep: P_b read from the forward's P, and the chain's values the backward reads (S of dτ = 𝟏ᵀ(S ⊙ dA)𝟏) from
    # theirs, each collected by the forward as P is
    kept = [a.target for a in core.chain[:-1] if any(a.target in matrix_symbols(b.value) for b in sched.backward)]
    if keep and (core.weights or any(a_def.target in matrix_symbols(a.value) for a in sched.backward)):
        raise SymattnError(f"spec {sched.spec.name}: the backward reads A or weights made of P, which no block keeps")
    bloop.body = [] if keep else bloop.body
    propagating = {*(a.target for a in (*core.chain, *core.weights)), p_def.target}
    inside = _backward_loop(sched, bloop, propagating, p_def.target.shape, (row_local, block, in_block, rows))
    made_in = {a.target for a in inside} | propagating
    before = reads_of(inside, sched.backward) - made_in
    pre = [a for a in sched.backward if a.target in before]
    post = [a for a in sched.backward if a.target not in made_in and a.target not in before]
    read_after = {x for a in post for x in matrix_symbols(a.value)} | {t for _, t in sched.gradients}
    read_after |= {t for _, t in sched.constant_gradients}
    bloop.collect = [(a.target, block(a.target)) for a in inside if a.target in propagating and a.target in read_after]
    bloop.slices = _slices(bloop, blocks)

    reads = {x for a in (*pre, *bloop.body, *bloop.accumulate, *post) for x in a.value.free_symbols}
    reads |= {full for _, full in bloop.slices}
    made = {a.target for a in (*pre, *inside, *post)}
    saved = tuple(x for x in sched.saved if x in reads and x not in made and x not in made_in)
    saved += _read_again(sched, reads, saved)
    if keep and sched.backward:  # the forward collects P (for the backward's blocks) instead of L
        floop.collect = [(x, b) if x != lse else (p_def.target, block(p_def.target)) for x, b in floop.collect]
        floop.collect += [(x, block(x)) for x in kept if (x, block(x)) not in floop.collect]
        saved += tuple(kept)
        lse = p_def.target
        # a mask's gradient (dM = dA, collected whole) summed to the mask's shape after the loop
        post += [Assignment(t, t) for _, t in sched.constant_gradients if t in {x for x, _ in bloop.collect}]
    kept_after = {*saved, lse, *(x for x, _ in bloop.collect)}
    lost = sorted(str(x) for a in post for x in matrix_symbols(a.value) if x in propagating and x not in kept_after)
    if lost:  # (Pᵀ dF summed after the loop, in an order of products whose cut reads P whole)
        raise SymattnError(f"spec {sched.spec.name}: after the blocks of rows the backward reads {', '.join(lost)}")
    _positions_of(sched, core, (floop, bloop), in_block(a_def.value), keep)
    _keys_of(sched, (floop, bloop), full, block(a_def.target), blocks, keep)
    return Plan((ahead, floop, after), (pre, bloop, post), lse, (*saved, lse))


def _backward_loop(sched: Schedule, bloop: Loop, propagating: set, scores: tuple, local: tuple) -> list[Assignment]:
    """The backward values the loop makes (returned in order): each that reads P, a value of the chain or a
    row-local value made from them (propagating, which grows), or is n × m itself (dP = dO Vᵀ: made block by
    block, never whole), put in the loop's body (row-local) or summed over its blocks (dK = dAᵀ Q, 𝟏ᵀ dQW_Q,
    𝟏ᵀ (S ⊙ dA) 𝟏); a value that reads such a sum comes after the loop."""
    row_local, block, in_block, rows = local
    summed, later, inside = set(), set(), []
    for a in sched.backward:
        reads = matrix_symbols(a.value)
        _, mats = factors(a.value)
        if reads & (summed | later) or not (reads & propagating or a.target.shape == scores):
            if reads & (summed | later):
                later.add(a.target)
            continue
        inside.append(a)
        column_sums = len(mats) in (2, 3) and isinstance(mats[0], OneMatrix) and mats[0].shape[0] == 1
        column_sums = column_sums and (len(mats) == 2 or (isinstance(mats[2], OneMatrix) and mats[2].shape[1] == 1))
        transposed_rows = len(mats) == 2 and isinstance(mats[0], Transpose) and rows(mats[0].arg)
        if column_sums or transposed_rows or isinstance(a.value, Scatter):  # Xᵀ B = Σ_b X_bᵀ B_b, scatter(W) too
            sliced = {mats[0].arg: block(mats[0].arg)} if transposed_rows else {}
            bloop.accumulate.append(Assignment(a.target, in_block(a.value).xreplace(sliced), a.reduce_batch))
            summed.add(a.target)
        elif row_local(a.target) and not _sums_rows(a.value, rows):
            bloop.body.append(Assignment(block(a.target), in_block(a.value)))
            propagating.add(a.target)
        else:
            raise SymattnError(f"spec {sched.spec.name}: {a.target} = {a.value} is neither row-local nor a row sum")
    return inside


def _sums_rows(expr: Basic, rows) -> bool:
    """Does a term of expr sum over the query rows (Pᵀ dPX: a product whose left factor is a transposed value with a
    row per query)? Such a value is no block's own: dX = dF W + Pᵀ dPX is not row-local although dX is."""
    firsts = [factors(node)[1][0] for node in nodes(expr) if isinstance(node, MatMul)]
    return any(isinstance(f, Transpose) and any(rows(x) for x in matrix_symbols(f.arg)) for f in firsts)


def _positions_of(sched: Schedule, core: Core, loops: tuple[Loop, Loop], scores: Basic, keep: bool) -> None:
    """The loops' facts of the matrices of positions in the scores chain: the key window their masks leave a block
    (scores: A_b, its terms blocks of positions) and whether a score may be −∞. A plan that keeps P (the standard
    variant with a mask argument) takes none: its closed form takes them whole."""
    positions = [x for a in core.chain for x in nodes(a.value) if isinstance(x, Entries)]
    if positions and keep:
        raise SymattnError(f"spec {sched.spec.name}: positions and a mask: the standard variant takes them whole")
    window = window_of_scores(scores, FIRST_ROW, END_ROW)
    terms = MatAdd.make_args(scores) if window is not None else ()
    maps = tuple(t for t in terms if isinstance(t, EntriesBlock) and block_test(t.formula) is not None)
    for loop in loops:
        loop.window, loop.masked, loop.maps = window, any(x.masks for x in positions), maps


def _keys_of(sched: Schedule, loops: tuple[Loop, Loop], full: set, scores: MatrixSymbol, blocks: dict, keep: bool):
    """Each loop's key range where the spec has a mask or its positions do (``_by_keys``); a plan that keeps P must
    have one."""
    for loop in loops:
        if sched.mask is not None or loop.window is not None:
            _by_keys(loop, full, scores, blocks.get(sched.mask))
            loop.scores = loop.scores if sched.mask is not None else None  # (causal: an option of a mask argument)
    floop, bloop = loops
    if keep and not (floop.keys and (bloop.keys or not sched.backward)):
        raise SymattnError(f"spec {sched.spec.name}: the blocks of rows cannot skip the keys the mask hides")


def _forward_cut(sched: Schedule, core: Core, lse: MatrixSymbol, blocks: dict, local: tuple):
    """The forward before, in and after the loop: the scores chain (S_b … A_b); P_b and L_b together; O_b; then
    each later value that reads one of them or is n × m itself (a forward mode's tangents Ȧ_b, Ṗ_b, Ȯ_b). What
    the loop reads of the later values (a forward mode's K̇_h, made from K̇) is made before it; O, L (for a
    backward) and the loop's values read after it are collected. local: the plan's row_local, block and
    in_block."""
    row_local, block, in_block = local
    forward = list(sched.forward)
    a_def, p_def, o_def = core.chain[-1], forward[core.softmax], forward[core.output]
    floop = Loop(rows_of=str(core.query.name), softmax=(block(p_def.target), block(lse), block(a_def.target)))
    floop.body = [Assignment(block(a.target), in_block(a.value)) for a in (*core.chain, *core.weights, o_def)]
    chain = {a.target for a in (*core.chain, *core.weights)}
    later = [a for a in forward[core.softmax + 1 :] if a is not o_def and a not in core.weights]
    after = _after_the_loop(sched, later, floop, (chain, p_def.target, o_def.target), row_local, block, in_block)
    sliced = [Assignment(b, whole) for b, whole in _slices(floop, blocks)]  # a block read: its whole value is
    early = reads_of([*floop.body, *sliced], tuple(after))
    ahead = [*(a for a in forward[: core.softmax] if a.target not in chain), *(a for a in after if a.target in early)]
    after = [a for a in after if a.target not in early]
    read_after = {x for a in after for x in matrix_symbols(a.value)} | {sched.output}
    kept = {block(x) for x in read_after if x in blocks and x != o_def.target}
    floop.collect = [(o_def.target, block(o_def.target))] + [(lse, block(lse))] * bool(sched.backward)
    floop.collect += [(x, b) for x, b in blocks.items() if b in kept and b in {a.target for a in floop.body}]
    floop.slices = _slices(floop, blocks)
    return ahead, floop, after


def _after_the_loop(
    sched: Schedule, later: list[Assignment], floop: Loop, core: tuple, row_local, block, in_block
) -> list[Assignment]:
    """The forward values after P = softmax(A) but O = P V (core: the chain's values S … A, P, O), each put in
    the loop (appended to its body) when it reads a value made there (the chain's, P, or one put there before
    it) or is n × m itself, and nothing made from the whole of O; the others, in order, are returned."""
    chain, p_target, o_target = core
    local, late, after = {*chain, p_target}, {o_target}, []
    for a in later:
        reads = matrix_symbols(a.value)
        if reads & late:
            late.add(a.target)
            after.append(a)
        elif reads & local or a.target.shape == p_target.shape:
            if not row_local(a.target):
                raise SymattnError(f"spec {sched.spec.name}: {a.target} = {a.value} is not row-local")
            floop.body.append(Assignment(block(a.target), in_block(a.value)))
            local.add(a.target)
        else:
            after.append(a)
    return after


def _by_keys(loop: Loop, full: set, scores: MatrixSymbol, mask: MatrixSymbol | None) -> None:
    """Let the loop read only the keys its block of rows may see (the mask's key range): the values of m key rows
    read whole (K, V) become their rows in the range, the n × m slices and the sums of m rows (dK = Σ dA_bᵀ Q_b)
    take it too, and an n × m value collected (P kept) is placed in its whole, zero on the keys skipped. Left as
    it is when the mask is not read in the loop, or when a value the loop collects or sums has the key dimension
    otherwise (a column sum 𝟏ᵀ P_b)."""
    m = scores.shape[1]
    made = any(a.target == scores for a in loop.body) or loop.softmax
    if loop.window is None and (mask is None or not any(b == mask or b.shape == scores.shape for b, _ in loop.slices)):
        return
    if loop.window is not None and not made:  # (the window's keys: those of the scores the loop makes)
        return
    keyed = {b for b, whole in loop.slices if b.shape == scores.shape}
    keyed |= {b for _, b in loop.collect if b.shape == scores.shape}  # placed in the whole, zero on skipped keys
    for a in loop.accumulate:
        if isinstance(a.value, ScatterBlock):  # (a table's cotangent: its block's positions, keys among them)
            continue
        if a.target.shape[0] == m and a.target.shape[1] != m and not a.reduce_batch:
            keyed.add(a.target)
        elif m in a.target.shape:
            return
    if any(m in b.shape for _, b in loop.collect if b not in keyed):
        return
    read = {x for a in (*loop.body, *loop.accumulate) for x in matrix_symbols(a.value)}
    whole = sorted((x for x in full if x in read), key=str)
    sub = {x: MatrixSymbol(f"{x.name}_k", *x.shape) for x in whole}
    loop.body = [Assignment(a.target, a.value.xreplace(sub), a.reduce_batch) for a in loop.body]
    loop.accumulate = [Assignment(a.target, a.value.xreplace(sub), a.reduce_batch) for a in loop.accumulate]
    loop.keys, loop.keyed = [(sub[x], x) for x in whole], keyed
    loop.scores = scores if made else None


def _scores(value: Basic) -> Basic:
    """c·X Zᵀ of A = c·X Zᵀ + M (an additive mask), or A's value itself."""
    if isinstance(value, sp.MatAdd):
        products = [t for t in value.args if isinstance(t, MatMul)]
        if len(products) == 1 and all(score_term(t) for t in value.args if t is not products[0]):
            return products[0]
    return value


def _read_again(sched: Schedule, reads: set, saved: tuple) -> tuple:
    """The sizes, trainable scalars, constants and tables the backward's loop reads that the forward does not save yet:
    what a block of positions reads again (n of its rows, a slope τ, a table b read at positions), the scale of the
    scores it recomputes (c·X Zᵀ), where the whole backward read none."""
    scalars = {*sched.spec.inputs, *(c for c, _ in sched.constants)}
    again = {x for x in reads if isinstance(x, sp.Symbol) and ((x.is_integer and x.is_positive) or x in scalars)}
    again |= reads & {t for a in sched.forward for t in tables_read(a.value)}
    return tuple(sorted(again - {BLOCK_ROWS, *saved}, key=str))


def _slices(loop: Loop, blocks: dict[MatrixSymbol, MatrixSymbol]) -> list[tuple[MatrixSymbol, MatrixSymbol]]:
    """(block, full) for each block symbol the loop reads but does not compute."""
    made = {a.target for a in loop.body}
    if loop.softmax is not None:
        made |= set(loop.softmax[:2])
    read = {x for a in (*loop.body, *loop.accumulate) for x in matrix_symbols(a.value)}
    return [(b, full) for full, b in blocks.items() if b in read and b not in made]
