"""symattn.derive.check and `symattn check`: the seeds' right and wrong formulas, the safe parser."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.cli import main
from symattn.derive.check import true_gradient
from symattn.lang.algebra import product, total, transpose
from symattn.lang.graph import nodes
from symattn.lang.naming.names import Names
from symattn.lang.naming.parse import ParseError, parse
from symattn.numeric.lambdify import lambdify
from symattn.numeric.verify import random_dims, random_matrix
from symattn.specs import dim

# seed 004's Ω = rows e_iᵀ Λ Vᵀ (diag σ(p_i) − σ(p_i) σ(p_i)ᵀ), Λ = G, σ(p_i) = row i of P
OMEGA = "hadamard(P, G*V.T - rowsum(hadamard(G*V.T, P)) * ones(1, m))"
# seed 000's ∂f/∂A, one block per head
A_BAR_H = "hadamard(P_h, heads(G*W_O.T)*V_h.T - rowsum(hadamard(heads(G*W_O.T)*V_h.T, P_h)) * ones(1, m))"


def test_seed_003_value_weight_claim_is_refuted_with_a_counterexample():
    # seed 003: ∂L/∂W^V = Xᵀ ∂L/∂O (wrong: Pᵀ is missing)
    result = sa.check("self_attention", "W_V", "X.T * G")
    assert not result and result.status == "wrong"
    example = result.counterexample
    assert example is not None and example.claimed.shape == example.true.shape
    assert example.max_error > 1e-3
    assert set(example.inputs) >= {"X", "W_Q", "W_K", "G"}
    assert max(example.dims.values()) <= 6  # small matrices
    text = result.text()
    assert text.startswith("wrong") and "true:    ∂f/∂W_V = Xᵀ Pᵀ G" in text and "counterexample" in text


def test_seed_003_corrected_value_weight_is_confirmed():
    # ∂L/∂W^V = Xᵀ Pᵀ ∂L/∂O
    result = sa.check("self_attention", "W_V", "X.T * P.T * G")
    assert result and result.status == "right" and result.counterexample is None
    assert result.text().startswith("right")


def test_seed_003_score_claim_is_refuted():
    # seed 003: ∂L/∂A = Xᵀ ∂L/∂O (wrong: d_model × d_v, not n × n)
    result = sa.check("self_attention", "A", "X.T * G")
    assert not result and result.status == "wrong" and "shape" in result.reason
    assert result.counterexample.claimed.shape != result.counterexample.true.shape


def test_seed_003_correct_chain_is_confirmed():
    # ∂L/∂P = ∂L/∂O Vᵀ, ∂L/∂V = Pᵀ ∂L/∂O, ∂L/∂S = ∂L/∂A / √d_k, ∂L/∂W^Q = Xᵀ ∂L/∂S K
    a_bar = "hadamard(P, G*V.T - rowsum(hadamard(G*V.T, P)) * ones(1, n))"
    assert sa.check("self_attention", "P", "G * V.T")
    assert sa.check("self_attention", "V", "P.T * G")
    assert sa.check("self_attention", "A", a_bar)
    assert sa.check("self_attention", "S", f"{a_bar} / sqrt(d_k)")
    assert sa.check("self_attention", "W_Q", f"X.T * {a_bar} * K / sqrt(d_k)")
    assert not sa.check("self_attention", "W_K", f"X.T * {a_bar} * Q / sqrt(d_k)")  # needs the transpose


def test_seed_000_output_and_value_weights_are_confirmed():
    # ∂f/∂W^O = Concat(head_1 … head_H)ᵀ ∂f/∂X
    assert sa.check("mha", "W_O", "concat(O_h).T * G")
    assert sa.check("mha", "W_O", "C.T * G")
    # ∂f/∂W^v = Aᵀ ∂f/∂X (W^O)ᵀ with W^v block diagonal: its diagonal blocks, side by side
    assert sa.check("mha", "W_V", "V.T * concat(P_h.T * heads(G * W_O.T))")
    assert not sa.check("mha", "W_V", "V.T * concat(P_h.T * heads(G))")


def test_seed_000_query_and_key_weights_are_confirmed():
    # ∂f/∂W^Q_h = γ Qᵀ ∂f/∂A P_hᵀ K W^K_h and, without the stray d(·), ∂f/∂W^K_h = γ Kᵀ (∂f/∂A_h)ᵀ Q W^Q_h
    assert sa.check("mha", "W_Q", f"Q.T * concat({A_BAR_H} * K_h) / sqrt(d_k)")
    assert sa.check("mha", "W_K", f"K.T * concat(({A_BAR_H}).T * Q_h) / sqrt(d_k)")


def test_seed_000_stray_differential_is_refused_by_the_parser():
    with pytest.raises(ParseError, match=r"unknown function 'd'.* at column 14"):
        sa.check("mha", "W_K", "K.T * concat(d(Q_h))")


def test_seed_004_forms_are_confirmed():
    # seed 004 (no 1/√d): d_Q L = Ω K, d_K L = Ωᵀ Q, d_V L = Σ_i σ(p_i) e_iᵀ Λ = Pᵀ Λ
    assert sa.check("attention", "Q", f"{OMEGA} * K", scale=1)
    assert sa.check("attention", "K", f"({OMEGA}).T * Q", scale=1)
    assert sa.check("attention", "V", "P.T * G", scale=1)
    # with the default scale the same formulas miss the factor 1/√d_k
    assert not sa.check("attention", "Q", f"{OMEGA} * K")


@pytest.mark.parametrize("name", sa.specs())
def test_intermediates_cut_loose_still_compute_the_output(name, rng):
    # ∂f/∂Z for an intermediate Z rests on rewriting Y in terms of Z; Z put back must give Y
    s = sa.spec(name)
    short = Names(s.intermediates)
    for z, expr in s.intermediates:
        others = {sym: d for sym, d in short.definitions if sym.name != z}
        downstream = short(s.output)
        while downstream.has(*others):
            downstream = downstream.xreplace(others)
        rebuilt = downstream.xreplace({short.symbols[z]: expr})
        dims = random_dims([s.output], rng, fixed={"H": 2})
        fixed = {k.name: v for k, v in dims.items()}
        values = [random_matrix(x, dims, rng) for x in s.inputs]
        want = lambdify(list(s.inputs), s.output, dims=fixed)(*values)
        got = lambdify(list(s.inputs), rebuilt, dims=fixed)(*values)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{name}: {z}")
        assert true_gradient(s, z).shape == expr.shape


def _names():
    s = sa.spec("self_attention")
    from symattn.derive.check import namespace

    return namespace(s)


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        ("X.T * * G", r"cannot parse .* at column 7"),
        ("X.T * Z", r"unknown name 'Z' .* at column 7"),
        ('__import__("os").system("true")', "only functions called by their name"),
        ('__import__("os")', r"unknown function '__import__' .* at column 1"),
        ("X.__class__", r"only \.T .* at column 1"),
        ("(lambda: X)()", "only functions called by their name"),
        ("lambda: X", "Lambda is not part of the expression language"),
        ("X[0]", "Subscript is not part of the expression language"),
        ("X.T * G if 1 else G", "IfExp is not part of the expression language"),
        ("softmax(X, axis=0)", "keyword arguments are not allowed"),
        ("P + 1", "cannot add a matrix and a scalar at column 3"),
        ("'X'", "only numbers"),
        ("", "empty"),
        ("X.T *\n G", "one line"),
    ],
)
def test_the_parser_refuses_anything_outside_the_language(formula, message):
    with pytest.raises(ParseError, match=message):
        parse(formula, _names())


@pytest.mark.parametrize(
    "formula",
    ["-" * 100_000 + "X", "(" * 1000 + "X" + ")" * 1000, "X" + ".T" * 100_000],
    ids=["100000 minus signs", "1000 parentheses", "100000 transposes"],
)
def test_pathological_formulas_are_refused_cleanly(formula):
    with pytest.raises(ParseError):
        parse(formula, _names())


def test_shape_mismatch_in_a_formula_names_both_shapes_and_the_column():
    with pytest.raises(sa.ShapeMismatchError, match=r"column 3.*\(n, d_model\) and \(n, d_v\)"):
        parse("X * G", _names())


def test_the_parser_reads_the_language():
    names = _names()
    x, g, p = names["X"], names["G"], names["P"]
    assert parse("X.T * P.T * G", names) == x.T * p.T * g
    assert parse("  X.T @ P.T @ G ", names) == x.T * p.T * g
    assert parse("hadamard(P, P) / 2", names) == product(sp.Rational(1, 2), sa.hadamard(p, p))


def test_a_formula_keeps_a_name_of_a_deep_spec_one_node():
    """Products, sums and transposes are built on the DAG: a deep spec's layer Y_28 enters the claim as the spec's
    own nodes, not as a tree SymPy's doit rebuilt below it (exponential in the depth here)."""
    from symattn.derive.check import namespace

    n, d = dim("n"), dim("d")
    y = sp.MatrixSymbol("X", n, d)
    weights, named = [], []
    for i in range(30):
        weights.append(sp.MatrixSymbol(f"W_{i}", d, d))
        y = total(y, sa.tanh(product(y, weights[-1])))
        named.append((f"Y_{i}", y))
    s = sa.Spec("deep", "residual tanh stack", (sp.MatrixSymbol("X", n, d), *weights), y, tuple(named))
    names = namespace(s)
    claim = parse("Y_28.T * G / 2 - Y_28.T * G", names)
    assert len(nodes(claim)) < 10 * 30  # linear in the depth (SymPy's doit walks the 2³⁰-leaf tree)
    assert product(sp.Rational(-1, 2), transpose(names["Y_28"]), names["G"]) is claim  # like terms collected
    assert sa.check(
        s, "W_29", "Y_28.T * hadamard(G, ones(n, d) - hadamard(tanh(Y_28 * W_29), tanh(Y_28 * W_29)))"
    ).right
    wrong = sa.check(s, "W_0", "X.T * G")  # the truth, 30 layers deep, is evaluated on the DAG, not printed
    assert wrong.wrong and "∂f/∂W_0 = (a closed form of over 1500 symbols" in wrong.text()


def test_check_command_exit_status_and_report(capsys):
    assert main(["check", "self_attention", "--wrt", "W_V", "X.T * G"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("wrong") and "claimed value" in out and "true value" in out
    assert main(["check", "self_attention", "--wrt", "W_V", "X.T * P.T * G"]) == 0
    assert capsys.readouterr().out.startswith("right")
    assert main(["check", "attention", "--wrt", "V", "--option", "scale=1", "P.T * G"]) == 0


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "nope", "--wrt", "X", "X"],
        ["check", "self_attention", "--wrt", "Z", "X"],
        ["check", "self_attention", "--wrt", "W_V", "X.T * * G"],
        ["check", "self_attention", "X.T * G"],
        ["check", "self_attention", "--wrt", "W_V", "--option", "nonsense", "X.T * G"],
        ["check", "self_attention", "--wrt", "W_V", "tr(X.T * X)"],
    ],
)
def test_bad_check_arguments_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
