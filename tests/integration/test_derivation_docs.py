"""Committed derivation docs never drift, and every standalone LaTeX document compiles."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import sympy as sp

import symattn as sa

DOCS = Path(__file__).resolve().parents[2] / "docs" / "derivations"


@pytest.mark.parametrize("name", sa.specs())
def test_committed_derivation_doc_is_what_the_tool_writes(name, derivations):
    path = DOCS / f"{name}.md"
    assert path.exists(), f"missing {path}; write it with: symattn derive {name} --format markdown > {path}"
    assert path.read_text(encoding="utf-8") == derivations[name].markdown(), (
        f"{path} is stale; regenerate it with: symattn derive {name} --format markdown > docs/derivations/{name}.md"
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (Debian: texlive-latex-base)")
@pytest.mark.parametrize("name", sa.specs())
def test_standalone_document_compiles_with_pdflatex(name, derivations, tmp_path):
    (tmp_path / f"{name}.tex").write_text(derivations[name].latex(standalone=True), encoding="ascii")
    run = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", f"{name}.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert (tmp_path / f"{name}.pdf").stat().st_size > 0


GALLERY = sorted((Path(__file__).resolve().parents[2] / "examples" / "specs").glob("*.py"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (Debian: texlive-latex-base)")
@pytest.mark.parametrize("name", [*sa.specs(), *(p.stem for p in GALLERY)])
def test_standalone_document_fits_an_a4_page(name, derivations, tmp_path):
    # no line of math or label runs into the margin: pdflatex reports no overfull box
    from symattn.specs.files import load_spec_file

    path = next((p for p in GALLERY if p.stem == name), None)
    derivation = sa.derive(load_spec_file(path)) if path else derivations[name]
    document = derivation.latex(standalone=True)
    assert "a4paper" in document
    (tmp_path / "doc.tex").write_text(document, encoding="ascii")
    run = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", "doc.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    log = (tmp_path / "doc.log").read_text(encoding="latin-1")
    overfull = [line for line in log.splitlines() if line.startswith("Overfull \\hbox")]
    assert not overfull, overfull


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (Debian: texlive-latex-base)")
def test_superscripted_names_under_transposes_and_powers_compile(tmp_path):
    # W^{Q} under ᵀ, ∘2 and d(·): no double superscripts such as W^{Q}^{T}
    n, d = sp.symbols("n d", positive=True, integer=True)
    x, w = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W_Q", d, d)
    y = sp.HadamardPower(x * w, 2) + sa.tanh(x * w.T) + x * w * w.T
    derivation = sa.derive(sa.Spec("powers", "(X W_Q)^∘2 + tanh(X W_Qᵀ) + X W_Q W_Qᵀ", (x, w), y))
    assert derivation.verify().ok
    (tmp_path / "powers.tex").write_text(derivation.latex(standalone=True), encoding="ascii")
    run = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", "powers.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:]
