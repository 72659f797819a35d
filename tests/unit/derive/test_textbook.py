"""Printed algebra a textbook would print, for every built-in and gallery spec.

No printed product carries two scalar coefficients (50 ((1/50) A), (1/√d) ((1/√d) B)),
and a named intermediate's expression is printed only in its definition: anywhere
else it is printed by its name (inside powers and differentials too).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatMul, Transpose

import symattn as sa
from symattn.derive.folding import fold_scalars, scaled
from symattn.derive.formats.document import Document
from symattn.derive.formats.latex import text as text_of
from symattn.derive.steps import DF, Definition
from symattn.lang.algebra import factors
from symattn.lang.graph import postorder
from symattn.specs.files import load_spec_file

GALLERY = sorted((Path(__file__).resolve().parents[3] / "examples" / "specs").glob("*.py"))
SPECS = [*sa.specs(), *(p.stem for p in GALLERY)]


@pytest.fixture(scope="module")
def derived() -> dict[str, sa.Derivation]:
    return {}


def _derivation(name: str, derived: dict) -> sa.Derivation:
    if name not in derived:
        path = next((p for p in GALLERY if p.stem == name), None)
        derived[name] = sa.derive(load_spec_file(path) if path else name)
    return derived[name]


def _printed(d: sa.Derivation) -> tuple[Document, list[tuple[Basic, bool]]]:
    """Every expression the text prints, as printed (names put in); True where it is a definition's value."""
    doc = Document(d.spec, latex=False)
    out = [(value, True) for _, value in doc.short.definitions]
    for c in d.chains():
        for item in c.items:
            if isinstance(item, Definition):
                out.append((doc.short(item.value), False))
                continue
            out += [(doc.short(t.matrix), False) for side in item.sides if side != DF for t in side]
        for t in c.targets:
            g = c.gradients[t]
            out += [(doc.short(e), False) for e in (g, c.definition(g), c.closed_form(t)) if e is not None]
    return doc, out


def _coefficients(node: Basic) -> int:
    """How many scalar coefficients one product chain (through products, ⊙, ᵀ and ∘p) carries."""
    count, stack = 0, [node]
    while stack:
        e = stack.pop()
        if isinstance(e, MatMul):
            count += factors(e)[0] != 1
            stack += [a for a in e.args if isinstance(a, MatrixExpr)]
        elif isinstance(e, (HadamardProduct, Transpose)):
            stack += list(e.args)
        elif isinstance(e, HadamardPower):
            stack.append(e.args[0])
    return count


@pytest.mark.parametrize("name", SPECS)
def test_no_printed_product_holds_a_constant_and_its_inverse(name, derived):
    d = _derivation(name, derived)
    _, printed = _printed(d)
    for expr, _ in printed:
        for node in postorder(expr):
            if isinstance(node, (MatMul, HadamardProduct)):
                assert _coefficients(node) <= 1, f"{name}: two coefficients in one product: {text_of(node)}"
    text = d.text()
    assert not re.search(r"(\d+) \(\(1/\1\)", text) and not re.search(r"\(1/(\d+)\) \(\1 ", text)


@pytest.mark.parametrize("name", SPECS)
def test_a_named_intermediates_expression_appears_only_in_its_definition(name, derived):
    d = _derivation(name, derived)
    doc, printed = _printed(d)
    full: dict[Basic, Basic] = {}
    wanted: dict[Basic, MatrixSymbol] = {}  # a definition's expression, folded, without its coefficient → name
    for symbol, value in doc.short.definitions:
        full[symbol] = value.xreplace(full)
        key = scaled(fold_scalars(full[symbol]))[1]
        wanted.setdefault(key, symbol)
        wanted.setdefault(scaled(fold_scalars(key.T))[1], symbol)
    memo: dict[Basic, Basic] = {}

    def named_as(e: Basic) -> MatrixSymbol | None:
        if e not in memo:
            memo[e] = wanted.get(scaled(fold_scalars(e.xreplace(full)))[1])
        return memo[e]

    for expr, is_definition in printed:
        for node in postorder(expr):
            if isinstance(node, MatrixSymbol) or not isinstance(node, MatrixExpr) or (is_definition and node == expr):
                continue
            if isinstance(node, Transpose) and isinstance(node.arg, MatrixSymbol):
                continue  # Pᵀ: a name, transposed
            inner = scaled(node)[1]
            if isinstance(inner.T, MatrixSymbol) or isinstance(inner, MatrixSymbol):
                continue  # c N, c Nᵀ: a multiple of a name
            runs = [node]
            if isinstance(node, MatMul):  # runs of consecutive factors: X W_Q inside Xᵀ X W_Q is Q
                mats = factors(node)[1]
                runs += [MatMul(*mats[i:j]) for i in range(len(mats)) for j in range(i + 2, len(mats) + 1)]
            for run in runs:
                assert named_as(run) is None, f"{name}: {run} is printed instead of {named_as(run)}"


def test_the_softcap_example_reads_like_a_textbook(derived):
    text = _derivation("softcap_attention", derived).text("W_Q")
    assert "dA" in text and "T^∘2" in text and "𝟏𝟏ᵀ − T^∘2" in text
    assert "50 ((1/50)" not in text and "(1/50) A" not in text
    assert "  T = tanh(" in text and "  A = 50 T" in text and "  P = softmax(A)" in text


def test_text_columns_ignore_the_combining_bar():
    # the = signs of one block line up although P̄ has two code points
    text = sa.derive("attention").text("Q")
    block = text.split("∂f/∂Q\n\n")[1].splitlines()
    columns = {line.replace("\u0304", "").index(" = ") for line in block if " = " in line and line.startswith("   ")}
    assert len(columns) == 1, block
