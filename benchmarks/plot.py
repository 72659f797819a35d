"""The benchmark plots, drawn from the committed JSON results as SVG by hand (no plotting library).

- ``attention_grid.svg`` (attention_grid.json): forward + backward time of B × H × n × 64 attention as a ratio
  to torch's fused SDPA against n, without a mask and causal, for torch.compile, jax.jit and the generated
  modules (the README's speed plot);
- ``results.svg`` (results.json): single-head forward + backward time as a ratio to torch autograd's against n,
  float32 and float64, the generated modules beside SDPA;
- ``scaling.svg`` (scaling.json): seconds per command against the number of layers L, log-log, for the
  pre-LN and the residual stacks (benchmarks/scaling.py draws it with this module after a run).

Each title states the machine and the date the JSON records. The output depends on the JSON alone, so the
committed SVGs are checked byte for byte (tests/unit/test_benchmark_plots.py): after a benchmark run,

    python benchmarks/plot.py            # rewrites the three SVGs next to this file
    python benchmarks/plot.py --check    # exit 1 naming each stale SVG
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLOURS = {  # one colour per implementation on every plot; a phase of scaling.svg by its position
    "torch SDPA": "#1f77b4",
    "torch.compile": "#1f77b4",
    "jax.jit": "#d62728",
    "symattn NumPy": "#2ca02c",
    "symattn torch": "#9467bd",
    "symattn NumPy memeff": "#ff7f0e",
    "symattn torch memeff": "#8c564b",
}
PHASE_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
PANEL_WIDTH, PANEL_HEIGHT, LEFT, GAP, BOTTOM, LEGEND = 330, 260, 62, 80, 46, 200


@dataclass(frozen=True)
class Axis:
    """One axis: its label, log scale or not, the tick values (the range runs from the first to the last)."""

    label: str
    ticks: tuple[float, ...]
    log: bool = False
    unit: str = ""

    def fraction(self, value: float) -> float:
        """Where a value lies between the first and the last tick, 0 to 1."""
        lo, hi = self.ticks[0], self.ticks[-1]
        if self.log:
            return (math.log(value) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return (value - lo) / (hi - lo)

    def text(self, value: float) -> str:
        return f"{value:g}{self.unit}"


@dataclass(frozen=True)
class Series:
    """A line of points in a panel; its label, colour and dash make its legend entry."""

    label: str
    points: tuple[tuple[float, float], ...]
    colour: str
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    x: Axis
    y: Axis
    series: tuple[Series, ...]
    reference: tuple[float, str] | None = None  # a horizontal line and its label (SDPA = 1)


def chart(title: str, subtitle: tuple[str, ...], panels: list[Panel]) -> str:
    """Panels side by side under a title and lines of subtitle, one legend (every distinct label) on the right."""
    top = 44 + 15 * len(subtitle)
    width = LEFT + len(panels) * PANEL_WIDTH + (len(panels) - 1) * GAP + 20 + LEGEND
    height = top + PANEL_HEIGHT + BOTTOM
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    out += [f'<text x="{LEFT}" y="{34 + 15 * k}" fill="#555">{escape(line)}</text>' for k, line in enumerate(subtitle)]
    legend: dict[str, Series] = {}
    for k, panel in enumerate(panels):
        out += draw_panel(panel, LEFT + k * (PANEL_WIDTH + GAP), top)
        if panel.reference:
            legend.setdefault(panel.reference[1], Series(panel.reference[1], (), "black"))
        for s in panel.series:
            legend.setdefault(s.label, s)
    x0 = LEFT + len(panels) * PANEL_WIDTH + (len(panels) - 1) * GAP + 20
    for k, s in enumerate(legend.values()):
        y = top + 10 + 16 * k
        out.append(f'<line x1="{x0}" y1="{y - 4}" x2="{x0 + 22}" y2="{y - 4}" {stroke(s)}/>')
        out.append(f'<circle cx="{x0 + 11}" cy="{y - 4}" r="2.5" fill="{s.colour}"/>')
        out.append(f'<text x="{x0 + 28}" y="{y}">{escape(s.label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def draw_panel(panel: Panel, left: int, top: int) -> list[str]:
    """A panel's frame, grid, ticks, reference line and series, its plotting area's corner at (left, top)."""

    def px(x: float) -> str:
        return f"{left + panel.x.fraction(x) * PANEL_WIDTH:.1f}"

    def py(y: float) -> str:
        return f"{top + (1 - panel.y.fraction(y)) * PANEL_HEIGHT:.1f}"

    bottom = top + PANEL_HEIGHT
    out = [f'<text x="{left + PANEL_WIDTH / 2:.1f}" y="{top - 8}" text-anchor="middle">{escape(panel.title)}</text>']
    for x in panel.x.ticks:
        out.append(f'<line x1="{px(x)}" y1="{top}" x2="{px(x)}" y2="{bottom}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{px(x)}" y="{bottom + 15}" text-anchor="middle">{panel.x.text(x)}</text>')
    for y in panel.y.ticks:
        out.append(f'<line x1="{left}" y1="{py(y)}" x2="{left + PANEL_WIDTH}" y2="{py(y)}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 5}" y="{float(py(y)) + 4:.1f}" text-anchor="end">{panel.y.text(y)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{PANEL_WIDTH}" height="{PANEL_HEIGHT}" fill="none" stroke="#999"/>')
    out.append(
        f'<text x="{left + PANEL_WIDTH / 2:.1f}" y="{bottom + 34}" text-anchor="middle">{escape(panel.x.label)}</text>'
    )
    middle = top + PANEL_HEIGHT / 2
    out.append(
        f'<text x="{left - 44}" y="{middle:.1f}" text-anchor="middle" transform="rotate(-90 {left - 44} {middle:.1f})">'
        f"{escape(panel.y.label)}</text>"
    )
    if panel.reference:
        value = panel.reference[0]  # its label is in the legend
        out.append(
            f'<line x1="{left}" y1="{py(value)}" x2="{left + PANEL_WIDTH}" y2="{py(value)}" stroke="black" '
            'stroke-width="1.5"/>'
        )
    for s in panel.series:
        path = " ".join(f"{px(x)},{py(y)}" for x, y in s.points)
        out.append(f'<polyline points="{path}" fill="none" {stroke(s)}/>')
        out += [f'<circle cx="{px(x)}" cy="{py(y)}" r="2.5" fill="{s.colour}"/>' for x, y in s.points]
    return out


def stroke(s: Series) -> str:
    return f'stroke="{s.colour}" stroke-width="1.5"' + (' stroke-dasharray="5,3"' if s.dashed else "")


def escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def linear_ticks(values: list[float], step: float) -> tuple[float, ...]:
    """Multiples of step from the last one at or below the smallest value to the first one at or above the largest."""
    lo, hi = math.floor(min(values) / step + 1e-9), math.ceil(max(values) / step - 1e-9)
    return tuple(round(k * step, 6) for k in range(lo, hi + 1))


def log_ticks(values: list[float]) -> tuple[float, ...]:
    """1, 2, 5 times powers of ten (powers of ten alone over more than two decades), from the one at or below the
    smallest value to the one at or above the largest."""
    wide = max(values) / min(values) > 100
    grid = [m * 10.0**e for e in range(-4, 7) for m in ((1,) if wide else (1, 2, 5))]
    lo = max(t for t in grid if t <= min(values) * (1 + 1e-9))
    hi = min(t for t in grid if t >= max(values) * (1 - 1e-9))
    return tuple(t for t in grid if lo <= t <= hi)


def powers_of_two(values: list[float]) -> tuple[float, ...]:
    lo, hi = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    return tuple(2.0**e for e in range(lo, hi + 1))


def machine_text(machine: dict) -> str:
    return (
        f"{machine.get('cpu', 'CPU')}, {machine.get('logical_cpus', '?')} logical CPUs, "
        f"{machine.get('threads', 1)} thread; torch {machine['torch']}, NumPy {machine['numpy']}"
    )


GRID_RUNS = {  # attention_grid.json's runs: label, dashed
    "compile": ("torch.compile", True),
    "jax": ("jax.jit", True),
    "numpy": ("symattn NumPy", False),
    "torch": ("symattn torch", False),
    "numpy_memeff": ("symattn NumPy memeff", False),
    "torch_memeff": ("symattn torch memeff", False),
}


def attention_grid(record: dict) -> str:
    """Time ÷ SDPA's against n (B × H × n in the subtitle), without a mask and causal, float32."""
    cases = sorted((c for c in record["cases"] if c["dtype"] == "float32"), key=lambda c: c["n"])
    ratios = [r["ratio"] for c in cases for name, r in c["results"].items() if name in GRID_RUNS]
    x = Axis("n", powers_of_two([c["n"] for c in cases]), log=True)
    y = Axis("time ÷ SDPA's", linear_ticks([*ratios, 1.0], 0.5))
    panels = []
    for causal in (False, True):
        series = tuple(
            Series(
                label,
                tuple((c["n"], c["results"][name]["ratio"]) for c in cases if c["causal"] == causal),
                COLOURS[label],
                dash,
            )
            for name, (label, dash) in GRID_RUNS.items()
        )
        panels.append(Panel("causal" if causal else "no mask", x, y, series, (1.0, "torch SDPA = 1")))
    shapes = ", ".join(f"{c['batch']}×{c['heads']}×{c['n']}" for c in cases if not c["causal"])
    sdpa = ", ".join(f"{c['results']['sdpa']['time_s'] * 1e3:.0f}" for c in cases if not c["causal"])
    subtitle = (
        f"{record['date']}, {machine_text(record['machine'])}, JAX {record['jax']}",
        f"B×H×n: {shapes} (SDPA without a mask: {sdpa} ms); python benchmarks/attention_grid.py --write",
    )
    return chart("Attention forward + backward, float32, d = 64: time ÷ torch SDPA's (< 1: faster)", subtitle, panels)


RESULT_RUNS = {  # results.json's implementations besides the baseline (torch autograd): label, dashed
    "torch_sdpa": ("torch SDPA", True),
    "numpy_generated": ("symattn NumPy", False),
    "torch_generated": ("symattn torch", False),
    "numpy_generated_memeff": ("symattn NumPy memeff", False),
    "torch_generated_memeff": ("symattn torch memeff", False),
}


def results(record: dict) -> str:
    """Single-head forward + backward, time ÷ torch autograd's against n, one panel per dtype."""
    single = [c for c in record["cases"] if c["heads"] == 0]
    ratios = [r["ratio"] for c in single for name, r in c["results"].items() if name in RESULT_RUNS]
    x = Axis("n (single head, d = 64)", powers_of_two([c["n"] for c in single]), log=True)
    y = Axis("time ÷ torch autograd's", linear_ticks([*ratios, 1.0], 0.25))
    panels = []
    for dtype in sorted({c["dtype"] for c in single}, key=lambda d: d != "float32"):
        cases = sorted((c for c in single if c["dtype"] == dtype), key=lambda c: c["n"])
        series = tuple(
            Series(label, tuple((c["n"], c["results"][name]["ratio"]) for c in cases), COLOURS[label], dash)
            for name, (label, dash) in RESULT_RUNS.items()
        )
        autograd = ", ".join(f"{c['results']['torch_autograd']['time_s'] * 1e3:.1f}" for c in cases)
        panels.append(Panel(f"{dtype} (autograd: {autograd} ms)", x, y, series, (1.0, "torch autograd = 1")))
    date = f"{record['date']}, " if "date" in record else ""
    subtitle = (date + machine_text(record["machine"]), "python benchmarks/run.py --write")
    return chart("Single-head attention, forward + backward: time ÷ torch autograd's (< 1: faster)", subtitle, panels)


PHASES = ("derive", "verify", "generate", "import")
FAMILIES = {"prenorm": "pre-LN Transformer blocks", "residual": "residual attention layers"}


def scaling(record: dict) -> str:
    """Seconds per command against layers, log-log; the newest run solid, any other (a compared checkout) dashed."""
    runs = record["runs"]
    newest = list(runs)[-1]
    finished = [
        (label, family, phase, [(int(d), e[phase]["seconds"]) for d, e in run[family].items() if e[phase]["seconds"]])
        for label, run in runs.items()
        for family in FAMILIES
        if family in run
        for phase in PHASES
    ]
    seconds = [s for *_, pts in finished for _, s in pts]
    x = Axis("layers L", powers_of_two([d for *_, pts in finished for d, _ in pts]), log=True)
    y = Axis("seconds (cold start)", log_ticks(seconds), log=True, unit=" s")
    panels = []
    for family, title in FAMILIES.items():
        series = tuple(
            Series(
                phase if label == newest else f"{phase} ({label})",
                tuple(sorted(pts)),
                PHASE_COLOURS[PHASES.index(phase)],
                label != newest,
            )
            for label, fam, phase, pts in finished
            if fam == family and pts
        )
        panels.append(Panel(title, x, y, series))
    meta = runs[newest].get("meta", {})
    subtitle = (
        f"{newest}, {meta.get('machine', '')}, one thread, each command capped at {meta.get('cap', '?')} s",
        "python benchmarks/scaling.py",
    )
    return chart("Seconds per command against the depth of a spec", subtitle, panels)


PLOTS = {"attention_grid.svg": ("attention_grid.json", attention_grid), "results.svg": ("results.json", results)}
PLOTS["scaling.svg"] = ("scaling.json", scaling)


def drawn(folder: Path = HERE) -> dict[str, str]:
    """Each plot's SVG text from the JSON in folder, by file name."""
    return {name: draw(json.loads((folder / source).read_text())) for name, (source, draw) in PLOTS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale SVG")
    parser.add_argument("--dir", default=str(HERE), help="the folder of the JSON results and the SVGs")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    stale = []
    for name, text in drawn(folder).items():
        path = folder / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    for name in stale:
        print(f"stale: {folder / name} (python benchmarks/plot.py rewrites it)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
