"""Cold start: seconds to derive (every printed chain), simplify and generate the whole gallery
(examples/specs) and the built-in specs, in one fresh process, one thread.

    OMP_NUM_THREADS=1 python benchmarks/cold_start.py

Target (issue 12): at most 5 s. Prints one line per part and the total.
"""

from __future__ import annotations

import time
from pathlib import Path

T0 = time.perf_counter()

import symattn as sa  # noqa: E402  (the import is part of the cold start)
from symattn.codegen.generate import BACKENDS, render  # noqa: E402
from symattn.specs import family  # noqa: E402
from symattn.specs.files import load_spec_file  # noqa: E402

GALLERY = Path(__file__).resolve().parents[1] / "examples" / "specs"


def main() -> None:
    parts = {"import": time.perf_counter() - T0}
    start = time.perf_counter()
    gallery = [load_spec_file(p) for p in sorted(GALLERY.glob("*.py"))]
    for s in gallery:
        sa.derive(s).text()
        for backend in BACKENDS:
            render(s, backend)
    parts[f"gallery ({len(gallery)} specs): derive + generate"] = time.perf_counter() - start
    start = time.perf_counter()
    for name in sa.specs():
        sa.derive(name).text()
        for backend in BACKENDS:
            for variant in BACKENDS[backend].variants:
                if variant == "memeff" and not family(name).row_blocks:
                    continue
                render(name, backend, variant)
    parts[f"built-ins ({len(sa.specs())} specs): derive + generate"] = time.perf_counter() - start
    for part, seconds in parts.items():
        print(f"{part:45s} {seconds:6.2f} s")
    print(f"{'total (cold start)':45s} {time.perf_counter() - T0:6.2f} s")


if __name__ == "__main__":
    main()
