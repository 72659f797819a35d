"""The benchmark plots, drawn from the committed JSON results as SVG by matplotlib (the ``bench`` extra).

- ``attention_grid.svg`` (attention_grid.json): forward + backward time of B × H × n × 64 attention as a ratio
  to torch's fused SDPA against n, without a mask and causal, for torch.compile, jax.jit and the generated
  modules (the README's speed plot);
- ``results.svg`` (results.json): single-head forward + backward time as a ratio to torch autograd's against n,
  float32 and float64, the generated modules beside SDPA;
- ``scaling.svg`` (scaling.json): seconds per command against the number of layers L, log-log, for the
  pre-LN and the residual stacks (benchmarks/scaling.py draws it with this module after a run).

Each title states the machine and the date the JSON records. The SVG depends on the JSON and the matplotlib
version alone (no date or version in its metadata, a fixed hash salt for its ids, text kept as text), so the
committed SVGs are checked byte for byte (tests/unit/test_benchmark_plots.py): after a benchmark run,

    python benchmarks/plot.py            # rewrites the three SVGs next to this file
    python benchmarks/plot.py --check    # exit 1 naming each stale SVG
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.style
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullLocator

matplotlib.use("Agg")  # files only, no display (a Figure made without pyplot needs none; a later pyplot gets none)

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
STYLE = {  # the same bytes for the same JSON: ids from a fixed salt, text as <text> (no glyph paths)
    "svg.hashsalt": "symattn-benchmarks",
    "svg.fonttype": "none",
    "font.family": "DejaVu Sans",  # shipped with matplotlib: the same metrics, so the same layout, everywhere
    "font.size": 9,
    "text.parse_math": False,  # a machine name with a $ is text
    "axes.grid": True,
    "grid.color": "#e5e5e5",
}
METADATA = {"Date": None, "Creator": None}  # no clock and no matplotlib version in the file
DRAWN_BY = "3.11.2"  # the matplotlib that drew the committed SVGs (the test extra pins it): another draws other bytes
PANEL_SIZE, LEGEND_WIDTH, TITLE_HEIGHT, LINE_HEIGHT = (4.0, 3.3), 1.9, 0.35, 0.2  # inches


@dataclass(frozen=True)
class Series:
    """A line of points in a panel; its label, colour and dash make its legend entry."""

    label: str
    points: tuple[tuple[float, float], ...]
    colour: str
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    """One plotting area: its title, its lines and a labelled horizontal reference line (SDPA = 1)."""

    title: str
    series: tuple[Series, ...]
    reference: tuple[float, str] | None = None


@dataclass(frozen=True)
class Chart:
    """Panels side by side sharing both axes (x log base 2; y linear, or log with ticks at 1, 2 and 5 × 10^k)."""

    title: str
    subtitle: tuple[str, ...]
    xlabel: str
    ylabel: str
    panels: tuple[Panel, ...]
    ylog: bool = False
    yunit: str = ""


def svg(chart: Chart) -> str:
    """The chart as SVG text: a bold title and grey subtitle lines, the panels, one legend on the right."""
    with matplotlib.style.context(["default", STYLE]):  # from matplotlib's defaults: no matplotlibrc of the caller's
        figure = draw(chart)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="svg", metadata=METADATA)
    return buffer.getvalue().decode("utf-8")


def draw(chart: Chart) -> Figure:
    """The figure: a heading band of fixed height above constrained-layout panels and an outside legend."""
    width = PANEL_SIZE[0] * len(chart.panels) + LEGEND_WIDTH
    heading = TITLE_HEIGHT + LINE_HEIGHT * len(chart.subtitle)
    height = PANEL_SIZE[1] + heading
    figure = Figure(figsize=(width, height), layout="constrained")
    figure.get_layout_engine().set(rect=(0, 0, 1, 1 - heading / height))  # the band above is the heading's
    figure.text(0.01, 1 - 0.1 / height, chart.title, va="top", size=11, weight="bold")
    figure.text(0.01, 1 - TITLE_HEIGHT / height, "\n".join(chart.subtitle), va="top", color="#555555")
    axes = figure.subplots(1, len(chart.panels), sharex=True, sharey=True, squeeze=False)[0]
    for ax, panel in zip(axes, chart.panels):
        draw_panel(ax, panel)
        ax.set_xlabel(chart.xlabel)
    axes[0].set_ylabel(chart.ylabel)
    scale_axes(axes[0], chart)
    legend = {}  # every distinct label once, in the order drawn
    for ax in axes:
        legend.update((label, handle) for handle, label in zip(*ax.get_legend_handles_labels()))
    figure.legend(legend.values(), legend.keys(), loc="outside right center", frameon=False)
    return figure


def draw_panel(ax: Axes, panel: Panel) -> None:
    """A panel's reference line and series, dots at the points, dashed where the series says so."""
    ax.set_title(panel.title)
    if panel.reference:
        value, label = panel.reference
        ax.axhline(value, color="black", linewidth=1.5, label=label)
    for s in panel.series:
        xs, ys = zip(*s.points)
        ax.plot(xs, ys, color=s.colour, linestyle="--" if s.dashed else "-", marker="o", markersize=3, label=s.label)


def scale_axes(ax: Axes, chart: Chart) -> None:
    """x log base 2 with its powers of two written out; y log (1, 2, 5 × 10^k, the unit after) or linear."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter("{x:g}")
    ax.xaxis.set_minor_locator(NullLocator())
    if chart.ylog:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter("{x:g}" + chart.yunit)


def machine_text(machine: dict) -> str:
    """The CPU, its logical CPUs, the thread count and the torch and NumPy versions, in one line."""
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
        panels.append(Panel("causal" if causal else "no mask", series, (1.0, "torch SDPA = 1")))
    shapes = ", ".join(f"{c['batch']}×{c['heads']}×{c['n']}" for c in cases if not c["causal"])
    sdpa = ", ".join(f"{c['results']['sdpa']['time_s'] * 1e3:.0f}" for c in cases if not c["causal"])
    subtitle = (
        f"{record['date']}, {machine_text(record['machine'])}, JAX {record['jax']}",
        f"B×H×n: {shapes} (SDPA without a mask: {sdpa} ms); python benchmarks/attention_grid.py --write",
    )
    title = "Attention forward + backward, float32, d = 64: time ÷ torch SDPA's (< 1: faster)"
    return svg(Chart(title, subtitle, "n", "time ÷ SDPA's", tuple(panels)))


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
    panels = []
    for dtype in sorted({c["dtype"] for c in single}, key=lambda d: d != "float32"):
        cases = sorted((c for c in single if c["dtype"] == dtype), key=lambda c: c["n"])
        series = tuple(
            Series(label, tuple((c["n"], c["results"][name]["ratio"]) for c in cases), COLOURS[label], dash)
            for name, (label, dash) in RESULT_RUNS.items()
        )
        autograd = ", ".join(f"{c['results']['torch_autograd']['time_s'] * 1e3:.1f}" for c in cases)
        panels.append(Panel(f"{dtype} (autograd: {autograd} ms)", series, (1.0, "torch autograd = 1")))
    date = f"{record['date']}, " if "date" in record else ""
    subtitle = (date + machine_text(record["machine"]), "python benchmarks/run.py --write")
    title = "Single-head attention, forward + backward: time ÷ torch autograd's (< 1: faster)"
    return svg(Chart(title, subtitle, "n (single head, d = 64)", "time ÷ torch autograd's", tuple(panels)))


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
        panels.append(Panel(title, series))
    meta = runs[newest].get("meta", {})
    subtitle = (
        f"{newest}, {meta.get('machine', '')}, one thread, each command capped at {meta.get('cap', '?')} s",
        "python benchmarks/scaling.py",
    )
    title = "Seconds per command against the depth of a spec"
    return svg(Chart(title, subtitle, "layers L", "seconds (cold start)", tuple(panels), ylog=True, yunit=" s"))


PLOTS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "attention_grid.svg": ("attention_grid.json", attention_grid),
    "results.svg": ("results.json", results),
    "scaling.svg": ("scaling.json", scaling),
}


def drawn(folder: Path = HERE) -> dict[str, str]:
    """Each plot's SVG text from the JSON in folder, by file name."""
    return {
        name: draw_plot(json.loads((folder / source).read_text(encoding="utf-8")))
        for name, (source, draw_plot) in PLOTS.items()
    }


def main(argv: list[str] | None = None) -> int:
    """Write the SVGs beside their JSON, or with --check write nothing and name each stale one (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale SVG")
    parser.add_argument("--dir", default=str(HERE), help="the folder of the JSON results and the SVGs")
    args = parser.parse_args(argv)
    folder = Path(args.dir)
    stale = []
    for name, text in drawn(folder).items():
        path = folder / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for name in stale:
        print(f"stale: {folder / name} (python benchmarks/plot.py rewrites it)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
