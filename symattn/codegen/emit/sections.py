"""The statements of a generated module's forward and backward sections, printed by the backend's printer.

A schedule's assignments become ``Statement``s; the memory-efficient variant's loop over blocks
of query rows becomes a loop section. Each statement may overwrite the arrays that die at it
(``_dying``), and the gradient of an optional input runs only when the input was given.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, MatrixSlice, Transpose

from symattn.codegen.backends import Backend
from symattn.codegen.emit import layout
from symattn.codegen.emit.block_maps import map_arguments, map_lines
from symattn.codegen.schedule.build import Assignment, Schedule
from symattn.codegen.schedule.plan import Plan, broadcast_column
from symattn.codegen.schedule.rowblocks import BLOCK_SIZE, END_ROW, FIRST_ROW, plan
from symattn.errors import SymattnError
from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import matrix_symbols
from symattn.lang.ops import SplitHeads
from symattn.lang.piecewise import draws
from symattn.numeric.positions import bound_code
from symattn.optimize.mask_structure import width
from symattn.optimize.position_blocks import SEED, DropoutBlock, EntriesBlock
from symattn.specs import Option

# An in-place chain printing longer than this prints as plain arithmetic instead (a line ruff format keeps < 120).
INPLACE_WIDTH = 100

# Values that a statement writes into a new array (not a view): a later entrywise statement may overwrite it.
FRESH = (MatMul, MatAdd, HadamardProduct, HadamardPower, FunctionRecord, DropoutBlock)


@dataclass(frozen=True)
class Statement:
    """One line of generated code: target = value (value printed by a printer)."""

    target: str
    value: str
    guard: str = ""  # an optional input: the statement runs only when it was given (else the target is None)
    frees: tuple[str, ...] = ()  # values made earlier in this function and read here for the last time: del'd
    keyed: bool = False  # a sum over blocks of rows assigned whole (add_rows), not added to in place
    # how much deeper than its template puts it the statement stands (4 in a branch of ``emit.regimes``, which
    # indents the template's lines): its lines are broken for that column, continuation lines written as if not
    deeper: int = 0

    @property
    def deletion(self) -> str:
        """del <frees>, laid out for the function body."""
        return layout.shifted(layout.deleted(self.frees, 4 + self.deeper), self.deeper)

    @property
    def loop_deletion(self) -> str:
        """del <frees>, laid out for a loop's body."""
        return layout.shifted(layout.deleted(self.frees, 8 + self.deeper), self.deeper)


def _dying(assignments: list[Assignment], protected: set) -> list[frozenset]:
    """For each assignment, the arrays it may overwrite: made earlier in this scope as fresh arrays
    (not views), read exactly once here and never again, neither saved nor returned."""
    fresh: set[str] = set()
    last_read = {str(x.name): i for i, a in enumerate(assignments) for x in matrix_symbols(a.value)}
    out = []
    for i, a in enumerate(assignments):
        reads = Counter(str(x.name) for x in sp.preorder_traversal(a.value) if isinstance(x, sp.MatrixSymbol))
        out.append(
            frozenset(
                name for name, k in reads.items() if k == 1 and last_read[name] == i and name in fresh - protected
            )
        )
        base = a.value
        while isinstance(base, (Transpose, MatrixSlice)):  # a view of base: base must survive while it lives
            base = base.args[0]
        if isinstance(base, sp.MatrixSymbol):
            fresh.discard(str(base.name))
        view = isinstance(a.value, MatMul) and (
            len(a.value.args) < 2 or broadcast_column(a.value) is not None or _broadcast_chain(a.value)
        )
        if isinstance(a.value, FRESH) and not view:  # u 𝟏ᵀ prints as a broadcast view (torch: expand)
            fresh.add(str(a.target.name))
    return out


def _freed(assignments: list[Assignment], protected: set) -> list[tuple[str, ...]]:
    """For each assignment, the values it reads for the last time: made earlier in this list, neither saved
    nor returned. Deleting them there lets the allocator reuse their memory while it is still in cache, so a
    deep stack's backward holds one layer's temporaries at a time, as the same layers called one by one do."""
    made = {str(a.target.name): i for i, a in enumerate(assignments)}
    last_read: dict[str, int] = {}
    for i, a in enumerate(assignments):
        for x in matrix_symbols(a.value):
            last_read[str(x.name)] = i
    out: list[list[str]] = [[] for _ in assignments]
    for name, i in last_read.items():
        if name in made and made[name] < i and name not in protected:
            out[i].append(name)
    return [tuple(sorted(names)) for names in out]


def _broadcast_chain(expr: MatMul) -> bool:
    """A product that ends in a row of ones or starts with a column of ones (F₁ F₂ 𝟏ᵀ): printed as a broadcast view."""
    mats = [m for m in expr.args if isinstance(m, sp.MatrixExpr)]
    return bool(mats) and (
        (isinstance(mats[-1], sp.OneMatrix) and mats[-1].shape[0] == 1)
        or (isinstance(mats[0], sp.OneMatrix) and mats[0].shape[1] == 1)
    )


def _read_elsewhere(assignments: list[Assignment], targets: set) -> set:
    """The targets that another assignment reads."""
    return {x for a in assignments for x in matrix_symbols(a.value) & targets if x != a.target}


def _uses(name: str, texts: list[str]) -> bool:
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    return any(pattern.search(t) for t in texts)


@dataclass
class Sections:
    """Prints a schedule's assignments as the statements of the forward and backward sections."""

    sched: Schedule
    printer: object
    mask: str | None
    batched: set
    protected: set
    gradient_of: dict = field(default_factory=dict)  # target -> the optional input whose gradient it is
    unused: dict = field(default_factory=dict)  # target -> the input the output does not read
    mask_gradients: dict = field(default_factory=dict)  # dM -> whether the scores have a heads axis
    mutable: bool = True  # the backend's arrays can be written (Backend.mutable; JAX's cannot)
    # the loops' rows per block: the memory-efficient variant's option block_size, else (a standard module with a
    # mask) rows_per_block: blocks where the mask may let them skip keys, one block of every row where not
    chosen_rows: bool = False

    def statement(self, a: Assignment, consumable: frozenset = frozenset(), frees: tuple[str, ...] = ()) -> Statement:
        printer, plan = self.printer, Plan(consumable)
        if a.target in self.unused:  # the output does not read this input: zeros of its full (batched) shape
            value = printer.zeros_like(self.unused[a.target])
        elif a.target in self.mask_gradients:  # summed to the mask's shape
            value = printer.mask_gradient(self.value(a.value, plan), self.mask_gradients[a.target])
        elif a.reduce_batch:
            with printer.planned(plan):
                value = printer.weight_gradient(a.value, self.batched)
        else:
            value = self.value(a.value, plan)
        # the gradient of an optional input is computed only when the input was given
        return Statement(str(a.target.name), value, self.gradient_of.get(a.target, ""), frees)

    def value(self, expr: Basic, plan: Plan) -> str:
        """expr printed by plan; an in-place chain too long for a line (ruff format keeps < 120) as plain
        arithmetic instead."""
        with self.printer.planned(plan):
            text = self.printer.doprint(expr)
        if plan.consumable and len(text) > INPLACE_WIDTH:
            text = self.printer.doprint(expr)
        return text

    def fits(self, a: Assignment, dying: frozenset) -> frozenset:
        """The dying arrays a's value may be written into: those batched if and only if the value is (an array
        without the batch axes cannot hold a value that broadcasts along them, one with them would give an
        unbatched value batch axes; the plan checks the shapes, ``Plan.buffer``); none for a printer of
        immutable arrays (JAX)."""
        if not self.printer.inplace:
            return frozenset()
        batched = any(str(x.name) in self.batched for x in matrix_symbols(a.value))
        return frozenset(name for name in dying if (name in self.batched) == batched)

    def lines(self, assignments, whole: bool = False, later: frozenset = frozenset()) -> dict:
        """The statements of one section; whole: the section is the function's only one, so a value read
        for the last time here is deleted (mutable arrays only: JAX traces, its buffers are XLA's); later:
        the names the function's later sections read, which no statement here may overwrite."""
        assignments = list(assignments)
        dying = [self.fits(a, d) for a, d in zip(assignments, _dying(assignments, self.protected | later))]
        frees = _freed(assignments, self.protected) if whole and self.printer.inplace else [()] * len(assignments)
        return {"loop": False, "lines": [self.statement(a, d, f) for a, d, f in zip(assignments, dying, frees)]}

    def loop(self, lp) -> dict:
        """A loop over blocks of rows, after its block maps (``emit.block_maps``), which its statements read."""
        maps = [Statement(name, code) for name, code in map_lines(lp, self.printer)]
        section = self._loop(lp) | {"map_lines": maps}
        self.printer.block_maps = {}
        return section

    def _loop(self, lp) -> dict:
        kept = self.protected | {str(b.name) for _, b in lp.collect}
        collected = {b for _, b in lp.collect}  # a collected block that is another block's alias keeps that one
        kept |= {str(a.value.name) for a in lp.body if a.target in collected and isinstance(a.value, sp.MatrixSymbol)}
        everything = [*lp.body, *lp.accumulate]
        dying = [self.fits(a, d) for a, d in zip(everything, _dying(everything, kept))]
        # a block's value read for the last time is deleted there (its memory reused by the next one)
        frees = _freed(everything, kept) if self.printer.inplace else [()] * len(everything)
        body = [self.statement(a, d, f) for a, d, f in zip(lp.body, dying, frees)]
        if lp.softmax is not None:  # P_b, L_b = row_softmax_lse(A_b), right after A_b (P_b alone: L not kept)
            p_b, l_b, a_b = lp.softmax
            kept = any(b == l_b for _, b in lp.collect)
            plain, masked = (
                ("row_softmax_lse", "masked_row_softmax_lse") if kept else ("row_softmax", "masked_row_softmax")
            )
            # P_b written into A_b where A_b is read no more; an immutable array library's helper (JAX) takes no
            # out= (a torch printer told to write nothing in place still passes it: the helper decides)
            later = {x for a in everything for x in matrix_symbols(a.value) if a.target != a_b}
            operand = a_b.name if a_b in later or not self.mutable else f"{a_b.name}, out={a_b.name}"
            call = f"{self.printer.helper(masked if lp.masked else plain)}({operand})"
            if self.mask is not None and not lp.masked:
                call += f" if {self.mask} is None else {self.printer.helper(masked)}({operand})"
            elif self.mask is None and lp.masked and lp.window is not None and lp.window.every_row != sp.false:
                # (the structure leaves every row of the block a key: no row all −∞)
                seen = bound_code(lp.window.every_row, self._rows(lp))
                call = f"{self.printer.helper(plain)}({operand}) if {seen} else {call}"
            body.insert(_after(body, a_b), Statement(f"{p_b.name}, {l_b.name}" if kept else str(p_b.name), call))
        if lp.scores is not None:  # the causal part of the mask, written into the block's scores
            scores = str(lp.scores.name)
            fill = f"{self.printer.helper('causal_fill')}({scores}, block, keys) if causal else {scores}"
            body.insert(_after(body, lp.scores), Statement(scores, fill))
        accumulate = [
            self.statement(a, d, f) for a, d, f in zip(lp.accumulate, dying[len(lp.body) :], frees[len(lp.body) :])
        ]
        return {
            "loop": True,
            "starts": f"{self.printer.helper('block_starts')}({lp.rows_of}.shape[-2], block_size)",
            "block_rows": self._block_rows(lp),
            "key_lines": self._keys(lp),
            "slices": [
                {
                    "block": str(b.name),
                    "full": str(f.name),
                    "optional": str(f.name) in self.sched.optional,
                    "columns": "keys" if b in lp.keyed else ":",
                }
                for b, f in lp.slices
            ],
            "body": body,
            "collect": [self._collected(lp, f, b) for f, b in lp.collect],
            "accumulate": [
                _rows_added(line, self.printer.helper("add_rows"), self._key_count(lp))
                if a.target in lp.keyed
                else _added(line, self.printer.helper(self.printer.block_sum))
                if self.printer.block_sum  # (torch: 16-bit parts summed in float32)
                else line
                if self.mutable
                else _added(line)  # immutable arrays (JAX): a new sum, not +=
                for a, line in zip(lp.accumulate, accumulate)
            ],
        }

    def _collected(self, lp, whole, block) -> dict:
        """A value the loop collects: its blocks of rows concatenated, or (an n × m value whose blocks take the
        key range) each placed in the whole, zero on the keys the block skipped."""
        name = str(whole.name)
        if block not in lp.keyed:
            concat = self.printer.concatenate_rows(f"{name}_blocks")
            return {"full": name, "block": str(block.name), "concat": concat, "place": "", "guard": ""}
        rows = f"{lp.rows_of}.shape[-2]"
        place = f"{self.printer.helper('put_rows')}({name}, block, keys, {block.name}, {rows}, {self._key_count(lp)})"
        # a float mask's gradient: made only when the mask was given
        finish = self.printer.placed_rows(name)
        return {
            "full": name,
            "block": str(block.name),
            "place": place,
            "finish": finish,
            "guard": self.gradient_of.get(whole, ""),
        }

    def _block_rows(self, lp) -> str:
        """block_size = <this>, the rows per block, before the loop ("": the option block_size)."""
        if not self.chosen_rows:
            return ""
        return f"{self.printer.helper('rows_per_block')}({self.mask}, causal, {lp.rows_of})"

    def _key_count(self, lp) -> str:
        return f"{lp.keys[0][1].name}.shape[-2]"

    def _rows(self, lp) -> dict:
        """The code of the block's first row and row end, for the bounds of its key window."""
        return {FIRST_ROW: "block.start", END_ROW: f"min(block.stop, {lp.rows_of}.shape[-2])"}

    def _keys(self, lp) -> list[Statement]:
        """The block's key range and the rows of the whole values of m key rows in it (none without one)."""
        if not lp.keys:  # (a block of positions or of dropout's mask reads the keys too: every one)
            positions = set().union(*(a.value.atoms(EntriesBlock, DropoutBlock) for a in (*lp.body, *lp.accumulate)))
            if not positions:
                return []
            every = self.printer.doprint(min(positions, key=str).shape[1])
            return [Statement("keys", f"slice(0, {every})")]
        call = f"{self.printer.helper('key_range')}({self.mask}, causal, block, {self._key_count(lp)})"
        if lp.window is not None:  # the keys a matrix of positions leaves the block (within the mask's)
            lo, hi = (bound_code(x, self._rows(lp)) for x in (lp.window.lo, lp.window.hi))
            within = call if self.mask is not None else "None"
            maps = map_arguments(self.printer)
            call = f"{self.printer.helper('key_window')}({lo}, {hi}, {self._key_count(lp)}, {within}{maps})"
        return [Statement("keys", call), *(Statement(str(k.name), f"{f.name}[..., keys, :]") for k, f in lp.keys)]


def _after(body: list[Statement], target: sp.MatrixSymbol) -> int:
    """Where a statement right after the one assigning target goes (A_b: its softmax, its causal part)."""
    return next(i for i, line in enumerate(body) if line.target == str(target.name)) + 1


def _rows_added(line: Statement, add_rows: str, count: str) -> Statement:
    """A sum over the blocks of a value of m key rows: each block's part added to the rows of its key range."""
    return Statement(line.target, f"{add_rows}({line.target}, keys, {line.value}, {count})", line.guard, keyed=True)


def _added(line: Statement, helper: str = "") -> Statement:
    """A sum over the blocks as a new value: target + part (immutable arrays), or helper(target, part)."""
    if helper:
        return Statement(line.target, f"{helper}({line.target}, {line.value})", line.guard, keyed=True)
    part = f"({line.value})" if " if " in line.value else line.value  # a conditional binds looser than +
    return Statement(line.target, f"{line.target} + {part}", line.guard, keyed=True)


def _batched(sched: Schedule) -> set:
    """The names of the values that carry leading batch dimensions (blocks of rows included): the inputs and
    constants that are no weights (the mask among them), the seed, and, in order, each value that reads one of
    them, but for a weight's gradient (summed over the batch). A value of the weights alone is unbatched whatever
    its name (F₂ = σ(W₁W₁ᵀ), t = 𝟏𝟏ᵀ − F₂): it cannot hold in place a value that broadcasts along the batch."""
    s = sched.spec
    batched = {str(x.name) for x in (*s.inputs, *s.constants) if str(x.name) not in sched.weights}
    batched.add(str(sched.seed.name))
    for a in (*sched.forward, *sched.backward):
        if not a.reduce_batch and any(str(x.name) in batched for x in matrix_symbols(a.value)):
            batched.add(str(a.target.name))
    return batched | {f"{name}_b" for name in batched} | {"L", "L_b"}  # blocks of rows (memory-efficient variant)


def _sections(sched: Schedule, printer, mask: str | None, variant: str, backend: Backend) -> dict:
    """The forward and backward sections, the values forward saves, the options and the shared gradients."""
    optional = sched.optional
    protected = {str(getattr(x, "name", x)) for x in sched.saved} | {str(sched.output.name), "L"}
    protected |= {str(t.name) for _, t in sched.gradients}
    gradient_of = {t: name for name, t in sched.gradients if name in optional}
    unused = {t: name for name, t in sched.gradients for a in sched.backward if a.target == t and a.value.is_ZeroMatrix}
    options = list(sched.options)
    # dM (a float attn_mask's gradient) is computed only when one was given: mask_shape is None otherwise
    heads = any(isinstance(n, SplitHeads) for a in sched.forward for n in sp.preorder_traversal(a.value))
    mask_gradients = {t: heads for _, t in sched.constant_gradients}
    gradient_of |= {t: "mask_shape" for t in mask_gradients}
    # what dM reads stays intact: dM may be that very array (no axis to sum over)
    protected |= {str(x.name) for a in sched.backward if a.target in mask_gradients for x in matrix_symbols(a.value)}
    cut = _blocks(sched, variant, backend.loops)
    if cut is not None:
        backward_assignments = [*cut.backward[0], *cut.backward[1].body, *cut.backward[1].accumulate, *cut.backward[2]]
    else:
        backward_assignments = list(sched.backward)
    # The gradient of an optional input that other lines read (dbeta_2 = db_1 W_1ᵀ) is computed whatever the
    # input; only the value returned for it is None when the input was.
    shared = _read_elsewhere(backward_assignments, set(gradient_of))
    gradient_of = {t: name for t, name in gradient_of.items() if t not in shared}
    p = Sections(sched, printer, mask, _batched(sched), protected, gradient_of, unused, mask_gradients, backend.mutable)
    if cut is not None:
        p.chosen_rows = variant != "memeff"
        forward = [
            p.lines(cut.forward[0], later=_read(cut.forward[1:])),
            p.loop(cut.forward[1]),
            p.lines(cut.forward[2]),
        ]
        backward = [
            p.lines(cut.backward[0], later=_read(cut.backward[1:])),
            p.loop(cut.backward[1]),
            p.lines(cut.backward[2]),
        ]
        saved_symbols = cut.saved
        if any(a.value.atoms(DropoutBlock) for a in cut.forward[1].body):  # the call's seed: drawn, saved
            forward[0]["lines"].insert(0, Statement(SEED, f"{printer.helper('dropout_seed')}(training, rng)"))
            saved_symbols = (*saved_symbols, sp.Symbol(SEED))
    else:
        forward, backward = [p.lines(sched.forward, whole=True)], [p.lines(sched.backward, whole=True)]
        saved_symbols = sched.saved
    if variant == "memeff":
        block_size = sp.Symbol("block_size", positive=True, integer=True)
        options.append(Option("block_size", block_size, sp.Integer(_rows_per_block(cut))))
    return {
        "forward_sections": forward,
        "backward_sections": backward,
        "saved_symbols": saved_symbols,
        "options": options,
        "shared": shared,
        "unused": unused,
        "blocked": cut is not None,
    }


def _read(sections: tuple) -> frozenset:
    """The names a cut's later sections read: a loop's (its body, sums and the whole values it slices) and the
    assignments after it."""
    loop, after = sections
    values = [a.value for a in (*loop.body, *loop.accumulate, *after)]
    names = {str(x.name) for v in values for x in matrix_symbols(v)}
    return frozenset(names | {str(f.name) for _, f in (*loop.slices, *loop.keys)})


def _blocks(sched: Schedule, variant: str, loops: bool):
    """The cut of the schedule into loops over blocks of query rows (``rowblocks.plan``), or None: the
    memory-efficient variant's (L kept, P recomputed); the standard variant's when the spec has a mask (P kept,
    the blocks skipping the keys the mask hides) and the cut exists; none for "whole" (the closed forms that
    take every array whole: the second closed form). loops: the backend has the loops' runtime (NumPy, torch)."""
    if variant == "memeff":  # (a dropout mask in its loops: each block drawn from the call's seed, drawn again)
        return plan(sched)
    # the standard variant draws a dropout mask once, whole, and saves it (no blocks recomputing it)
    if variant != "standard" or sched.mask is None or not loops or draws(sched.spec.output):
        return None
    try:
        return plan(sched, keep=True)
    except SymattnError:
        return None


def _statements(sections: dict) -> list[Statement]:
    """Every statement of the forward and backward sections, in order."""
    return [
        line
        for sec in (*sections["forward_sections"], *sections["backward_sections"])
        for line in sec.get("lines", []) + sec.get("body", []) + sec.get("accumulate", [])
    ]


LEAST_BLOCK = 32  # the fewest rows per block a window chooses: below, the loop's per-block calls take over


def _rows_per_block(cut: Plan | None) -> int:
    """The memory-efficient variant's default rows per block: BLOCK_SIZE, or under a sliding window of w keys per
    row (a number), w rows (at least LEAST_BLOCK, at most BLOCK_SIZE): a block of b rows reads b + w − 1 keys, so
    a block much wider than the window computes mostly hidden scores (benchmarks/POSITIONS_MEMEFF.md: w = 64 is
    0.24× plain attention at b = 128, 0.20× at b = 64)."""
    window = cut.forward[1].window if cut is not None else None
    keys = width(window, FIRST_ROW, END_ROW) if window is not None else None
    return BLOCK_SIZE if keys is None else min(BLOCK_SIZE, max(LEAST_BLOCK, keys))
