"""benchmarks/gpu.py, the GPU check in one command (issue 40, item 5), run here as --cpu-smoke: the same code on
the CPU at tiny sizes, every section written, the checks it reports passing."""

from __future__ import annotations

import re
import runpy
from importlib.util import find_spec
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
# the Triton sections run the kernels under triton's interpreter; without triton the script leaves them out
needs_triton = pytest.mark.skipif(find_spec("triton") is None, reason="the Triton sections need triton (.[triton])")


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


@needs_triton
def test_the_triton_section_times_every_variant_and_the_bias_gradient_is_the_same_bits(report):
    """Under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1): every variant timed for the Triton module,
    torch.compile and eager math (SDPA where it expresses the variant; plain and causal also with
    deterministic=False, the Triton cell alone), the bias gradient equal across two runs, the Triton time ÷ its
    peer's (SDPA without FlexAttention on the CPU; SDPA's plain attention for the variants FlexAttention cannot
    express), and every variant's Triton JVP tangent equal to torch.func.jvp's of the math."""
    rows = _section(report, "Triton modules")
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    variants = ["plain", "causal", "softcap", "alibi", "bias", "sigmoid", "softplus", "differential", "pointer"]
    atomic = ["plain, deterministic=False", "causal, deterministic=False"]  # the other backward mode, Triton alone
    assert [c[0] for c in cells] == ["plain", atomic[0], "causal", atomic[1], *variants[2:]], rows
    by = {c[0]: c for c in cells}
    for name in atomic:
        c = by.pop(name)
        assert re.fullmatch(r"\d+\.\d\d", c[2]) and c[3:7] == ["—"] * 4, c
        assert re.fullmatch(r"\d+\.\d\d ÷ SDPA", c[8]), c
    for name, c in by.items():
        assert all(re.fullmatch(r"\d+\.\d\d", x) for x in (c[2], c[5], c[6])), c  # Triton, compiled, eager
        sdpa = name in ("plain", "causal", "alibi", "differential")
        assert re.fullmatch(r"\d+\.\d\d", c[3]) if sdpa else c[3] == "—", c
        assert c[4] == "—", c  # FlexAttention has no backward on the CPU
        peer = "SDPA" if sdpa else "SDPA plain" if name in ("sigmoid", "softplus", "pointer") else None
        assert re.fullmatch(rf"\d+\.\d\d ÷ {peer}", c[8]) if peer else c[8] == "—", c
    assert by["bias"][7].startswith("True"), by["bias"]
    jvp = _section(report, "Triton JVP")
    assert [row.split("|")[1].strip() for row in jvp] == variants, jvp
    assert all(float(row.split("|")[-2]) < 1e-5 for row in jvp), jvp


@needs_triton
def test_the_triton_kernel_checks_sweep_and_profile_report(report):
    """The kernels' own checks: every case's error against float64 beside the eager math's (float32 and float16
    under the interpreter), mha_triton against mha_torch; each kernel timed at each launch setting, one chosen; the
    profile names the kernels."""
    rows = _section(report, "Triton kernels against float64")
    cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
    assert len(cells) == 2 * 2 + 2 + 1, rows  # plain and causal in two dtypes, two wide heads, mha
    for c in cells[:-1]:
        assert float(c[3]) < (1e-5 if c[2] == "float32" else 5e-3) and float(c[4]) > 0, c
    assert float(cells[-1][3]) < 1e-5, cells[-1]
    sweep = _section(report, "Triton launch settings")
    assert len(sweep) == 2 and all(len(re.findall(r"\d+\.\d+ / \d+\.\d+", row)) == 4 for row in sweep), sweep
    assert "Chosen (least time, no mask + causal): {'forward': " in report, sweep
    profile = " ".join(_section(report, "Triton forward + backward by kernel"))
    assert "_CoreFunctionBackward" in profile and "wall time" in profile, profile


@needs_triton
def test_the_host_section_times_each_call_with_and_without_its_launches(report):
    """The host's µs per forward and backward call of attention_triton (also with its launches stubbed) and SDPA,
    the synchronised step; the CUDA graph's column says it needs CUDA."""
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in _section(report, "Triton host time")]
    assert [(c[0], c[1]) for c in rows] == [(a, m) for a in ("attention_triton", "SDPA") for m in ("none", "causal")]
    for c in rows:
        assert re.fullmatch(r"\d+ / \d+", c[2]) and re.fullmatch(r"\d+\.\d{3}", c[4]) and c[5] == "CUDA only", c
        assert re.fullmatch(r"\d+ / \d+", c[3]) if c[0] != "SDPA" else c[3] == "", c


@needs_triton
def test_the_positions_and_dropout_sections_time_every_case(report):
    """Positions as sa.entries in the kernels: each variant timed beside SDPA's dense mask and the eager math (no
    FlexAttention on the CPU), its gradients within float32's error of float64's; dropout: each implementation
    timed with and without, and the kernels' keep rate within 3σ of 1 − p."""
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in _section(report, "Triton positions")]
    assert [c[0] for c in rows] == ["window", "prefix", "decay", "alibi"], rows
    for c in rows:
        assert all(re.fullmatch(r"\d+\.\d\d", x) for x in (c[2], c[3], c[5])) and c[4] == "—", c
        assert all(float(x) < 1e-5 for x in c[6].split(", ")) and c[7].endswith("÷ SDPA"), c
    section = report.split("## Triton dropout", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in _section(report, "Triton dropout")]
    assert len(rows) == 7 and all(re.fullmatch(r"\d+\.\d{3}", c[5]) for c in rows), rows
    sigmas = float(re.search(r"\(\|Δ\| = (\d+\.\d)σ\)", section).group(1))
    assert sigmas <= 3, section
