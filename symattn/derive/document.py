"""Derivations as documents: a LaTeX fragment or standalone document, Markdown, plain text.

A document states the forward pass with its named intermediates, the notation, and
then for each target the chain of ``steps``: one aligned block of equalities, each
with its justification, the cotangents named as they complete, and ∂f/∂W both with
the names and in closed form. Expressions are printed by ``latex`` after the
intermediates are put back in by ``names``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from sympy import Basic

from symattn.derive.latex import LATEX, TEXT, MathPrinter, latex_name
from symattn.derive.steps import DF, Chain, Definition, Side
from symattn.lang.names import Names
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

    def __init__(self, spec: Spec, latex: bool) -> None:
        self.spec = spec
        self.p = MathPrinter(LATEX if latex else TEXT)
        named = list(spec.intermediates)
        if all(expr != spec.output for _, expr in named):
            named.append(("Y", spec.output))
        self.short = Names(named)
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
        return " + ".join(self.p.trace(self.short(t.matrix), t.per_head) for t in side)

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

    def result(self, c: Chain) -> tuple[str, str, str | None]:
        """(∂f/∂W, named form, closed form); the closed form None when too long to write out."""
        target = self.p.doprint(c.target)
        if self.p.n is LATEX:
            head = rf"\frac{{\partial f}}{{\partial {target}}}"
        else:
            head = f"∂f/∂{target}"
        closed = c.closed_form()
        return head, self.expr(c.gradient), None if closed is None else self.expr(closed)


def _title(spec: Spec) -> str:
    return f"Gradients of {spec.name}: {spec.summary}"


def _target_title(c: Chain, latex: bool) -> str:
    name = str(c.target.name)
    return rf"$\partial f / \partial {latex_name(name)}$" if latex else f"∂f/∂{name}"


CLOSED_FORM_MAX = 3000  # characters of LaTeX in one closed form (a deep block's ∂f/∂X runs to 14 000)
NOT_WRITTEN_OUT = "the definitions above substituted into each other (too long to write out on one line)"


def _aligned(doc: Document, c: Chain) -> str:
    """One aligned block of LaTeX rows for a chain."""
    rows = [rf"{left} &{sign} {right} && \text{{{reason}}}" for left, sign, right, reason in doc.lines(c)]
    head, named, closed = doc.result(c)
    rows.append(rf"{head} &= {named}")
    # too long to write out, or wider than TeX's largest dimension (~5.7 m)
    if closed is None or (closed != named and len(closed) > CLOSED_FORM_MAX):
        rows.append(rf"&= \text{{{NOT_WRITTEN_OUT}}}")
    elif closed != named:
        rows.append(rf"&= {closed}")
    return " \\\\\n".join(rows)


def latex_fragment(spec: Spec, chains: Sequence[Chain]) -> str:
    """LaTeX body: forward pass, notation and one align* block per target (needs amsmath)."""
    doc = Document(spec, latex=True)
    title = rf"\section*{{Gradients of \texttt{{{_escape(spec.name)}}}}}"
    out = [title, "Forward pass:", r"\begin{align*}"]
    out.append(" \\\\\n".join(f"{name} &= {value}" for name, value in doc.forward()))
    out += [r"\end{align*}", doc.notation(), ""]
    for c in chains:
        out += [rf"\subsection*{{{_target_title(c, True)}}}", r"\begin{align*}", _aligned(doc, c), r"\end{align*}", ""]
    return "\n".join(out)


def latex_document(spec: Spec, chains: Sequence[Chain]) -> str:
    """A complete document that pdflatex compiles (article, amsmath only)."""
    preamble = [
        r"\documentclass[10pt]{article}",
        r"\usepackage{amsmath}",
        r"\allowdisplaybreaks",
        # a wide page (pdfTeX primitives, no extra package): the longest lines run to ~13 in
        r"\pdfpagewidth=18in \paperwidth=18in \textwidth=16.5in \oddsidemargin=-0.25in",
        r"\begin{document}",
    ]
    return "\n".join([*preamble, latex_fragment(spec, chains), r"\end{document}", ""])


def math_display(spec: Spec, chains: Sequence[Chain]) -> str:
    """Math mode only (Jupyter's _repr_latex_): one $$ aligned $$ block per target."""
    doc = Document(spec, latex=True)
    return "\n".join(rf"$$\begin{{aligned}}{_aligned(doc, c)}\end{{aligned}}$$" for c in chains)


def markdown(spec: Spec, chains: Sequence[Chain]) -> str:
    """GitHub Markdown: $$ blocks of aligned LaTeX."""
    doc = Document(spec, latex=True)
    out = [f"# {_title(spec)}", "", "<!-- written by `symattn derive`; do not edit -->", "", "Forward pass:", ""]
    out += ["$$", r"\begin{aligned}", " \\\\\n".join(f"{n} &= {v}" for n, v in doc.forward()), r"\end{aligned}", "$$"]
    out += ["", doc.notation(), ""]
    for c in chains:
        out += [
            f"## {_target_title(c, True)}",
            "",
            "$$",
            r"\begin{aligned}",
            _aligned(doc, c),
            r"\end{aligned}",
            "$$",
            "",
        ]
    return "\n".join(out)


def text(spec: Spec, chains: Sequence[Chain]) -> str:
    """Plain unicode text, one equality per line, reasons in brackets."""
    doc = Document(spec, latex=False)
    out = [_title(spec), "", "Forward pass:"]
    out += [f"  {name} = {value}" for name, value in doc.forward()]
    out += ["", textwrap.fill(doc.notation(), width=100)]
    for c in chains:
        out += ["", _target_title(c, False), ""]
        rows = doc.lines(c)
        width = max((len(left) for left, *_ in rows), default=0)
        for left, sign, right, reason in rows:
            out.append(f"  {left:>{width}} {sign} {right}    [{reason}]")
        head, named, closed = doc.result(c)
        if closed is None:
            closed = f"({NOT_WRITTEN_OUT})"
        out.append(f"  {head} = {named}" + (f" = {closed}" if closed != named else ""))
    return "\n".join(out) + "\n"


def _escape(words: str) -> str:
    """An identifier for LaTeX text mode."""
    return words.replace("_", r"\_")


__all__ = ["latex_document", "latex_fragment", "markdown", "math_display", "text"]
