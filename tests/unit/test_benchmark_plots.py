"""The committed benchmark plots are what benchmarks/plot.py draws from the committed JSON, byte for byte.

A benchmark rerun rewrites its JSON; a plot left from the run before is stale and fails here. plot.py is
deterministic (fixed formats, no clock, no randomness), so the comparison is exact.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def load_plot():
    spec = importlib.util.spec_from_file_location("benchmark_plot", BENCHMARKS / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PLOT = load_plot()


@pytest.mark.parametrize("name", sorted(PLOT.PLOTS))
def test_the_committed_plot_is_what_the_json_draws(name):
    path = BENCHMARKS / name
    assert path.exists(), f"missing {path}; draw it with: python benchmarks/plot.py"
    assert path.read_text(encoding="utf-8") == PLOT.drawn()[name], (
        f"{path} is stale; redraw it with: python benchmarks/plot.py"
    )


@pytest.mark.parametrize("name", sorted(PLOT.PLOTS))
def test_each_plot_is_well_formed_svg_with_its_machine_and_date(name):
    source, _ = PLOT.PLOTS[name]
    record = json.loads((BENCHMARKS / source).read_text(encoding="utf-8"))
    text = PLOT.drawn()[name]
    root = ET.fromstring(text)
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and root.findall(".//{*}polyline")
    date = record.get("date") or list(record.get("runs", {}))[-1]
    assert date in text and "CPU" in text


def test_the_check_flag_names_a_stale_plot(tmp_path, capsys):
    for source, _ in PLOT.PLOTS.values():
        (tmp_path / source).write_text((BENCHMARKS / source).read_text(encoding="utf-8"), encoding="utf-8")
    assert PLOT.main(["--dir", str(tmp_path)]) == 0 and PLOT.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "results.svg").write_text("<svg/>", encoding="utf-8")
    assert PLOT.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "results.svg" in capsys.readouterr().err


def test_scaling_py_draws_with_plot_py():
    spec = importlib.util.spec_from_file_location("benchmark_scaling", BENCHMARKS / "scaling.py")
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    record = json.loads((BENCHMARKS / "scaling.json").read_text(encoding="utf-8"))
    assert scaling.svg(record) == PLOT.drawn()["scaling.svg"]
