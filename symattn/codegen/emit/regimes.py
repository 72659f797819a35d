"""A module with one schedule per size regime (``schedule.regimes``): the contexts of its schedules made one.

Each function a schedule shapes (the forward, the backward, the second closed form's, the JVP) runs its
regime's statements in a branch: ``schedule = _schedule_at(dims)`` chooses, from the arrays' shapes, the
schedule whose FLOPs (a polynomial per regime) are fewest; the forward saves the choice, and the backward takes
the branch of the schedule that made what it reads. Everything else (signatures, checks, the Function, the
nn.Module) is the first regime's. The branches' statements are laid out one level deeper (``layout``), as ruff
format lays them out; the runtime helpers are the union of the regimes'.
"""

from __future__ import annotations

import dataclasses

import sympy as sp

from symattn.codegen.emit import layout
from symattn.codegen.emit.sections import Statement
from symattn.codegen.schedule.regimes import Regime

__all__ = ["CHOOSE", "merged"]

CHOOSE = "_schedule_at"  # the module's function that picks a schedule from the dimensions
DEEPER = 4  # a branch's statements stand this much deeper than the function body's


def merged(
    firsts: list[dict], seconds: list[dict | None], forwards: list[dict | None], found: list[Regime], printer
) -> tuple[dict, dict | None, dict | None]:
    """The contexts of the first regime, given every regime's statements (``regimes``) and the choosing call."""
    first, second, forward = firsts[0], seconds[0], forwards[0]
    if len(found) == 1:
        return first | {"regimes": [first], "choose": ""}, _single(second), _single(forward)
    symbols = sorted(set().union(*(r.flops.free_symbols for r in found)), key=str)
    choose = f"{CHOOSE}({', '.join(map(str, symbols))})"
    runtime = _union([c["helpers"] for c in firsts])
    first = first | {
        "regimes": [_deeper_functions(c) for c in firsts],
        "choose": choose,
        "needs_dtype": any(c["needs_dtype"] for c in firsts),
        "constants": [c for c in first["every_constant"] if any(c in r["constants"] for r in firsts)],
        "helpers": runtime,
        "runtime": printer.runtime_source(runtime) + "\n\n\n" + _choosing_function(found, symbols, printer),
    }
    if second is not None:
        extra = [h for h in _union([s["helpers"] for s in seconds]) if h not in runtime]
        second = second | {
            "regimes": [_deeper_functions(s) for s in seconds],
            "needs_dtype": any(s["needs_dtype"] for s in seconds),
            "runtime": printer.runtime_source(extra) if extra else "",
            "helpers": extra,
            "long_lines": any(s["long_lines"] for s in seconds),
        }
        runtime = [*runtime, *extra]
    if forward is not None:
        extra = [h for h in _union([f["helpers"] for f in forwards]) if h not in runtime]
        forward = forward | {
            "regimes": [f | {"sections": [_deeper(s) for s in f["sections"]]} for f in forwards],
            "needs_dtype": any(f["needs_dtype"] for f in forwards),
            "runtime": printer.runtime_source(extra) + "\n\n\n" if extra else "",
        }
    return first, second, forward


def _single(ctx: dict | None) -> dict | None:
    return None if ctx is None else ctx | {"regimes": [ctx]}


def _union(lists: list[list[str]]) -> list[str]:
    return list(dict.fromkeys(name for names in lists for name in names))


def _choosing_function(found: list[Regime], symbols: list, printer) -> str:
    """def _schedule_at(dims): the index of the regime whose FLOPs are fewest at these sizes (the first of equals)."""
    lines = [
        layout.define(CHOOSE, [str(s) for s in symbols], indent=0),
        '    """The cheapest of the module\'s schedules at these sizes: FLOPs of one forward and backward of each."""',
    ]
    for i, r in enumerate(found):
        value = printer.doprint(sp.expand(r.flops))
        lines.append(f"    cost_{i} = {layout.assigned(f'cost_{i}', value, 4)}")
    lines.append(f"    costs = ({', '.join(f'cost_{i}' for i in range(len(found)))})")
    # a loop of comparisons, which torch.compile guards on (with shapes that are symbols too): an int it saves
    lines += ["    best = 0", "    for i, cost in enumerate(costs):", "        if cost < costs[best]:"]
    lines += ["            best = i", "    return best"]
    return "\n".join(lines)


def _deeper_functions(ctx: dict) -> dict:
    """A first or second closed form's context with its forward's and backward's statements a level deeper."""
    return ctx | {
        "forward_sections": [_deeper(s) for s in ctx["forward_sections"]],
        "backward_sections": [_deeper(s) for s in ctx["backward_sections"]],
        "return_gradients": layout.shifted(
            layout.wrapped(*ctx["returned_gradients"], "", indent=4 + DEEPER, brackets="{}"), DEEPER
        ),
    }


def _deeper(section: dict) -> dict:
    """A section laid out a level deeper: its statements broken for the column of a branch."""
    if not section.get("loop"):
        return section | {"lines": [_statement(line, 4) for line in section["lines"]]}
    return section | {
        "key_lines": [_statement(line, 8) for line in section["key_lines"]],
        "map_lines": [_statement(line, 4) for line in section["map_lines"]],
        "body": [_statement(line, 8) for line in section["body"]],
        "accumulate": [dataclasses.replace(line, deeper=DEEPER) for line in section["accumulate"]],
    }


def _statement(line: Statement, column: int) -> Statement:
    """A statement the template writes at column, broken for a branch's column (DEEPER more)."""
    value = layout.assigned(line.target, layout.flattened(line.value), column + DEEPER)
    return dataclasses.replace(line, value=layout.shifted(value, DEEPER), deeper=DEEPER)
