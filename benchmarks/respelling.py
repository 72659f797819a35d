"""One function, one code? The generated FLOPs of each gallery spec spelled three ways (issue 25, item 4).

Each spec of examples/specs is costed as written, with no intermediate named, and with every other one
named: the forward and backward FLOPs of the schedule `symattn generate` renders (values written out on
its DAG, every named value once), at n = m = 1024, d_model = 256, d_k = d_v = 64. The same function
should cost the same whatever was named; a ratio above 1.00 is a spelling the schedule does not yet see
through.

    python benchmarks/respelling.py
"""

from __future__ import annotations

import runpy
from pathlib import Path

import symattn as sa
from symattn.codegen.cost_report import schedule_of, schedule_values
from symattn.optimize.cost import flops

SIZES = {"n": 1024, "m": 1024, "d_model": 256, "d_k": 64, "d_v": 64}
GALLERY = Path(__file__).resolve().parents[1] / "examples" / "specs"


def spellings(s: sa.Spec) -> dict[str, sa.Spec]:
    """The spec as written, with no intermediate named, and with every other intermediate named."""
    named = {"as written": s.intermediates, "none named": (), "every other": s.intermediates[::2]}
    return {
        k: sa.Spec(s.name, s.summary, s.inputs, s.output, v, s.options, s.dims, s.constants) for k, v in named.items()
    }


def cost(s: sa.Spec) -> tuple[float, float]:
    """(forward, backward) MFLOP of the generated schedule at SIZES."""
    forward, backward = schedule_values(s, schedule_of(s))
    return float(flops(forward, sizes=SIZES)) / 1e6, float(flops(backward, forward, SIZES)) / 1e6


def main() -> None:
    print("| spec | spelling | forward MFLOP | backward MFLOP | backward ÷ as written |")
    print("|---|---|---:|---:|---:|")
    for path in sorted(GALLERY.glob("*.py")):
        spec = runpy.run_path(str(path))["spec"]
        spec = spec() if callable(spec) else spec
        base = None
        for label, variant in spellings(spec).items():
            fwd, bwd = cost(variant)
            base = base or bwd
            print(f"| {spec.name} | {label} | {fwd:.1f} | {bwd:.1f} | {bwd / base:.2f} |")


if __name__ == "__main__":
    main()
