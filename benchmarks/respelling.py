"""One function, one code? Each built-in and gallery spec spelled seven ways (issue 25, item 4).

``symattn.specs.respell.respellings`` writes each spec as written, with no intermediate named, every other
or a random half named, sums and entrywise products reversed, and each product's scalar moved onto a
factor or split over two, named. For each spelling this prints the forward and backward MFLOP of the
schedule ``symattn generate`` renders (values written out on its DAG, every named value once) and the
number of n × m arrays it computes, at n = 1024, m = 768, d_model = 256, d_k = 64, d_v = 48, 4 heads
(a built-in is costed as a user's spec, under another name). The same function should cost the same
whatever the spelling: a ratio above 1.00 is one the schedule does not see through.

With --time, each gallery spelling's generated NumPy and torch modules are also timed against torch eager
autograd of the gallery's independently written forward (``benchmarks/gallery.py``'s harness: one thread,
float32, n = 1024, d = 64, best of --repeat rounds taking turns).

    OMP_NUM_THREADS=1 python benchmarks/respelling.py [--time] [--repeat 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import runpy
from pathlib import Path

from symattn.codegen.report.cost_report import schedule_counts
from symattn.specs import spec, specs
from symattn.specs.files import load_spec_file
from symattn.specs.respell import respellings

ROOT = Path(__file__).resolve().parents[1]
GALLERY = ROOT / "examples" / "specs"
SIZES = {"n": 1024, "m": 768, "d_model": 256, "d_k": 64, "d_v": 48, "H": 4, "H_kv": 2, "d_ff": 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time the gallery's spellings against autograd")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    gallery = {p.stem: load_spec_file(p) for p in sorted(GALLERY.glob("*.py"))}
    built_in = {n: dataclasses.replace(spec(n), name=f"{n}_as_a_user_spec") for n in specs()}
    bench = runpy.run_path(str(ROOT / "benchmarks" / "gallery.py"))["bench"] if args.time else None
    timed = " numpy ÷ autograd | torch ÷ autograd |" if args.time else ""
    print(f"| spec | spelling | forward MFLOP | backward MFLOP | n × m arrays | backward ÷ as written |{timed}")
    print("|---|---|---:|---:|---:|---:|" + ("---:|---:|" if args.time else ""))
    for name, s in {**gallery, **built_in}.items():
        base = None
        for label, variant in respellings(s).items():
            fwd, bwd, full = schedule_counts(variant, SIZES)
            fwd, bwd = fwd / 1e6, bwd / 1e6
            base = base or bwd
            row = f"| {name} | {label} | {fwd:.1f} | {bwd:.1f} | {full} | {bwd / base:.2f} |"
            if bench is not None and name in gallery:
                t = bench(name, 1024, 64, args.repeat, spec=variant)
                row += f" {t['numpy']:.2f} | {t['torch']:.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
