"""Benchmark symattn's generated backends against torch on the CPU, single-threaded, in one process.

For every case (single-head attention, multi-head attention; float32 and float64)
it times forward + backward of each implementation (the best of repeats after a
warm-up, implementations taking turns so that outside load falls on all alike;
the median is kept too) and reports:

- the time ratio to the baseline (torch autograd of a plain torch forward for
  single-head cases, ``torch.nn.MultiheadAttention`` for multi-head cases);
- the fraction of the GEMM peak measured in the same run (a 2048³ matmul per
  library and dtype, before and after the cases, the better kept): useful FLOPs
  from symattn's cost model (forward + backward, hand-optimal 12·n²·d for a head)
  divided by time, over the peak;
- peak extra memory of one untimed forward + backward, inputs excluded: NumPy
  allocations through ``tracemalloc`` (NumPy reports its buffers to it), torch CPU
  allocations through the profiler's memory events (running sum of allocated minus
  freed bytes);
- the largest relative error of the output and every gradient against torch
  autograd in the same dtype.

Also timed: deriving, simplifying and generating every built-in spec from a cold
start (a fresh interpreter). Each case is printed as it finishes; ``--write`` also writes
``results.json`` and ``RESULTS.md`` (next to this file, or under ``--out DIR``).
Run ``python benchmarks/run.py --write`` (``--quick`` for tiny sizes, a smoke test).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
    os.environ[_var] = "1"  # before numpy and torch load their thread pools

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import implementations as impl  # noqa: E402
import report  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One benchmark: single-head (heads = 0) or multi-head attention at one size and dtype."""

    n: int
    d: int
    dtype: str
    batch: int = 1
    heads: int = 0  # 0: single-head attention(Q, K, V) with d = d_k = d_v

    @property
    def label(self) -> str:
        if not self.heads:
            return f"single-head n={self.n} d={self.d}"
        return f"mha B={self.batch} n={self.n} d_model={self.d} H={self.heads}"

    @property
    def spec(self) -> str:
        return "mha" if self.heads else "attention"


def full_cases() -> list[Case]:
    shapes = [Case(n, 64, "") for n in (128, 512, 2048, 4096)]
    shapes += [Case(256, 512, "", batch=4, heads=8), Case(1024, 256, "", batch=1, heads=4)]
    return [Case(c.n, c.d, dtype, c.batch, c.heads) for dtype in ("float32", "float64") for c in shapes]


def quick_cases() -> list[Case]:
    shapes = [Case(32, 8, ""), Case(16, 16, "", batch=2, heads=2)]
    return [Case(c.n, c.d, dtype, c.batch, c.heads) for dtype in ("float32", "float64") for c in shapes]


def repeats_for(step_seconds: float, quick: bool) -> int:
    """About two seconds of repeats per implementation, 3 to 10 of them (the full run stays within minutes)."""
    if quick:
        return 2
    return max(3, min(10, int(2.0 / max(step_seconds, 1e-9))))


def gemm_peak(quick: bool) -> dict[str, float]:
    """GFLOP/s of a large square matmul, per library and dtype (best of a few)."""
    size = 256 if quick else 2048
    peaks = {}
    for dtype in ("float32", "float64"):
        a = np.random.default_rng(0).standard_normal((size, size)).astype(dtype)
        best = min(_timed(lambda a=a: a @ a) for _ in range(5))
        peaks[f"numpy/{dtype}"] = 2 * size**3 / best / 1e9
        if impl.torch is not None:
            t = impl.torch.from_numpy(a)
            best = min(_timed(lambda t=t: t @ t) for _ in range(5))
            peaks[f"torch/{dtype}"] = 2 * size**3 / best / 1e9
    return peaks


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_flops(case: Case) -> float:
    """Forward + backward FLOPs of the simplified schedule (symattn.optimize.cost), for the whole batch."""
    from symattn.codegen.report.cost_report import cost_report

    if case.spec not in _REPORTS:
        _REPORTS[case.spec] = cost_report(case.spec, sizes=())
    r = _REPORTS[case.spec]
    sizes = {"n": case.n, "m": case.n, "d_k": case.d, "d_v": case.d}
    if case.heads:
        sizes = {"n": case.n, "m": case.n, "d_k": case.d // case.heads, "H": case.heads}
    total = (r.forward + r.backward).xreplace({s: sizes[s.name] for s in (r.forward + r.backward).free_symbols})
    return float(total) * case.batch


_REPORTS: dict = {}


def run_case(case: Case, quick: bool) -> dict:
    """Every available implementation on one case: error, times (round robin), peak extra memory."""
    data = impl.make_data(case)
    flops = model_flops(case)
    baseline = "torch_mha_module" if case.heads else "torch_autograd"
    reference = impl.reference_result(case, data)
    results: dict[str, dict] = {}
    runners = {}
    slowest = 0.0
    for name, factory in impl.IMPLEMENTATIONS.items():
        runner = factory(case, data)
        if runner is None:
            continue
        try:
            comparable = reference is not None and getattr(runner, "comparable", True)
            error = impl.max_relative_error(runner.result(), reference) if comparable else None
            warm_up = _timed(runner.step)  # first-touch allocations, lazy imports, kernel selection
        except Exception as err:  # a backend that fails is reported, not fatal
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            continue
        runners[name] = runner
        results[name] = {"max_rel_error": error, "times_s": []}
        slowest = max(slowest, warm_up)
    # round robin, so that load from elsewhere on the machine falls on every implementation alike
    for _ in range(repeats_for(slowest, quick)):
        for name, runner in runners.items():
            results[name]["times_s"].append(_timed(runner.step))
    for name, runner in runners.items():
        r = results[name]
        r["time_s"], r["median_s"] = min(r["times_s"]), statistics.median(r["times_s"])
        r["gflops"] = flops / r["time_s"] / 1e9
        memory = runner.peak_memory()
        r["peak_extra_mib"] = memory / 2**20 if memory is not None else None
    base = results.get(baseline, {}).get("time_s")
    for r in results.values():
        if "time_s" in r:
            r["ratio"] = r["time_s"] / base if base else None
    return {**asdict(case), "label": case.label, "baseline": baseline, "model_gflop": flops / 1e9, "results": results}


def attach_gemm_fractions(cases: list[dict], peaks: dict[str, float]) -> None:
    """Each implementation's GFLOP/s as a fraction of its library's GEMM peak in the case's dtype."""
    for case in cases:
        for name, r in case["results"].items():
            if "gflops" in r:
                peak = peaks.get(f"{'numpy' if name.startswith('numpy') else 'torch'}/{case['dtype']}")
                r["gemm_fraction"] = r["gflops"] / peak if peak else None


def flop_counts() -> dict:
    """Forward + backward FLOPs of single-head attention: simplified, generated schedule, with n = m, d_k = d_v = d."""
    import sympy as sp

    from symattn.codegen.report.cost_report import cost_report

    r = cost_report("attention", sizes=())
    n, m, d_k, d_v, d = sp.symbols("n m d_k d_v d", positive=True, integer=True)
    same = {m: n, d_k: d, d_v: d}
    counts = {"simplified": sp.expand((r.forward + r.backward).xreplace(same))}
    if r.generated_forward is not None:
        counts["generated"] = sp.expand((r.generated_forward + r.generated_backward).xreplace(same))
    out = {k: str(v) for k, v in counts.items()}
    out["generated_leading_coefficient"] = int(counts["generated"].coeff(n**2 * d)) if "generated" in counts else None
    return out


def cold_start_seconds() -> float | None:
    """Wall time of a fresh interpreter that derives, simplifies and generates every built-in spec."""
    script = (
        "import tempfile, time\n"
        "t = time.perf_counter()\n"
        "import symattn\n"
        "from symattn.optimize.simplify import simplify_all\n"
        "for name in symattn.specs():\n"
        "    d = symattn.derive(name)\n"
        "    simplify_all([d.spec.output, *d.gradients.values()])\n"
        "try:\n"
        "    from symattn.codegen.generate import generate\n"
        "    with tempfile.TemporaryDirectory() as out:\n"
        "        generate(out=out)\n"
        "except ImportError:\n"
        "    pass\n"
        "print(time.perf_counter() - t)\n"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return None
    return wall


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": 1,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": getattr(impl.torch, "__version__", None),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two repeats: a smoke test")
    parser.add_argument("--write", action="store_true", help="write results.json and RESULTS.md (else print only)")
    parser.add_argument("--out", help="folder --write writes to (default: benchmarks/, next to this file)")
    parser.add_argument("--no-cold-start", action="store_true", help="skip the cold-start timing")
    args = parser.parse_args(argv)
    if args.out is not None and not args.write:
        parser.error("--out names the folder --write writes to; add --write")
    importlib.invalidate_caches()
    peaks = gemm_peak(args.quick)
    cases = []
    for case in quick_cases() if args.quick else full_cases():
        cases.append(run_case(case, args.quick))
        print(report.case_lines(cases[-1]), flush=True)
    # the peak is measured before and after the cases, the better of the two kept (other load only lowers it)
    peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in gemm_peak(args.quick).items()}
    attach_gemm_fractions(cases, peaks)
    results = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "quick": args.quick,
        "gemm_peak_gflops": peaks,
        "cold_start_s": None if args.no_cold_start else cold_start_seconds(),
        "attention_flops": flop_counts(),
        "cases": cases,
    }
    if not args.write:  # the committed results change only when asked to
        print("nothing written (add --write to write results.json and RESULTS.md)")
        return 0
    out = Path(args.out or Path(__file__).resolve().parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    (out / "RESULTS.md").write_text(report.markdown(results))
    print(f"wrote {out / 'results.json'} and {out / 'RESULTS.md'}")
    return 0


def _json_default(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
