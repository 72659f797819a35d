"""`symattn graph`: the schedule's dataflow as DOT, SVG and PNG (nodes, uses, shapes, FLOPs, saved values)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from symattn.cli import main
from symattn.codegen.report import picture as pic
from symattn.codegen.report.cost_report import node_costs, schedule_of
from symattn.specs import spec

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "specs" / "sigmoid_attention.py"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed (Debian: graphviz)")


def _edges(source: str) -> set[tuple[str, str]]:
    return set(re.findall(r'^  "([^"]+)" -> "([^"]+)"', source, flags=re.M))


def test_every_value_is_a_node_and_every_use_an_edge():
    sched = schedule_of(spec("mha"))
    nodes = node_costs(sched)
    source = pic.dot_source(sched, nodes, backward=True)
    for n in nodes:
        assert re.search(rf'^  "{re.escape(n.name)}" \[label="{re.escape(n.name)}', source, flags=re.M), n.name
        for u in n.uses:
            assert (u, n.name) in _edges(source), (u, n.name)
    # the forward picture stops at the output: no cotangent, no gradient
    forward = pic.dot_source(sched, nodes, backward=False)
    assert '"dA_h"' not in forward and '"grad_out"' not in forward and '"Y" [label="Y (output)' in forward


def test_labels_carry_shape_and_flops_and_saved_values_are_marked():
    sched = schedule_of(spec("attention"))
    source = pic.dot_source(sched, node_costs(sched), backward=True)
    p_line = next(line for line in source.splitlines() if line.startswith('  "P" ['))
    assert "n × m" in p_line and "5·m·n FLOPs" in p_line and pic.SAVED in p_line  # P is saved for the backward
    a_line = next(line for line in source.splitlines() if line.startswith('  "A" ['))
    assert pic.SAVED not in a_line  # A is not: the backward reads P
    assert '"P" -> "dA" [style=dashed' in source  # the backward reading a saved value
    assert '"dQ" [label="dQ = ∂f/∂Q' in source


def test_dot_format_needs_no_graphviz(monkeypatch, capsysbinary):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["graph", "attention", "--backward", "--format", "dot"]) == 0
    assert capsysbinary.readouterr().out.startswith(b"digraph dataflow {")


def test_missing_dot_is_one_line_naming_the_program(monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["graph", "attention", "--format", "svg"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "`dot`" in err and "graphviz" in err


def test_bad_arguments_exit_2(capsys):
    assert main(["graph", "attention", "--format", "gif"]) == 2
    assert main(["graph"]) == 2
    assert main(["graph", "attention", "--spec-file", str(EXAMPLE)]) == 2


@needs_dot
def test_svg_and_png_of_mha_backward(tmp_path, capsysbinary):
    assert main(["graph", "mha", "--backward", "--format", "svg"]) == 0
    svg = capsysbinary.readouterr().out.decode()
    assert "<svg" in svg and "dW_O = ∂f/∂W_O" in svg and "2·H·m·n FLOPs" in svg
    out = tmp_path / "mha.png"
    assert main(["graph", "mha", "--backward", "--format", "png", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and out.stat().st_size > 10_000


@needs_dot
def test_spec_file_is_drawn(capsysbinary):
    assert main(["graph", "--spec-file", str(EXAMPLE), "--backward"]) == 0
    assert b"<svg" in capsysbinary.readouterr().out
