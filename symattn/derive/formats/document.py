"""Derivations as documents: a LaTeX fragment or standalone document, Markdown, plain text.

A document states the forward pass with its named intermediates, the notation, and
then each chain of ``steps``: one aligned block of equalities, each with its
justification, the cotangents named as they complete, and ∂f/∂W both with the names
and in closed form. A chain of one target is one section; a sweep shared by several
targets is a section of steps, then a short section per target giving its gradient.
Expressions are printed by ``latex`` after the intermediates are put back in by ``names``.
"""

from __future__ import annotations

import textwrap
import unicodedata
from collections.abc import Mapping, Sequence

from sympy import Basic

from symattn.derive.formats.latex import BREAK, LATEX, TEXT, MathPrinter, latex_name
from symattn.derive.formats.layout import RELATION, break_lines, width
from symattn.derive.naming import DisplayNames, named_intermediates
from symattn.derive.steps import DF, Chain, Definition, Side
from symattn.specs import Spec

NOTATION = (
    "f is a scalar function of the output {out} and G = ∂f/∂{out} its cotangent. For every "
    "intermediate Z, Z̄ = ∂f/∂Z is the cotangent of Z: df = tr(Z̄ᵀ dZ) when only Z moves. "
    "Each step pushes one term tr(Z̄ᵀ dZ) through the node that computes Z, until only dW is left "
    "and df = tr(W̄ᵀ dW) gives ∂f/∂W = W̄. ⊙ is the entrywise product, 𝟏 a column of ones; "
    "`symattn derive --verify` checks every equality below numerically."
)

LATEX_NOTATION = (
    r"$f$ is a scalar function of the output ${out}$ and $G = \partial f / \partial {out}$ its cotangent. "
    r"For every intermediate $Z$, $\bar{Z} = \partial f / \partial Z$ is the cotangent of $Z$: "
    r"$\mathrm{d}f = \operatorname{tr}(\bar{Z}^{T} \mathrm{d}Z)$ when only $Z$ moves. "
    r"Each step pushes one term $\operatorname{tr}(\bar{Z}^{T} \mathrm{d}Z)$ through the node that computes $Z$, "
    r"until only $\mathrm{d}W$ is left and $\mathrm{d}f = \operatorname{tr}(\bar{W}^{T} \mathrm{d}W)$ gives "
    r"$\partial f / \partial W = \bar{W}$. $\odot$ is the entrywise product, $\mathbf{1}$ a column of ones; "
    r"\texttt{symattn derive --verify} checks every equality below numerically."
)

PER_HEAD = (
    "Per-head blocks carry the index h: Q_h = Q W_Q,h is head h's column block, Σ_h sums over the heads "
    "and Concat_h puts the heads' blocks side by side."
)
LATEX_PER_HEAD = (
    r"Per-head blocks carry the index $h$: $Q W^{Q}_{h}$ is head $h$'s column block, $\sum_{h}$ sums over "
    r"the heads and $\operatorname{Concat}_{h}$ puts the heads' blocks side by side."
)


class Document:
    """The pieces every format assembles: forward pass, chains, printed in one notation."""

    def __init__(self, spec: Spec, latex: bool, breaks: bool = False) -> None:
        """breaks: mark in every printed expression where a long line may break (``layout.BREAK``)."""
        self.spec = spec
        self.p = MathPrinter(LATEX if latex else TEXT, {"breaks": breaks})
        named = named_intermediates(spec)
        if all(expr != spec.output for _, expr in named):
            named.append(("Y", spec.output))
        self.short = DisplayNames(named)
        self.output = next(name for name, expr in named if expr == spec.output)
        self.per_head = any(name.endswith("_h") for name, _ in named)

    def notation(self) -> str:
        """The paragraph that explains the notation (unwrapped)."""
        latex = self.p.n is LATEX
        out = self.p.name(self.output)
        text = (LATEX_NOTATION if latex else NOTATION).replace("{out}", out)
        if self.per_head:
            text += " " + (LATEX_PER_HEAD if latex else PER_HEAD)
        return text

    def expr(self, e: Basic) -> str:
        return self.p.doprint(self.short(e))

    def side(self, side: Side) -> str:
        if side == DF:
            return self.p.n.differential + "f"
        return (self.p.brk + " + ").join(
            self.p.doprint(self.short(t.matrix)) if t.is_scalar else self.p.trace(self.short(t.matrix), t.per_head)
            for t in side
        )

    def forward(self) -> list[tuple[str, str]]:
        """(name, definition) of every intermediate, in forward order."""
        return [(self.p.doprint(symbol), self.p.doprint(short)) for symbol, short in self.short.definitions]

    def lines(self, c: Chain) -> list[tuple[str, str, str, str]]:
        """(left side, "=" or ":=", right side, reason) rows, equations and definitions in order."""
        rows: list[tuple[str, str, str, str]] = []
        for item in c.items:
            if isinstance(item, Definition):
                rows.append((self.p.doprint(item.symbol), ":=", self.expr(item.value), "definition"))
                continue
            left = self.side(item.sides[0])
            for k, side in enumerate(item.sides[1:]):
                rows.append((left if k == 0 else "", "=", self.side(side), item.reasons[k]))
        return rows

    def head(self, target: Basic) -> str:
        """∂f/∂W."""
        name = self.p.doprint(target)
        return rf"\frac{{\partial f}}{{\partial {name}}}" if self.p.n is LATEX else f"∂f/∂{name}"

    def forms(self, c: Chain, target: Basic) -> list[str | None]:
        """∂f/∂W's forms, each printed once: W̄, W̄'s value in the names just met (P, Ā, …), the closed form.

        The closed form is None when too long to write out (it is always the last form).
        """
        closed = c.closed_form(target)
        closed_text = None if closed is None else self.expr(closed)
        gradient = c.gradients[target]
        forms = [self.expr(gradient)]
        value = c.definition(gradient)
        if value is not None:
            forms.append(self.expr(value))
        return [*dict.fromkeys(f for f in forms if f != closed_text), closed_text]

    def result(self, c: Chain, target: Basic) -> tuple[str, str, str | None]:
        """(∂f/∂W, named form, closed form); the closed form None when too long to write out."""
        closed = c.closed_form(target)
        return self.head(target), self.expr(c.gradients[target]), None if closed is None else self.expr(closed)


def _title(spec: Spec) -> str:
    return f"Gradients of {spec.name}: {spec.summary}"


def _target_title(target: Basic, latex: bool) -> str:
    name = str(target.name)
    return rf"$\partial f / \partial {latex_name(name)}$" if latex else f"∂f/∂{name}"


SWEEP_TITLE = "The backward pass, shared by every gradient"


def sections(c: Chain) -> list[tuple[Basic | None, bool, tuple[Basic, ...]]]:
    """(title target or None for the shared sweep, with the steps?, targets whose results follow) per section."""
    if len(c.targets) == 1:
        return [(c.target, True, c.targets)]
    return [(None, True, ()), *((t, False, (t,)) for t in c.targets)]


def _title_of(target: Basic | None, latex: bool) -> str:
    return SWEEP_TITLE if target is None else _target_title(target, latex)


CLOSED_FORM_MAX = 3000  # characters of LaTeX in one closed form (a deep block's ∂f/∂X runs to 14 000)
NOT_WRITTEN_OUT = "the definitions above substituted into each other (too long to write out on one line)"
LATEX_NOT_WRITTEN_OUT = r"\text{the definitions above, substituted (too long to write out)}"

# The page: A4 with 2 cm margins gives a text width of 483 pt; the math is broken to fit it.
PAGE = r"\usepackage[a4paper,margin=2cm]{geometry}"
TEXT_WIDTH = 483.0
SAFETY = 0.9  # the width estimate is within about 10 % of TeX's
LEFT_MAX = 130.0  # a left side wider than this gets a row of its own (it would push every row right)
CONTINUATION = r"\quad {}"  # a continued line starts a quad in, its operator spaced as binary


class _Rows:
    """Rows of one align block: left &sign right, broken to the page, each labelled once.

    tags: labels as \tag*{…} (align*: right-flush, below the row where it would not fit);
    otherwise a third column (aligned, for MathJax, which has no \tag in aligned).
    """

    def __init__(self, lefts: Sequence[str], tags: bool) -> None:
        self.tags = tags
        self.left_width = max((w for w in map(width, lefts) if w <= LEFT_MAX), default=0.0)
        self.budget = SAFETY * TEXT_WIDTH - self.left_width - RELATION
        self.rows: list[str] = []

    def add(self, left: str, sign: str, right: str, reason: str | None = None) -> None:
        if left and width(left) > LEFT_MAX:  # rows of its own, from the alignment point
            lines = break_lines(left, self.budget - width(CONTINUATION), first=self.budget + RELATION)
            self.rows += [f"& {lines[0]}", *(f"&{CONTINUATION}{line}" for line in lines[1:])]
            left = ""
        left = left.replace(BREAK, "")
        lines = break_lines(right, self.budget - width(CONTINUATION), first=self.budget)
        label = ""
        if reason:
            label = rf" \tag*{{\footnotesize {reason}}}" if self.tags else rf" && \text{{{reason}}}"
        self.rows.append(f"{left} &{sign} {lines[0]}{label}")
        self.rows += [f"&{CONTINUATION}{line}" for line in lines[1:]]

    def text(self) -> str:
        return " \\\\\n".join(self.rows)


def _aligned(doc: Document, c: Chain, steps: bool, targets: Sequence[Basic], tags: bool = False) -> str:
    """One block of LaTeX rows: the chain's steps, then each target's gradient (align* rows with tags,
    else aligned rows with a label column)."""
    lines = doc.lines(c) if steps else []
    heads = [doc.head(t) for t in targets]
    rows = _Rows([left for left, *_ in lines] + heads, tags)
    for left, sign, right, reason in lines:
        rows.add(left, sign, right, reason)
    for target, head in zip(targets, heads):
        *forms, closed = doc.forms(c, target)
        for k, form in enumerate(forms):
            rows.add(head if k == 0 else "", "=", form)
        # too long to write out, or wider than TeX's largest dimension (~5.7 m)
        if closed is None or len(closed) > CLOSED_FORM_MAX:
            rows.add("", "=", LATEX_NOT_WRITTEN_OUT)
        else:
            rows.add(head if not forms else "", "=", closed)
    return rows.text()


def _forward(doc: Document, tags: bool) -> str:
    definitions = doc.forward()
    rows = _Rows([name for name, _ in definitions], tags)
    for name, value in definitions:
        rows.add(name, "=", value)
    return rows.text()


def latex_fragment(spec: Spec, chains: Sequence[Chain]) -> str:
    """LaTeX body: forward pass, notation and one align* block per target (needs amsmath)."""
    doc = Document(spec, latex=True, breaks=True)
    title = rf"\section*{{Gradients of \texttt{{{escape_latex(spec.name)}}}}}"
    out = [title, "Forward pass:", r"\begin{align*}", _forward(doc, tags=True), r"\end{align*}", doc.notation(), ""]
    for c in chains:
        for target, steps, targets in sections(c):
            block = _aligned(doc, c, steps, targets, tags=True)
            out += [rf"\subsection*{{{_title_of(target, True)}}}", r"\begin{align*}", block, r"\end{align*}", ""]
    return "\n".join(out)


def latex_document(spec: Spec, chains: Sequence[Chain]) -> str:
    """A complete document that pdflatex compiles (article on A4, amsmath and geometry only)."""
    preamble = [
        r"\documentclass[10pt]{article}",
        PAGE,
        r"\usepackage{amsmath}",
        r"\allowdisplaybreaks",
        r"\begin{document}",
    ]
    return "\n".join([*preamble, latex_fragment(spec, chains), r"\end{document}", ""])


def math_display(spec: Spec, chains: Sequence[Chain]) -> str:
    """Math mode only (Jupyter's _repr_latex_): one $$ aligned $$ block per target."""
    doc = Document(spec, latex=True, breaks=True)
    blocks = (_aligned(doc, c, steps, targets) for c in chains for _, steps, targets in sections(c))
    return "\n".join(rf"$$\begin{{aligned}}{block}\end{{aligned}}$$" for block in blocks)


def markdown(spec: Spec, chains: Sequence[Chain]) -> str:
    """GitHub Markdown: $$ blocks of aligned LaTeX."""
    doc = Document(spec, latex=True, breaks=True)
    out = [f"# {_title(spec)}", "", "<!-- written by `symattn derive`; do not edit -->", "", "Forward pass:", ""]
    out += ["$$", r"\begin{aligned}", _forward(doc, tags=False), r"\end{aligned}", "$$"]
    out += ["", doc.notation(), ""]
    for c in chains:
        for target, steps, targets in sections(c):
            block = _aligned(doc, c, steps, targets)
            out += [f"## {_title_of(target, True)}", "", "$$", r"\begin{aligned}", block, r"\end{aligned}", "$$", ""]
    return "\n".join(out)


def display_width(text: str) -> int:
    """Columns a monospace terminal gives text: combining marks (the bar of P̄) take none."""
    return sum(not unicodedata.combining(ch) for ch in text)


def _pad(text: str, columns: int) -> str:
    """text right-aligned in columns."""
    return " " * max(0, columns - display_width(text)) + text


TEXT_LEFT_MAX = 28  # columns; a wider left side gets a line of its own
TEXT_RESULT_MAX = 120  # columns; a longer ∂f/∂W = … line gets one form per line


def text(spec: Spec, chains: Sequence[Chain], marks: Mapping[str, Sequence[str]] | None = None) -> str:
    """Plain unicode text, one equality per line, reasons in brackets.

    marks: target name → a mark per printed row and one for the result line (``symattn.derive.formats.marks``),
    printed in a column before the rows.
    """
    doc = Document(spec, latex=False)
    width_of_marks = max((len(m) for row in (marks or {}).values() for m in row), default=0)

    def marked(c: Chain, i: int, line: str) -> str:
        return line if marks is None else f"{marks[c.label][i]:<{width_of_marks}}{line}"

    out = [_title(spec), "", "Forward pass:"]
    out += [f"  {name} = {value}" for name, value in doc.forward()]
    out += ["", textwrap.fill(doc.notation(), width=100)]
    blank = " " * width_of_marks
    for c in chains:
        rows = doc.lines(c)
        for title, steps, targets in sections(c):
            out += ["", _title_of(title, False), ""]
            heads = [doc.head(t) for t in targets]
            lefts = [left for left, *_ in rows] * steps + heads
            width_ = max((w for w in map(display_width, lefts) if w <= TEXT_LEFT_MAX), default=0)
            for i, (left, sign, right, reason) in enumerate(rows if steps else ()):
                if display_width(left) > width_:
                    out.append(blank * (marks is not None) + f"  {left}")
                    left = ""
                out.append(marked(c, i, f"  {_pad(left, width_)} {sign} {right}    [{reason}]"))
            for target, head in zip(targets, heads):
                *forms, closed = doc.forms(c, target)
                forms.append(f"({NOT_WRITTEN_OUT})" if closed is None else closed)
                at = len(rows) + c.targets.index(target)  # the target's result line among the marks
                one_line = f"  {head} = " + " = ".join(forms)
                if display_width(one_line) <= TEXT_RESULT_MAX:
                    out.append(marked(c, at, one_line))
                else:  # one form per line, the = signs aligned with the steps'
                    lines = [f"  {_pad(head if k == 0 else '', width_)} = {form}" for k, form in enumerate(forms)]
                    out += [marked(c, at, lines[0]), *(blank * (marks is not None) + line for line in lines[1:])]
    return "\n".join(out) + "\n"


def escape_latex(words: str) -> str:
    """An identifier for LaTeX text mode."""
    return words.replace("_", r"\_")


__all__ = ["latex_document", "latex_fragment", "markdown", "math_display", "text"]
