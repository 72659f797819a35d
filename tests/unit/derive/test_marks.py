"""`derive --verify` prints the derivation with each line marked: ✓, or ✗ with its discrepancy."""

from __future__ import annotations

from sympy.matrices.expressions import hadamard_product

import symattn as sa
from symattn.cli import main
from symattn.derive.formats.document import Document
from symattn.derive.formats.marks import PASS, row_checks
from symattn.lang.ops import RowSoftmax


def test_every_check_belongs_to_exactly_one_printed_line():
    d = sa.derive("mha")
    report = d.verify()
    placed = 0
    for c in d.chains():
        rows = row_checks(c, report.checks)
        assert len(rows) == len(Document(d.spec, latex=False).lines(c)) + 1  # the rows, then the result line
        placed += sum(len(r) for r in rows)
    assert placed == len(report.checks)


def test_verify_prints_each_line_with_its_mark(capsys):
    assert main(["derive", "attention", "--wrt", "V", "--verify"]) == 0
    out = capsys.readouterr().out
    derivation = out[: out.index("\nok ")]
    assert f"{PASS}         df = tr(Gᵀ dO)" in derivation
    assert f"{PASS}  ∂f/∂V = V̄ = Pᵀ G" in derivation
    marked = [line for line in derivation.splitlines() if line.startswith(PASS)]
    assert len(marked) == 6  # every equality; the definition V̄ := Pᵀ G has no mark of its own
    assert "all equalities agree" in out  # the report follows


def _softmax_without_row_sums(node, g):
    """A wrong rule: tr(Gᵀ dP) = tr((P ⊙ G)ᵀ dA), the −rowsum(G ⊙ P) 𝟏ᵀ term dropped."""
    return hadamard_product(node, g)


def test_a_failing_line_shows_its_discrepancy(monkeypatch, capsys):
    monkeypatch.setattr(RowSoftmax, "vjp", _softmax_without_row_sums)
    assert main(["derive", "attention", "--wrt", "K", "--verify"]) == 1
    out = capsys.readouterr().out
    failing = [line for line in out.splitlines() if line.startswith("✗")]
    assert failing and all("> 1e-09" in line for line in failing)
    assert any("Hadamard factor moved onto the cotangent" in line for line in failing)  # the softmax step
    assert any(line.startswith(PASS) for line in out.splitlines())  # the steps before the softmax still pass
