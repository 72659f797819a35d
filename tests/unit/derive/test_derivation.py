"""Printed derivations: every equality of every spec checked, a broken rule caught, formats and CLI."""

from __future__ import annotations

import pytest
import sympy as sp
from sympy.matrices.expressions import hadamard_product

import symattn as sa
from symattn.cli import main
from symattn.derive.steps import DF, Definition, Equation
from symattn.lang.ops import RowSoftmax


@pytest.mark.parametrize("name", sa.specs())
def test_every_printed_equality_of_every_spec_agrees(name, derivations):
    derivation = derivations[name]
    report = derivation.verify(seed=1)
    assert report.ok, report.text()
    chains = derivation.chains()  # per input, or one shared sweep (transformer_block)
    assert [str(t.name) for c in chains for t in c.targets] == list(derivation.spec.input_names)
    assert {c.target for c in report.checks} == {c.label for c in chains}
    # every gradient, named and (where short enough) in closed form, against the engine's
    against_engine = [c for c in report.checks if c.node == "result" and "engine" in c.reason]
    assert len(against_engine) >= len(derivation.spec.input_names)
    assert report.max_discrepancy < 1e-12


@pytest.mark.parametrize("name", ["attention", "mha"])
def test_a_shared_sweep_prints_each_step_once_and_every_gradient(name):
    shared = sa.derive(name, sweep="shared")
    (c,) = shared.chains()
    spec = shared.spec
    moving = [step for step in c.tape.steps if any(step.node.has(x) for x in spec.inputs)]
    assert sum(isinstance(i, Equation) for i in c.items) == len(moving) + 2  # df = …, each step, df = Σ …
    assert len(c.items[-1].sides[1]) == len(spec.inputs)  # df = Σ_W tr(W̄ᵀ dW)
    report = shared.verify(seed=1)
    assert report.ok, report.text()
    per_input = sa.derive(name, sweep="per-input")
    for x in spec.input_names:  # the same gradients, read off the shared sweep or replayed per input
        assert c.gradients[spec.input(x)] == per_input.steps(x).gradient
    text = shared.text()
    assert text.count("The backward pass, shared by every gradient") == 1
    assert all(f"\n∂f/∂{x}\n" in text for x in spec.input_names)
    assert sum(len(c.items) for c in per_input.chains()) > len(c.items)  # the per-input chains replay steps


def test_a_shared_sweep_with_a_wrong_rule_fails_at_its_step(monkeypatch):
    monkeypatch.setattr(RowSoftmax, "vjp", _softmax_without_row_sums)
    report = sa.derive("attention", sweep="shared").verify()
    assert {c.node for c in report.failures} == {"RowSoftmax", "result"}
    assert all(c.discrepancy > 1e-3 for c in report.failures)


def test_an_unknown_sweep_is_a_clear_error():
    with pytest.raises(sa.SymattnError, match="unknown sweep 'both'; choose from auto, shared, per-input"):
        sa.derive("attention", sweep="both")


@pytest.mark.parametrize("name", sa.specs())
def test_each_chain_starts_from_df_and_ends_at_the_engines_gradient(name, derivations):
    derivation = derivations[name]
    for target in derivation.spec.input_names:
        c = derivation.steps(target)
        first, last = c.items[0], c.items[-1]
        assert isinstance(first, Equation) and first.sides[0] == DF
        assert isinstance(last, Equation) and last.sides[0] == DF
        # one equation per recorded step that moves with the target, plus the first and the last
        moving = [step for step in c.tape.steps if step.node.has(c.target)]
        assert sum(isinstance(i, Equation) for i in c.items) == len(moving) + 2
        assert any(isinstance(i, Definition) for i in c.items)


def _softmax_without_row_sums(node, g):
    """A wrong rule: tr(Gᵀ dP) = tr((P ⊙ G)ᵀ dA), the −rowsum(G ⊙ P) 𝟏ᵀ term dropped."""
    return hadamard_product(node, g)


def test_a_broken_vjp_rule_is_caught_at_its_step(monkeypatch):
    monkeypatch.setattr(RowSoftmax, "vjp", _softmax_without_row_sums)
    report = sa.derive("attention").verify("Q")
    assert not report.ok
    failed = report.failures
    # the softmax step (VJP against the independent differential) and df = tr(Q̄ᵀ dQ) at the end
    assert {c.node for c in failed} == {"RowSoftmax", "result"}
    assert all(c.discrepancy > 1e-3 for c in failed)
    # the printed gradient still equals the engine's: only the checked equalities see the broken rule
    assert all(c.ok for c in report.checks if "engine" in c.reason)


def test_verify_option_exits_1_on_a_broken_rule(monkeypatch, capsys):
    monkeypatch.setattr(RowSoftmax, "vjp", _softmax_without_row_sums)
    assert main(["derive", "attention", "--wrt", "K", "--verify"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_option_reports_every_step(capsys):
    assert main(["derive", "self_attention", "--wrt", "W_V", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "all equalities agree" in out
    assert out.count("\nok ") + out.startswith("ok ") >= 4


def test_self_attention_value_weight_reads_like_the_seeds(derivations):
    # seed 003 (corrected): ∂L/∂W^V = Xᵀ Pᵀ ∂L/∂O
    text = derivations["self_attention"].text("W_V")
    assert "∂f/∂W_V = W̄_V = Xᵀ Pᵀ G" in text
    assert "tr(Gᵀ dO)" in text


def test_softmax_step_shows_the_softmax_differential(derivations):
    text = derivations["self_attention"].text("W_Q")
    assert "P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ)" in text
    a_bar = "A\u0304"  # the text printer puts a combining macron on the letter
    assert f"{a_bar} := P ⊙ (P̄ − (P ⊙ P̄) 𝟏 𝟏ᵀ)" in text
    assert f"W̄_Q := (1/√d_k) Xᵀ {a_bar} K" in text


def test_multi_head_derivation_uses_per_head_blocks(derivations):
    latex = derivations["mha"].latex("W_Q")
    assert r"Q_{h} &= Q\,W^{Q}_{h}" in latex
    assert r"C &= \operatorname{Concat}_{h}(O_{h})" in latex
    assert r"\sum_{h} \operatorname{tr}" in latex
    assert r"\frac{\partial f}{\partial W^{Q}}" in latex


def test_formats(derivations):
    d = derivations["attention"]
    fragment = d.latex("V")
    assert r"\begin{align*}" in fragment and r"\documentclass" not in fragment
    document = d.latex("V", standalone=True)
    assert document.startswith(r"\documentclass") and r"\usepackage{amsmath}" in document
    assert document.rstrip().endswith(r"\end{document}")
    markdown = d.markdown("V")
    assert markdown.startswith("# ") and "\n$$\n\\begin{aligned}" in markdown
    # the Markdown holds the same derivation: every aligned block of math is one of the LaTeX fragment's lines
    blocks = markdown.split("\n$$\n")[1::2]
    # (the math of each line; its rule sits in a column there, in a \tag* in the LaTeX)
    lines = [line.partition("&&")[0].strip(" &\\") for block in blocks for line in block.splitlines()[1:-1]]
    assert lines and all(line in fragment for line in lines), [line for line in lines if line not in fragment]
    assert d._repr_latex_().startswith("$$\\begin{aligned}")
    assert all(ch.isascii() for ch in document)  # pdflatex needs no unicode support


def test_unknown_target_names_the_inputs(derivations):
    with pytest.raises(sa.SymattnError, match="inputs: Q, K, V"):
        derivations["attention"].latex("W_Q")
    with pytest.raises(sa.SymattnError, match="unknown format"):
        derivations["attention"].render("pdf")


@pytest.mark.parametrize(
    "argv",
    [
        ["derive", "nope"],
        ["derive", "mha", "--wrt", "Z"],
        ["derive", "mha", "--format", "pdf"],
        ["derive", "mha", "--format", "text", "--standalone"],
        ["derive", "mha", "--option", "num_heads=0"],
    ],
)
def test_bad_derive_arguments_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1


def test_derive_prints_each_format(capsys):
    assert main(["derive", "attention", "--wrt", "V", "--format", "markdown"]) == 0
    assert capsys.readouterr().out.startswith("# Gradients of attention")
    assert main(["derive", "attention", "--wrt", "V", "--standalone"]) == 0
    assert capsys.readouterr().out.startswith(r"\documentclass")
    assert main(["derive", "mha", "--wrt", "W_O", "--option", "num_heads=2"]) == 0
    assert "∂f/∂W_O = W̄_O = Cᵀ G" in capsys.readouterr().out


def _custom_spec() -> sa.Spec:
    """Y = X ⊙ tanh(Z) + σ(Z) − exp(X) + rowsum(log(X ⊙ X)) 𝟏ᵀ + X W², Z = X W: every entrywise rule."""
    n, d = sp.symbols("n d", positive=True, integer=True)
    x, w = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W", d, d)
    z = x * w
    ones_row = sp.OneMatrix(1, d)
    y = sa.hadamard(sa.tanh(z), x) + sa.sigmoid(z) - sa.exp(x) + sa.rowsum(sa.log(sa.hadamard(x, x))) * ones_row
    return sa.Spec("custom", "entrywise rules", (x, w), y + x * w * w, (("Z", z),))


def test_a_spec_of_every_entrywise_node_verifies():
    derivation = sa.derive(_custom_spec())
    report = derivation.verify()
    assert report.ok, report.text()
    nodes = {c.node for c in report.checks}
    assert {"HadamardProduct", "Tanh", "Sigmoid", "Exp", "Log", "RowSum", "MatPow", "MatAdd"} <= nodes
    assert "Z\u0304 := " in derivation.text("W")


def test_scalar_factors_of_matrices_step_like_the_rest():
    """tr(W_Q) and 𝟏ᵀA𝟏 as scalar factors: a step each (d tr(W) = tr(dW)), every equality verified."""
    n, d = sp.Symbol("n", positive=True, integer=True), sp.Symbol("d", positive=True, integer=True)
    x, w = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W_Q", d, d)
    out = sp.Trace(w) * sa.softmax(x * w * x.T) * x + sa.sum(sa.tanh(x)) * x
    derivation = sa.derive(sa.Spec("scalar", "tr(W_Q) softmax(X W_Q Xᵀ) X + 𝟏ᵀtanh(X)𝟏 X", (x, w), out))
    report = derivation.verify()
    assert report.ok, report.text()
    assert {"Trace", "SumEntries"} <= {c.node for c in report.checks}
    assert "tr(dW_Q)" in derivation.text("W_Q")
