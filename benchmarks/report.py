"""Render benchmark results: one console block per case, a Markdown table, and the issue's targets checked."""

from __future__ import annotations

BASELINE_NAMES = {"torch_autograd": "torch autograd", "torch_mha_module": "nn.MultiheadAttention"}


def _fmt(value, spec: str, empty: str = "–") -> str:
    return empty if value is None else format(value, spec)


def case_lines(case: dict) -> str:
    """A short console summary of one case."""
    lines = [f"{case['label']} {case['dtype']} (baseline {case['baseline']}, {case['model_gflop']:.3f} GFLOP)"]
    for name, r in case["results"].items():
        if "error" in r:
            lines.append(f"  {name:24s} failed: {r['error']}")
            continue
        lines.append(
            f"  {name:24s} {r['time_s'] * 1e3:10.2f} ms  ×{_fmt(r.get('ratio'), '.2f')}"
            f"  {r['gflops']:6.1f} GFLOP/s  {_fmt(r['peak_extra_mib'], '.1f')} MiB"
            f"  err {_fmt(r['max_rel_error'], '.1e')}"
        )
    return "\n".join(lines)


def targets(results: dict) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each target of issue 5 that the results can speak to."""
    out = []
    cases = results["cases"]
    counts = results.get("attention_flops") or {}
    if counts:
        leading = counts.get("generated_leading_coefficient")
        out.append(
            (
                "generated single-head forward + backward = 12·n²·d + lower-order terms",
                counts.get("generated", "no generated schedule"),
                "met" if leading == 12 else "missed",
            )
        )

    peaks = results.get("gemm_peak_gflops", {})

    def ratio(case: dict, name: str):
        """(ratio to the baseline, the least ratio the GEMM peak allows: baseline GFLOP/s over that peak)."""
        base = case["results"].get(case["baseline"], {}).get("gflops")
        peak = peaks.get(f"{'numpy' if name.startswith('numpy') else 'torch'}/{case['dtype']}")
        floor = base / peak if base and peak else None
        return case["results"].get(name, {}).get("ratio"), floor

    for dtype, bound in (("float32", 0.75), ("float64", 0.5)):
        measured = [
            (c["n"], *ratio(c, "numpy_generated"))
            for c in cases
            if not c["heads"] and c["dtype"] == dtype and c["n"] >= 512
        ]
        out.append(_ratio_target(f"attention_numpy ≤ {bound}× torch autograd, {dtype}, n ≥ 512", measured, bound))
    for name, dtype, bound in (
        ("numpy_generated", "float32", 0.8),
        ("numpy_generated", "float64", 0.6),
        ("torch_generated", "float32", 0.9),
    ):
        measured = [(c["label"], *ratio(c, name)) for c in cases if c["heads"] and c["dtype"] == dtype]
        backend = "mha_numpy" if name.startswith("numpy") else "mha_torch"
        out.append(_ratio_target(f"{backend} ≤ {bound}× nn.MultiheadAttention, {dtype}", measured, bound))
    big = [c for c in cases if not c["heads"] and c["dtype"] == "float32" and c["n"] == max(x["n"] for x in cases)]
    for c in big:
        for backend in ("numpy", "torch"):
            eff = c["results"].get(f"{backend}_generated_memeff", {})
            std = c["results"].get(f"{backend}_generated", {})
            if "time_s" not in eff:
                out.append((f"{backend} memory-efficient variant at n={c['n']}", "not available", "missed"))
                continue
            mib, slowdown = eff["peak_extra_mib"], eff["time_s"] / std["time_s"] if "time_s" in std else None
            misses = []
            if mib is None or mib > 16:
                misses.append(f"memory {_fmt(mib, '.1f')} MiB > 16 MiB")
            if slowdown is None or slowdown > 1.2:
                misses.append(f"time {_fmt(slowdown, '.2f')}× > 1.2×")
            out.append(
                (
                    f"{backend} memory-efficient n={c['n']} float32: ≤ 16 MiB extra, ≤ 1.2× standard time",
                    f"{_fmt(mib, '.1f')} MiB, {_fmt(slowdown, '.2f')}×",
                    "missed: " + ", ".join(misses) if misses else "met",
                )
            )
    cold = results.get("cold_start_s")
    out.append(
        (
            "derive + simplify + generate every spec, cold start ≤ 3 s",
            "not measured" if cold is None else f"{cold:.2f} s",
            "not measured" if cold is None else "met" if cold <= 3 else f"missed by {cold - 3:.2f} s",
        )
    )
    return out


def _ratio_target(what: str, measured: list, bound: float) -> tuple[str, str, str]:
    """measured: (case, ratio, floor) with floor the ratio at which we would run at the GEMM peak."""
    known = [(k, r, f) for k, r, f in measured if r is not None]
    if not known:
        return what, "not measured", "not measured"
    text = ", ".join(f"{k}: {r:.2f}×" + (f" (GEMM-peak floor {f:.2f}×)" if f else "") for k, r, f in known)
    worst = max(r for _, r, _ in known)
    if worst <= bound and len(known) == len(measured):
        return what, text, "met"
    verdict = f"missed: worst {worst:.2f}×, {worst / bound - 1:.0%} over the bound"
    if any(f and f > bound for _, _, f in known):
        verdict += "; the bound is under the floor (it would take more than the GEMM peak)"
    return what, text, verdict


def markdown(results: dict) -> str:
    """RESULTS.md: machine, GEMM peak, one table of every case and implementation, the targets."""
    m = results["machine"]
    lines = [
        "# Benchmark results" + (" (quick smoke run: tiny sizes, not representative)" if results["quick"] else ""),
        "",
        "Written by `python benchmarks/run.py --write`" + (f" ({results['date']})." if "date" in results else "."),
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, 1 thread; Python {m['python']}, "
        f"NumPy {m['numpy']}, torch {m['torch']}; {m['platform']}.",
        "",
        "GEMM peak measured in the same run (GFLOP/s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in results["gemm_peak_gflops"].items())
        + ".",
        "",
        "Times are the best of repeated forward + backward steps (implementations taking turns); "
        "× is the ratio to the case's baseline "
        "(torch autograd single-head, nn.MultiheadAttention multi-head); % peak is symattn's "
        "cost-model FLOPs over time over the GEMM peak of that library and dtype; extra MiB is "
        "the peak of one step's allocations (tracemalloc for NumPy, the torch profiler's memory "
        "events for torch), inputs excluded; error is the largest relative error against torch autograd. "
        "A target's GEMM-peak floor is the ratio we would reach running the cost model's FLOPs at the "
        "measured GEMM peak: the baseline's GFLOP/s over that peak.",
        "",
        "| case | dtype | implementation | time (ms) | × baseline | % GEMM peak | extra MiB | error |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in results["cases"]:
        for name, r in c["results"].items():
            if "error" in r:
                lines.append(f"| {c['label']} | {c['dtype']} | {name} | failed: {r['error'][:60]} | | | | |")
                continue
            lines.append(
                f"| {c['label']} | {c['dtype']} | {name} | {r['time_s'] * 1e3:.2f} | {_fmt(r.get('ratio'), '.2f')} "
                f"| {_fmt(r.get('gemm_fraction') and 100 * r['gemm_fraction'], '.0f')} "
                f"| {_fmt(r['peak_extra_mib'], '.1f')} | {_fmt(r['max_rel_error'], '.1e')} |"
            )
    lines += ["", "## Targets (issue 5)", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m_} | {v} |" for t, m_, v in targets(results)]
    cold = results.get("cold_start_s")
    lines += ["", f"Cold start (fresh interpreter: derive, simplify, generate every spec): {_fmt(cold, '.2f')} s.", ""]
    return "\n".join(lines)
