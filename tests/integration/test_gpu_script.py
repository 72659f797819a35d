"""benchmarks/gpu.py, the GPU check in one command (issue 40, item 5), run here as --cpu-smoke: the same code on
the CPU at tiny sizes, every section written, the checks it reports passing."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("gpu") / "GPU.md"
    text = runpy.run_path(str(SCRIPT))["main"](["--cpu-smoke", "--out", str(out)])
    assert out.read_text(encoding="utf-8") == text
    return text


def _section(text: str, title: str) -> list[str]:
    body = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]


def test_precision_covers_every_module_dtype_and_mask(report):
    rows = _section(report, "Precision")
    assert len(rows) == 2 * 2 * 2 * 3  # attention and mha, standard and memeff, two masks, three dtypes
    for row in rows:
        error, sdpa = (float(x) for x in row.split("|")[5:7])
        assert 0 < error < (1e-4 if "fp32" in row else 5e-2), row
        assert sdpa > 0, row


def test_autocast_gives_sdpas_dtypes_and_the_amp_step_runs(report):
    rows = _section(report, "Autocast")
    assert len(rows) == 6
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if "AMP step" in cells[0]:
            assert cells[2].endswith("finite: True"), row
        else:
            assert cells[2] == cells[3], row  # output and gradient dtypes as SDPA's under the same autocast


def test_the_drop_ins_match_torchs_modules_and_the_jvp_matches(report):
    rows = _section(report, "Drop-ins")
    gaps = [float(x) for row in rows for x in re.findall(r"\d\.\de[-+]\d+", row)]
    assert len(gaps) == 5 and max(gaps[:4]) < 1e-5 and gaps[4] < 1e-12, rows


def test_every_timed_run_ran(report):
    rows = _section(report, "Forward + backward")
    assert len(rows) == 2 and all("failed" not in row for row in rows), rows
    assert all(len(re.findall(r"\d+\.\d\d", row)) == 5 for row in rows), rows  # five implementations timed
