"""The picture of a computation: a spec's generated schedule as a Graphviz dataflow graph.

Nodes are the inputs, the named forward values (S, P, O, …) and, with the backward, the
output's cotangent, the named backward values (dP, D, …) and the gradients; an edge
A → B says that B's definition reads A. Each value is labelled with its shape and its
FLOPs (``cost_report.node_costs``: the cost model on the schedule); a forward value the
backward reads is saved for the backward and drawn with a double border. ``dot_source``
writes the DOT text; ``render`` runs Graphviz's ``dot`` for SVG or PNG.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence

from sympy import MatrixSymbol

from symattn.codegen.report.cost_report import NodeCost, formula, node_costs, schedule_of
from symattn.codegen.schedule.build import Schedule
from symattn.errors import SymattnError
from symattn.specs import Spec

FORMATS = ("svg", "png", "dot")

# fill colours by kind: inputs, forward values, backward values, gradients
STYLE = {
    "input": 'shape=ellipse, style=filled, fillcolor="#eeeeee"',
    "forward": 'shape=box, style="rounded,filled", fillcolor="#dbe9f6"',
    "backward": 'shape=box, style="rounded,filled", fillcolor="#fde2c8"',
    "gradient": 'shape=box, style="rounded,filled,bold", fillcolor="#f8c291"',
}
SAVED = "peripheries=2"  # saved for the backward
SAVED_EDGE = ' [style=dashed, color="#1f77b4"]'  # a saved value read by the backward


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(*lines: str) -> str:
    return _quote("\n".join(lines)).replace("\n", "\\n")


def _shape(symbol: MatrixSymbol) -> str:
    return f"{formula(symbol.shape[0])} × {formula(symbol.shape[1])}"


def dot_source(sched: Schedule, nodes: Sequence[NodeCost], backward: bool = False) -> str:
    """The DOT text of the forward dataflow, and with backward the backward pass beside it."""
    drawn = [n for n in nodes if backward or not n.backward]
    names = {n.name for n in drawn}
    gradients = {str(symbol.name): name for name, symbol in sched.gradients}
    gradients.update({str(symbol.name): name for name, symbol in sched.constant_gradients})
    symbols = {str(s.name): s for s in (*sched.spec.inputs, *sched.spec.constants) if isinstance(s, MatrixSymbol)}
    symbols[str(sched.seed.name)] = sched.seed
    used = {u for n in drawn for u in n.uses if u not in names and u in symbols}
    title = f"{sched.spec.name}: {'forward and backward' if backward else 'forward'} dataflow"
    out = [
        "digraph dataflow {",
        f"  label={_quote(title + ' (FLOPs per value; double border: saved for the backward, dashed: read by it)')};",
        '  labelloc=t; rankdir=TB; fontname="Helvetica"; nodesep=0.25; ranksep=0.35;',
        '  node [fontname="Helvetica", fontsize=11]; edge [color="#555555", arrowsize=0.7];',
    ]
    for name in sorted(used, key=lambda u: (u == str(sched.seed.name), list(symbols).index(u))):
        label = "G = ∂f/∂" + str(sched.output.name) if name == str(sched.seed.name) else name
        out.append(f"  {_quote(name)} [label={_label(label, _shape(symbols[name]))}, {STYLE['input']}];")
    for part in (False, True):
        members = " ".join(_quote(n.name) for n in drawn if n.backward == part)
        if members:
            name, colour = ("backward", "#f3a86b") if part else ("forward", "#7fa9d1")
            out.append(f'  subgraph cluster_{name} {{ label="{name}"; color="{colour}"; style=dashed; {members}; }}')
    for n in drawn:
        kind = "gradient" if n.name in gradients else ("backward" if n.backward else "forward")
        title = f"{n.name} = ∂f/∂{gradients[n.name]}" if n.name in gradients else n.name
        if n.name == str(sched.output.name):
            title += " (output)"
        shape = f"{formula(n.shape[0])} × {formula(n.shape[1])}"
        attrs = STYLE[kind] + (", " + SAVED if n.saved else "")
        out.append(f"  {_quote(n.name)} [label={_label(title, shape, formula(n.flops) + ' FLOPs')}, {attrs}];")
    forward = {n.name for n in drawn if not n.backward}
    for n in drawn:
        for u in n.uses:
            if u in names or u in used:
                saved_read = n.backward and u in forward  # the backward reading a saved forward value
                out.append(f"  {_quote(u)} -> {_quote(n.name)}{SAVED_EDGE if saved_read else ''};")
    out.append("}")
    return "\n".join(out) + "\n"


def picture(s: Spec, backward: bool = False, fmt: str = "svg") -> bytes:
    """The spec's dataflow (forward, or forward and backward) as SVG, PNG or DOT text."""
    if fmt not in FORMATS:
        raise SymattnError(f"unknown picture format {fmt!r}; choose from {', '.join(FORMATS)}")
    sched = schedule_of(s)
    source = dot_source(sched, node_costs(sched), backward)
    return source.encode() if fmt == "dot" else render(source, fmt)


def render(source: str, fmt: str) -> bytes:
    """Graphviz's dot run on the source: SVG or PNG bytes (SymattnError when dot is not installed)."""
    program = shutil.which("dot")
    if program is None:
        raise SymattnError(
            "the picture needs Graphviz's `dot` program, which is not installed "
            "(Debian: apt-get install graphviz); --format dot writes the DOT text without it"
        )
    done = subprocess.run([program, f"-T{fmt}"], input=source.encode(), capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise SymattnError(f"Graphviz's dot failed: {message[-1] if message else f'exit status {done.returncode}'}")
    return done.stdout


__all__ = ["FORMATS", "dot_source", "picture", "render"]
