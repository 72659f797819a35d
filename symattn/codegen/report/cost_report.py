"""The report of ``symattn derive SPEC --cost``: FLOPs, bytes and peak temporaries, forward and backward.

A table of the generated schedule's named values (``node_costs``: shape, FLOPs and
bytes of each, the values saved for the backward marked, totals, and what the D
identity rowsum(dP ⊙ P) = rowsum(dO ⊙ O) saves), then three counts of the backward:
as derived (each gradient's closed form, shared subexpressions once), simplified
(``simplify_all`` over the forward and every gradient) and the generated schedule's
(each named value computed once, names free), and peaks at several sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sympy as sp
from sympy import Basic
from sympy.matrices.expressions import HadamardProduct, MatMul, MatrixSymbol

from symattn.codegen.schedule.build import Schedule, schedule, schedule_spec
from symattn.lang.graph import rewrite
from symattn.lang.ops import RowSoftmax, RowSum
from symattn.lang.shapes import dimension_symbols
from symattn.optimize.cost import (
    TYPICAL_SIZES,
    flops,
    is_view,
    node_bytes,
    node_flops,
    numel,
    peak_bytes,
    size_function,
    subexpressions,
)
from symattn.specs import Spec, spec, specs

# Sizes at which the report evaluates its symbolic counts: single-head n = m, d = 64, and H = 8 heads of 64.
REPORT_SIZES: tuple[dict[str, int], ...] = tuple({**TYPICAL_SIZES, "n": n, "m": n} for n in (128, 512, 2048, 4096))


@dataclass(frozen=True)
class NodeCost:
    """One named value of the generated schedule: its shape, FLOPs (symbolic) and bytes (symbolic)."""

    name: str
    backward: bool  # computed in the backward pass (else the forward)
    shape: tuple[Basic, Basic]
    flops: Basic  # this value's own work, the names it reads given
    bytes: Basic  # its entries (all heads) times the item size
    saved: bool = False  # a forward value the backward reads
    uses: tuple[str, ...] = ()  # the named values (and inputs) it reads


@dataclass(frozen=True)
class Saving:
    """A rewrite that the schedule took: what it computes, instead of what, and the FLOPs that saves."""

    what: str
    flops: Basic


@dataclass(frozen=True)
class CostReport:
    """FLOPs (symbolic) and peak temporaries of a spec's forward and backward pass.

    ``backward`` is the cost of every gradient together after simplification, the
    forward values given; ``backward_derived`` the same before simplification.
    """

    spec: str
    forward: Basic
    backward: Basic
    backward_derived: Basic
    rows: tuple[dict[str, float], ...]
    generated_forward: Basic | None = None  # the generated schedule's (a built-in spec, default options)
    generated_backward: Basic | None = None
    itemsize: int = 4  # bytes per entry of the peaks
    nodes: tuple[NodeCost, ...] = ()  # the generated schedule's values, forward then backward
    savings: tuple[Saving, ...] = ()

    def text(self, sizes: Mapping[str, int] = TYPICAL_SIZES) -> str:
        """The report as aligned plain text; the node table also evaluated at sizes."""
        lines = [f"cost of {self.spec} (FLOPs: products 2·a·b·c, one per entry elsewhere; shared subexpressions once)"]
        if self.nodes:
            lines += ["", *node_table(self.nodes, self.savings, sizes, self.itemsize)]
        lines += [
            "",
            "  totals (symbolic)",
            f"  forward             {self.forward}",
            f"  backward            {self.backward}",
            f"  backward as derived {self.backward_derived}",
            f"  forward + backward  {sp.expand(self.forward + self.backward)}",
        ]
        if self.generated_forward is not None:
            lines += [
                f"  generated forward   {self.generated_forward}",
                f"  generated backward  {self.generated_backward}",
            ]
        lines += [
            "",
            "  sizes                                   forward GFLOP  backward GFLOP  as derived  "
            f"generated  peak fwd MiB  peak bwd MiB (float{8 * self.itemsize})",
        ]
        for row in self.rows:
            lines.append(
                f"  {row['sizes']:40s}{row['forward'] / 1e9:13.3f}{row['backward'] / 1e9:16.3f}"
                f"{row['backward_derived'] / 1e9:12.3f}{_gflop(row['generated_backward']):>11s}"
                f"{row['forward_peak'] / 2**20:14.1f}"
                f"{row['backward_peak'] / 2**20:14.1f}"
            )
        lines += [
            "  (peaks: live temporaries, each freed after its last use and overwritten in place where an",
            "  argument dies there; the forward's includes the values the backward reads, the backward's not)",
        ]
        return "\n".join(lines)


def formula(expr: Basic) -> str:
    """A symbolic count as a reader writes it: 2·d_k·m·n + n² − n (not 2*d_k*m*n + n**2 - n)."""
    terms = sp.sympify(expr).as_ordered_terms()
    positive = [t for t in terms if not t.could_extract_minus_sign()]
    negative = [-t for t in terms if t.could_extract_minus_sign()]
    text = " + ".join(str(t) for t in positive) or "0"
    text += "".join(f" − {t}" for t in negative)
    return text.replace("**2", "²").replace("**3", "³").replace("*", "·")


OTHER_SIZE = 64  # a dimension the size tables do not name (a user's spec's own, g or d_ff) is this


def _at(expr: Basic, sizes: Mapping[str, int]) -> float:
    value = expr.xreplace({s: sizes.get(s.name, OTHER_SIZE) for s in expr.free_symbols})
    return float(value)


def node_table(
    nodes: Sequence[NodeCost], savings: Sequence[Saving], sizes: Mapping[str, int], itemsize: int
) -> list[str]:
    """The per-node table: pass, name (* saved), shape, FLOPs, MFLOP and KiB at sizes; totals; savings."""
    used = sorted({s.name for n in nodes for e in (*n.shape, n.flops) for s in sp.sympify(e).free_symbols})
    at = " ".join(f"{k}={sizes.get(k, OTHER_SIZE)}" for k in used)
    header = ("pass", "value", "shape", "FLOPs", "MFLOP", "KiB")
    body = [
        (
            "backward" if n.backward else "forward",
            n.name + (" *" if n.saved else ""),
            f"{formula(n.shape[0])} × {formula(n.shape[1])}",
            formula(n.flops),
            f"{_at(n.flops, sizes) / 1e6:.3f}",
            f"{_at(n.bytes, sizes) / 2**10:.1f}",
        )
        for n in nodes
    ]
    for backward in (False, True):
        part = [n for n in nodes if n.backward == backward]
        total, size = sp.Add(*(n.flops for n in part)), sp.Add(*(n.bytes for n in part))
        label = "backward" if backward else "forward"
        body.append(
            (
                label,
                "total",
                "",
                formula(sp.expand(total)),
                f"{_at(total, sizes) / 1e6:.3f}",
                f"{_at(size, sizes) / 2**10:.1f}",
            )
        )
    widths = [max(len(row[k]) for row in (header, *body)) for k in range(len(header))]
    right = (False, False, False, False, True, True)  # numbers right-aligned

    def line(row: tuple[str, ...]) -> str:
        cells = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(row, widths, right)]
        return ("  " + "  ".join(cells)).rstrip()

    title = f"generated schedule, value by value (MFLOP and KiB at {at}; float{8 * itemsize}; * saved for the backward)"
    out = [f"  {title}"]
    out += [line(header), line(tuple("-" * w for w in widths))]
    for row in body:
        if row[1] == "total" and row[0] == "forward":
            out.append(line(tuple("-" * w for w in widths)))
        out.append(line(row))
    for saving in savings:
        out.append(f"  {saving.what}: saves {formula(saving.flops)} FLOPs ({_at(saving.flops, sizes) / 1e6:.3f} MFLOP)")
    return out


def cost_report(name_or_spec, sizes: Sequence[Mapping[str, int]] = REPORT_SIZES, itemsize: int = 4) -> CostReport:
    """Forward and backward FLOPs and peak temporaries of a spec, simplified and as derived.

    The forward and every gradient are simplified together (``simplify_all``), so a
    value shared between them is computed once; the forward values the backward
    reads are saved, so they count in the forward's peak, not the backward's.
    """
    from symattn.derive.derivation import derive
    from symattn.optimize.simplify import simplify_all

    derivation = name_or_spec if hasattr(name_or_spec, "tape") else derive(name_or_spec)
    output, gradients = derivation.spec.output, list(derivation.gradients.values())
    # the intermediates (S, A, P, O) and their cotangents (dS, dA, dP, dO) ride along, to name temporaries
    cotangents = derivation.tape.cotangents
    named = [*derivation.spec.intermediates]
    named += [("d" + name, cotangents[e]) for name, e in derivation.spec.intermediates if e in cotangents]
    forward, *rest = simplify_all([output, *gradients, *(e for _, e in named)])
    backward = rest[: len(gradients)]
    computed = set(subexpressions([forward]))
    # the forward values the backward reads directly (in a fixed order: the peak depends on it)
    read = (a for n in subexpressions(backward) if n not in computed for a in n.args if a in computed)
    saved = list(dict.fromkeys(read))
    sched = schedule_of(derivation.spec)
    generated = schedule_values(derivation.spec, sched)
    rows = []
    dims = [s.name for s in dimension_symbols(output)]
    for given in sizes:
        table = {**given, **{k: OTHER_SIZE for k in dims if k not in given}}
        used = {k: v for k, v in table.items() if k in dims}
        rows.append(
            {
                "sizes": " ".join(f"{k}={v}" for k, v in used.items()),
                "forward": float(flops([forward], sizes=table)),
                "backward": float(flops(backward, given=[forward], sizes=table)),
                "backward_derived": float(flops(gradients, given=[output], sizes=table)),
                "generated_backward": None if generated is None else float(flops(generated[1], generated[0], table)),
                "forward_peak": peak_bytes([forward, *saved], sizes=table, itemsize=itemsize),
                "backward_peak": peak_bytes(backward, given=[forward], sizes=table, itemsize=itemsize),
            }
        )
    nodes = node_costs(sched, itemsize)
    return CostReport(
        spec=derivation.spec.name,
        forward=sp.expand(flops([forward])),
        backward=sp.expand(flops(backward, given=[forward])),
        backward_derived=sp.expand(flops(gradients, given=[output])),
        rows=tuple(rows),
        itemsize=itemsize,
        nodes=nodes,
        savings=tuple(d_identity(sched, nodes)),
        generated_forward=None if generated is None else sp.expand(flops(generated[0])),
        generated_backward=None if generated is None else sp.expand(flops(generated[1], given=generated[0])),
    )


def schedule_values(s: Spec, sched: Schedule) -> tuple[list[Basic], list[Basic]] | None:
    """The forward and backward values of sched (s's schedule, ``schedule_of``), each name replaced by its definition.

    Costed as one DAG, every named value counts once. A built-in spec is costed as its generated
    modules compute it (None when built with non-default options: no module computes that one);
    a user's spec as its own schedule.
    """
    if s.name in specs() and s != spec(s.name):
        return None
    values: dict[Basic, Basic] = {}
    for a in (*sched.forward, *sched.backward):
        values[a.target] = rewrite(a.value, values.get)  # on the DAG: xreplace rebuilds a shared name per use
    return [values[a.target] for a in sched.forward], [values[a.target] for a in sched.backward]


def schedule_counts(s: Spec, sizes: Mapping[str, int]) -> tuple[float, float, int]:
    """(forward FLOPs, backward FLOPs, full arrays) of s's generated schedule at sizes: each named value counted
    once, and how many values of n × m entries (n² for self-attention; per head) it computes, views not counted."""
    forward, backward = schedule_values(s, schedule_of(s))
    dim = size_function(sizes)
    full = {sizes["n"] * sizes.get("m", sizes["n"]), sizes["n"] ** 2}
    arrays = sum(
        1
        for node in subexpressions([*forward, *backward])
        if not (isinstance(node, MatrixSymbol) or is_view(node)) and dim(node.shape[0]) * dim(node.shape[1]) in full
    )
    return float(flops(forward, sizes=sizes)), float(flops(backward, forward, sizes)), arrays


def schedule_of(s: Spec) -> Schedule:
    """The generated schedule of a spec: a built-in's as its modules compute it, else the spec's own."""
    if s.name in specs() and s == spec(s.name):
        return schedule(s.name)
    return schedule_spec(s)


def node_costs(sched: Schedule, itemsize: int = 4) -> tuple[NodeCost, ...]:
    """Every named value of the schedule, forward then backward, with its own FLOPs and bytes.

    A value's FLOPs and bytes are those of its line of generated code: the nodes of its definition
    down to the values it reads, which are not walked into (linear in the schedule). They add up
    to the schedule's count, less any part of a read value's definition that a line computes
    again (transformer_block's 𝟏γ in dN_1 and dN_2). Per-head values (Q_h, P_h, …) count all
    heads: the names are written out, so that the cost model sees the head split below them.
    """
    dim = size_function(None)
    full: dict[Basic, Basic] = {}
    nodes = []
    saved = set(sched.saved)
    for backward, part in ((False, sched.forward), (True, sched.backward)):
        for a in part:
            value = rewrite(a.value, full.get)
            reads = [full[x] for x in a.value.atoms(MatrixSymbol) if x in full]
            made = subexpressions([value], given=reads)  # the line's own operations, not the values it reads
            full[a.target] = value
            uses = tuple(sorted(str(x.name) for x in a.value.atoms(MatrixSymbol)))
            nodes.append(
                NodeCost(
                    name=str(a.target.name),
                    backward=backward,
                    shape=a.target.shape,
                    flops=sp.expand(sp.Add(*(node_flops(x, dim) for x in made))),
                    bytes=sp.expand(sp.Add(*(node_bytes(x, dim, itemsize) for x in made))),
                    saved=not backward and a.target in saved,
                    uses=uses,
                )
            )
    return tuple(nodes)


def d_identity(sched: Schedule, nodes: Sequence[NodeCost]) -> list[Saving]:
    """FlashAttention's D: a row sum rowsum(dO ⊙ O) where O = P V and P is a row softmax.

    dP = dO Vᵀ, so rowsum(dP ⊙ P) = rowsum(dO ⊙ (P V)) = rowsum(dO ⊙ O): the schedule
    reads O's entries (n × d_v) instead of P's (n × m). The saving is the entrywise
    product and row sum over P's entries less those over O's.
    """
    definitions = {a.target: a.value for a in sched.forward}
    cost = {n.name: n.flops for n in nodes}
    dim = size_function(None)
    full: dict[Basic, Basic] = {}
    for a in sched.forward:
        full[a.target] = rewrite(a.value, full.get)
    savings = []
    for a in sched.backward:
        if not (isinstance(a.value, RowSum) and isinstance(a.value.arg, HadamardProduct)):
            continue
        for o in a.value.arg.args:
            value = definitions.get(o)
            first = value.args[0] if isinstance(value, MatMul) else None
            if first is None or not isinstance(definitions.get(first), RowSoftmax):
                continue
            do = next(x for x in a.value.arg.args if x != o)
            p = str(first.name)
            instead = 2 * numel(full[first], dim)  # P's entries: one product and one sum each
            what = (
                f"the D identity {a.target.name} = rowsum({do} ⊙ {o}) in place of rowsum(d{p} ⊙ {p}) "
                f"(the rows of {p} sum to one)"
            )
            savings.append(Saving(what, sp.expand(instead - cost[str(a.target.name)])))
            break
    return savings


def _gflop(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e9:.3f}"
