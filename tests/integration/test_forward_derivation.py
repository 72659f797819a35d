"""``symattn derive --mode forward``: each value's differential along the inputs' tangents, every step checked
against a central difference, for every built-in and gallery spec; a wrong step is caught; the documents
print (text, Markdown, LaTeX that pdflatex compiles) and the command line refuses what does not apply."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import sympy as sp

from symattn.autodiff.differentials import differential_of
from symattn.cli import main
from symattn.derive.derivation import derive
from symattn.derive.forward_mode import ForwardDerivation
from symattn.lang.functions import FunctionRecord
from symattn.specs import specs
from symattn.specs.files import load_spec_file

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"


def _spec(name: str):
    if name in specs():
        return derive(name).spec
    return load_spec_file(GALLERY / f"{name}.py")


NAMES = [*specs(), *sorted(p.stem for p in GALLERY.glob("*.py"))]


@pytest.mark.parametrize("name", NAMES)
def test_every_step_agrees_with_a_central_difference(name):
    derivation = ForwardDerivation(_spec(name))
    checks = derivation.verify()
    assert checks and all(c.ok for c in checks), derivation.report(checks)
    assert len(checks) == len(derivation.steps)


def test_a_wrong_step_is_caught():
    # dP = dA ⊙ P (the softmax's row-sum term left out) is no differential of P = softmax(A): the check says so
    derivation = ForwardDerivation(_spec("attention"))
    i, step = next((i, s) for i, s in enumerate(derivation.steps) if isinstance(s.value, FunctionRecord))
    wrong = sp.HadamardProduct(differential_of(step.value.arg), step.value)
    derivation.steps[i] = dataclasses.replace(step, differential=wrong)
    checks = derivation.verify()
    assert not checks[i].ok and all(c.ok for k, c in enumerate(checks) if k != i)
    assert derivation.report(checks).startswith(f"{len(checks) - 1} of {len(checks)} steps agree")
    assert "✗" in derivation.text(checks)


def test_the_attention_steps_read_like_the_hand_derivation():
    text = ForwardDerivation(_spec("attention")).text()
    for line in ("dS = dQ Kᵀ + Q dKᵀ", "dP = P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ)", "dO = dP V + P dV", "[softmax differential]"):
        assert line in text, text


def test_command_line(capsys):
    assert main(["derive", "attention", "--mode", "forward", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "4 of 4 steps agree with a central difference" in out and "✓" in out
    assert main(["derive", "mha", "--mode", "forward", "--format", "markdown"]) == 0
    assert capsys.readouterr().out.startswith("# Forward mode of mha")
    for extra in (["--wrt", "W_Q"], ["--order", "2"], ["--format", "html"], ["--cost"]):
        assert main(["derive", "attention", "--mode", "forward", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("symattn derive: error: --mode forward takes no") and "\n" not in err


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed (Debian: texlive-latex-base)")
@pytest.mark.parametrize("name", ["mha", "transformer_block", "differential_attention"])
def test_standalone_document_compiles_with_pdflatex(name, tmp_path):
    (tmp_path / "forward.tex").write_text(ForwardDerivation(_spec(name)).latex(standalone=True), encoding="utf-8")
    done = subprocess.run(
        ["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "-no-shell-escape", "forward.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    assert (tmp_path / "forward.pdf").stat().st_size > 0
