"""The report of ``symattn derive SPEC --cost``: FLOPs and peak temporaries, forward and backward.

Three counts of the backward: as derived (each gradient's closed form, shared
subexpressions once), simplified (``simplify_all`` over the forward and every
gradient) and, for a built-in spec with its default options, the generated schedule's
assignments (each named value computed once, names free).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sympy as sp
from sympy import Basic

from symattn.codegen.schedule import schedule, schedule_spec
from symattn.lang.shapes import dimension_symbols
from symattn.optimize.cost import (
    TYPICAL_SIZES,
    flops,
    largest_temporaries,
    peak_bytes,
    subexpressions,
)
from symattn.specs import Spec, spec, specs

# Sizes at which the report evaluates its symbolic counts: single-head n = m, d = 64, and H = 8 heads of 64.
REPORT_SIZES: tuple[dict[str, int], ...] = tuple({**TYPICAL_SIZES, "n": n, "m": n} for n in (128, 512, 2048, 4096))


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
    largest: tuple[tuple[str, Basic], ...]  # (name or expression, symbolic entries)
    generated_forward: Basic | None = None  # the generated schedule's (a built-in spec, default options)
    generated_backward: Basic | None = None
    itemsize: int = 4  # bytes per entry of the peaks

    def text(self) -> str:
        """The report as aligned plain text."""
        lines = [
            f"cost of {self.spec} (FLOPs: products 2·a·b·c, one per entry elsewhere; shared subexpressions once)",
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
            "  largest temporaries (entries):",
            *(f"    {entries}: {what}" for what, entries in self.largest),
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
    backward, names = rest[: len(gradients)], {}
    for (name, _), e in zip(named, rest[len(gradients) :]):
        names.setdefault(e, name)
    computed = set(subexpressions([forward]))
    # the forward values the backward reads directly (in a fixed order: the peak depends on it)
    read = (a for n in subexpressions(backward) if n not in computed for a in n.args if a in computed)
    saved = list(dict.fromkeys(read))
    generated = schedule_values(derivation.spec)
    rows = []
    for table in sizes:
        used = {k: v for k, v in table.items() if any(k == s.name for s in dimension_symbols(output))}
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
    largest = tuple(
        (_describe(node, names), count) for node, count in largest_temporaries([forward, *backward], count=4)
    )
    return CostReport(
        spec=derivation.spec.name,
        forward=sp.expand(flops([forward])),
        backward=sp.expand(flops(backward, given=[forward])),
        backward_derived=sp.expand(flops(gradients, given=[output])),
        rows=tuple(rows),
        largest=largest,
        itemsize=itemsize,
        generated_forward=None if generated is None else sp.expand(flops(generated[0])),
        generated_backward=None if generated is None else sp.expand(flops(generated[1], given=generated[0])),
    )


def schedule_values(s: Spec) -> tuple[list[Basic], list[Basic]] | None:
    """The generated schedule's forward and backward values, each name replaced by its definition.

    Costed as one DAG, every named value counts once. A built-in spec is costed as its generated
    modules compute it (None when built with non-default options: no module computes that one);
    a user's spec as its own schedule.
    """
    if s.name in specs():
        if s != spec(s.name):
            return None
        sched = schedule(s.name)
    else:
        sched = schedule_spec(s)
    values: dict[Basic, Basic] = {}
    for a in (*sched.forward, *sched.backward):
        values[a.target] = a.value.xreplace(values)
    return [values[a.target] for a in sched.forward], [values[a.target] for a in sched.backward]


def _gflop(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e9:.3f}"


def _describe(node: Basic, names: dict[Basic, str], width: int = 70) -> str:
    """The intermediate's name where node is one (P, S_h, …), else the expression, shortened."""
    if node in names:
        return names[node]
    text = str(node)
    return text if len(text) <= width else text[: width - 1] + "…"
