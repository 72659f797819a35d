"""The LaTeX and text printers of the expression language (symattn.derive.formats.latex)."""

from __future__ import annotations

import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import Identity, OneMatrix, Trace

import symattn as sa
from symattn.autodiff.differentials import Differential
from symattn.derive.formats.latex import latex, latex_name, text, text_name

n, m, d = sp.symbols("n m d", positive=True, integer=True)
X = MatrixSymbol("X", n, d)
W_Q = MatrixSymbol("W_Q", d, d)
P = MatrixSymbol("P", n, m)


@pytest.mark.parametrize(
    ("identifier", "expected"),
    [
        ("W_Q", "W^{Q}"),
        ("W_O", "W^{O}"),
        ("d_k", "d_{k}"),
        ("d_model", r"d_{\text{model}}"),
        ("Q_h", "Q_{h}"),
        ("bar_P", r"\bar{P}"),
        ("bar_W_V", r"\bar{W}^{V}"),
        ("bar_A_h", r"\bar{A}_{h}"),
        ("G", "G"),
    ],
)
def test_identifiers_become_the_seeds_latex_names(identifier, expected):
    assert latex_name(identifier) == expected


def test_text_names_keep_identifiers_and_bar_cotangents():
    assert text_name("W_Q") == "W_Q"
    assert text_name("bar_P") == "P\u0304"


def test_ones_identity_and_exp_print_as_math_not_as_sympy_does():
    # SymPy prints OneMatrix as 1, Identity as \mathbb{I} and exp as a lambda
    assert latex(OneMatrix(n, 1)) == r"\mathbf{1}"
    assert latex(OneMatrix(1, m)) == r"\mathbf{1}^{T}"
    assert latex(OneMatrix(m, m)) == r"\mathbf{1}\,\mathbf{1}^{T}"
    assert latex(Identity(n)) == "I"
    assert latex(sa.exp(X)) == r"\exp(X)"
    assert "mapsto" not in latex(sa.exp(X))


def test_softmax_trace_hadamard_and_transposes():
    assert latex(sa.softmax(X * W_Q * X.T)) == r"\operatorname{softmax}(X\,W^{Q}\,X^{T})"
    assert latex(W_Q.T) == r"(W^{Q})^{T}"
    assert latex(Trace(X.T * X)) == r"\operatorname{tr}(X^{T}\,X)"
    dp = Differential(MatrixSymbol("A", n, m))
    # the softmax differential reads as in the seeds: P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ)
    expr = sa.hadamard(P, dp - sa.hadamard(P, dp) * OneMatrix(m, m))
    assert text(expr) == "P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ)"
    expected = r"P \odot (\mathrm{d}A - (P \odot \mathrm{d}A)\,\mathbf{1}\,\mathbf{1}^{T})"
    assert latex(expr) == expected


def test_row_sums_print_as_products_with_ones():
    assert text(sa.rowsum(P) * OneMatrix(1, m)) == "P 𝟏 𝟏ᵀ"
    assert text(sa.sum(P)) == "𝟏ᵀ P 𝟏"


def test_scalars_and_differentials():
    d_k = sp.Symbol("d_k", positive=True, integer=True)
    assert latex(X * W_Q / sp.sqrt(d_k)) == r"\tfrac{1}{\sqrt{d_{k}}}\,X\,W^{Q}"
    assert text(X * W_Q / sp.sqrt(d_k)) == "(1/√d_k) X W_Q"
    assert latex(Differential(W_Q)) == r"\mathrm{d}W^{Q}"
    assert text(Differential(X * W_Q)) == "d(X W_Q)"
    assert text(Differential(X.T)) == "dXᵀ"


def test_heads_print_as_blocks_and_concatenation():
    h = sp.Symbol("H", positive=True, integer=True)
    q = MatrixSymbol("Q", n, h * d)
    w = MatrixSymbol("W_Q", h * d, h * d)
    g = MatrixSymbol("G", n, h * d)
    assert latex(sa.split_heads(q * w, h)) == r"Q\,W^{Q}_{h}"
    assert latex(sa.split_heads(g * w.T, h)) == r"(G\,(W^{Q})^{T})_{h}"
    assert latex(sa.merge_heads(sa.split_heads(q, h), h)) == r"\operatorname{Concat}_{h}(Q_{h})"


def test_sums_print_positive_terms_first():
    a, b = MatrixSymbol("A", n, n), MatrixSymbol("B", n, n)
    assert text(-a + b) == "B − A"
    assert latex(a - 2 * b) == r"A - 2\,B"
