"""The benchmark runner works end to end at tiny sizes (--quick); no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the benchmark

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("torch", reason="the benchmark baselines are torch implementations")
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--quick", "--no-cold-start", "--write", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "USDT" not in done.stdout + done.stderr  # torch.profiler's start/stop lines are silenced
    return json.loads((out / "results.json").read_text()), (out / "RESULTS.md").read_text()


def test_quick_run_covers_every_case_with_the_baselines(quick_results):
    results, _ = quick_results
    labels = {(c["label"], c["dtype"]) for c in results["cases"]}
    assert len(labels) == 4  # single-head and multi-head, float32 and float64
    for case in results["cases"]:
        assert "time_s" in case["results"][case["baseline"]]
        assert case["results"][case["baseline"]]["ratio"] == pytest.approx(1.0)
        for name, r in case["results"].items():
            assert "error" not in r, f"{name}: {r.get('error')}"
            assert r["time_s"] > 0 and r["peak_extra_mib"] is not None


def test_generated_backends_agree_with_torch_autograd(quick_results):
    results, _ = quick_results
    for case in results["cases"]:
        tolerance = 1e-4 if case["dtype"] == "float32" else 1e-10
        for name, r in case["results"].items():
            if name.startswith(("numpy_generated", "torch_generated")):
                assert r["max_rel_error"] is not None and r["max_rel_error"] < tolerance, (name, case["label"])


def test_markdown_has_the_machine_the_table_and_the_targets(quick_results):
    results, markdown = quick_results
    assert results["machine"]["numpy"] in markdown
    assert "| case | dtype | implementation |" in markdown
    assert "## Targets (issue 5)" in markdown
    assert all(v > 0 for v in results["gemm_peak_gflops"].values())


def test_without_write_nothing_is_written_and_out_needs_write(tmp_path):
    # the committed RESULTS.md / results.json change only with --write
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    refused = subprocess.run(
        [sys.executable, str(RUNNER), "--quick", "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert refused.returncode == 2 and "add --write" in refused.stderr
    assert list(tmp_path.iterdir()) == []


def test_attention_grid_quick_run_prints_the_table_and_passes_its_correctness_check():
    # issue 27's side-by-side benchmark at tiny sizes: every implementation agrees with SDPA; no timing asserted
    pytest.importorskip("torch", reason="SDPA is the yardstick")
    grid = RUNNER.parent / "attention_grid.py"
    done = subprocess.run(
        [sys.executable, str(grid), "--quick"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert "| B×H×n | causal | dtype | SDPA (ms) | compile |" in done.stdout
    assert "every implementation within tolerance" in done.stdout
    assert done.stdout.count("| 1×2×64 |") == 8  # causal and not, float32 and float64: times and memory
    assert "nothing written" in done.stdout and "USDT" not in done.stdout + done.stderr


POSITIONS = RUNNER.parent / "positions.py"


def test_positions_quick_run_has_every_variant_and_passes_its_correctness_check():
    # issue 52's CPU positions benchmark at tiny sizes: a row per gallery variant and size, each implementation's
    # error against the float64 reference under 1e-4; no timing asserted
    pytest.importorskip("torch", reason="SDPA is the yardstick")
    done = subprocess.run(
        [sys.executable, str(POSITIONS), "--quick"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    assert "| variant | B×H×n×d | symattn standard ms |" in done.stdout
    variants = ("relative", "alibi", "table", "window", "documents")
    rows = [
        line for line in done.stdout.splitlines() if line.startswith("| ") and line.split("|")[1].strip() in variants
    ]
    shapes = [tuple(cell.strip() for cell in row.split("|")[1:3]) for row in rows]
    wanted = [(variant, f"1×{8 if variant == 'alibi' else 2}×{n}×8") for variant in variants for n in (24, 40)]
    assert shapes == wanted * 2  # each row as it is measured, then the table
    for row in rows:
        errors = row.split("|")[-2].split(",")
        assert [e.strip() for e in errors[3:]] == ["—"]  # FlexAttention is left out of the quick run
        assert all(float(e) < 1e-4 for e in errors[:3]), row
    assert "correctness: pass" in done.stdout
