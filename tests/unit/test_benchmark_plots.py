"""The committed benchmark plots are what benchmarks/plot.py draws from the committed JSON, byte for byte.

A benchmark rerun rewrites its JSON; a plot left from the run before is stale and fails here. plot.py draws
with matplotlib (the ``test`` and ``bench`` extras) without a date or a version in the file and with a fixed
hash salt for its ids, so the same JSON and the same matplotlib give the same bytes; the test extra pins the
matplotlib that drew the committed files.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

matplotlib = pytest.importorskip(
    "matplotlib", reason="benchmarks/plot.py draws with matplotlib: pip install -e '.[test]' (or '.[bench]')"
)

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load_plot():
    """benchmarks/plot.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("benchmark_plot", BENCHMARKS / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PLOT = load_plot()


@pytest.fixture(scope="module")
def drawn() -> dict[str, str]:
    """Each plot's SVG from the committed JSON, drawn once for the module's tests."""
    return PLOT.drawn()


def test_the_test_extra_pins_the_matplotlib_that_drew_the_plots():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert f"matplotlib=={PLOT.DRAWN_BY}" in extras["test"]
    assert any(re.fullmatch(r"matplotlib>=[0-9.]+", r) for r in extras["bench"])


@pytest.mark.parametrize("name", sorted(PLOT.PLOTS))
def test_the_committed_plot_is_what_the_json_draws(name, drawn):
    if matplotlib.__version__ != PLOT.DRAWN_BY:
        pytest.skip(f"the committed plots are matplotlib {PLOT.DRAWN_BY}'s bytes; {matplotlib.__version__} is here")
    path = BENCHMARKS / name
    assert path.exists(), f"missing {path}; draw it with: python benchmarks/plot.py"
    stale = f"{path} is stale; redraw it with: python benchmarks/plot.py"
    assert path.read_text(encoding="utf-8") == drawn[name], stale


def test_drawing_twice_gives_the_same_bytes(drawn):
    assert PLOT.drawn() == drawn


@pytest.mark.parametrize("name", sorted(PLOT.PLOTS))
def test_each_plot_is_svg_with_its_machine_date_and_legend_as_text(name, drawn):
    source, _ = PLOT.PLOTS[name]
    record = json.loads((BENCHMARKS / source).read_text(encoding="utf-8"))
    root = ET.fromstring(drawn[name])
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    text = "\n".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text"))
    date = record.get("date") or list(record.get("runs", {}))[-1]
    assert date in text and "CPU" in text
    labels = {label for label, _ in {**PLOT.GRID_RUNS, **PLOT.RESULT_RUNS}.values()} | set(PLOT.PHASES)
    assert sum(f"\n{label}\n" in f"\n{text}\n" for label in labels) >= 4  # the legend's entries
    assert "Matplotlib v" not in drawn[name] and "<dc:date>" not in drawn[name]  # no version, no clock


def test_the_check_flag_names_a_stale_plot(tmp_path, capsys):
    for source, _ in PLOT.PLOTS.values():
        (tmp_path / source).write_text((BENCHMARKS / source).read_text(encoding="utf-8"), encoding="utf-8")
    assert PLOT.main(["--dir", str(tmp_path)]) == 0 and PLOT.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "results.svg").write_text("<svg/>", encoding="utf-8")
    assert PLOT.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "results.svg" in capsys.readouterr().err


def test_scaling_py_draws_with_plot_py(drawn):
    spec = importlib.util.spec_from_file_location("benchmark_scaling", BENCHMARKS / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    record = json.loads((BENCHMARKS / "scaling.json").read_text(encoding="utf-8"))
    assert scaling.svg(record) == drawn["scaling.svg"]
