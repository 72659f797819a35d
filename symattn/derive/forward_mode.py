"""The forward-mode derivation of a spec: each value's differential along the inputs' tangents, in order.

The output Y = F(x) is computed through named values Z₁, …, Z_k (the forward pass every document prints). Let
dx be the tangent of input x, any direction. Each value's differential is written with the differentials of
what it reads — dZ = ∂Z/∂A [dA] + … by the node's rule (the product rule, f′(A) ⊙ dA entrywise,
P ⊙ (dA − rowsum(dA ⊙ P) 𝟏ᵀ) for the softmax; ``autodiff.differentials``) — so that dY, the last, is the
Jacobian-vector product Σ_x ∂F/∂x [dx] that the generated ``jvp`` computes (``specs.forward_mode``).

``verify`` checks every step on its own by a central difference: at random inputs (each named value computed
from them, per-head blocks with their heads axis) and random tangents of what the value reads, the right side
against (Z(reads + h·d) − Z(reads − h·d)) / 2h, in float64.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.autodiff.differentials import differential, differential_of
from symattn.derive.formats.document import PAGE, Document, escape_latex
from symattn.derive.steps import node_reasons
from symattn.errors import SymattnError
from symattn.lang.graph import matrix_symbols
from symattn.lang.positions import index_sizes
from symattn.numeric.lambdify import lambdify
from symattn.numeric.verify import dimension_symbols, random_constant, random_dims, random_matrix
from symattn.specs import Spec

__all__ = ["ForwardCheck", "ForwardDerivation"]

NOTATION = (
    "dx is the tangent of input x, any direction. Each value's differential is written with the differentials "
    "of what it reads, so d{out} = Σ_x ∂{out}/∂x [dx] is the Jacobian-vector product (the generated jvp). "
    "⊙ is the entrywise product, 𝟏 a column of ones; `symattn derive --mode forward --verify` checks every "
    "step against a central difference."
)
LATEX_NOTATION = (
    r"$\mathrm{{d}}x$ is the tangent of input $x$, any direction. Each value's differential is written with "
    r"the differentials of what it reads, so $\mathrm{{d}}{out} = \sum_x \partial {out} / \partial x\,"
    r"[\mathrm{{d}}x]$ is the Jacobian-vector product (the generated \texttt{{jvp}}). $\odot$ is the entrywise "
    r"product, $\mathbf{{1}}$ a column of ones; \texttt{{symattn derive --mode forward --verify}} checks every "
    r"step against a central difference."
)
DIFFERENCE_TOL = 1e-6  # a central difference (h = 1e-6, float64) against the step's right side
STEP = 1e-6


@dataclass(frozen=True)
class ForwardStep:
    """dZ = differential: Z's definition (value, in the earlier names) and its differential, with the reason."""

    symbol: Basic
    value: Basic
    differential: Basic
    reason: str


@dataclass(frozen=True)
class ForwardCheck:
    """One step checked: the largest discrepancy (relative to the difference's largest entry, at least 1)."""

    name: str
    reason: str
    discrepancy: float
    tolerance: float = DIFFERENCE_TOL

    @property
    def ok(self) -> bool:
        return bool(self.discrepancy <= self.tolerance)


class ForwardDerivation:
    """The forward-mode derivation of spec: ``steps``, one per value of the forward pass, in order."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.doc = Document(spec, latex=False)
        tangents: dict[Basic, Basic] = {x: differential_of(x) for x in spec.inputs}
        self.steps: list[ForwardStep] = []
        for symbol, value in self.doc.short.definitions:
            reads = [*matrix_symbols(value), *(s for s in value.free_symbols if s in tangents)]
            d = differential(value, {r: tangents[r] for r in reads if r in tangents})
            if d is None:  # a value of constants only: it does not move
                d = sp.ZeroMatrix(*value.shape) if isinstance(value, MatrixExpr) else sp.Integer(0)
            self.steps.append(ForwardStep(symbol, value, d, _reason(value)))
            tangents[symbol] = differential_of(symbol)

    def _rows(self, latex: bool) -> list[tuple[str, str, str]]:
        doc = Document(self.spec, latex=latex)
        return [(doc.p.doprint(differential_of(s.symbol)), doc.expr(s.differential), s.reason) for s in self.steps]

    def text(self, checks: list[ForwardCheck] | None = None) -> str:
        """Plain unicode text: the forward pass, the notation, one differential per line (a mark each when
        checks are given)."""
        doc = self.doc
        out = [f"Forward mode of {self.spec.name}: {self.spec.summary}", "", "Forward pass:"]
        out += [f"  {name} = {value}" for name, value in doc.forward()]
        out += ["", textwrap.fill(NOTATION.replace("{out}", doc.p.name(doc.output)), width=100), ""]
        rows = self._rows(latex=False)
        width = max(len(left) for left, _, _ in rows)
        for i, (left, right, reason) in enumerate(rows):
            mark = "" if checks is None else ("✓ " if checks[i].ok else "✗ ")
            out.append(f"{mark}  {left:<{width}} = {right}    [{reason}]")
        return "\n".join(out) + "\n"

    def _aligned(self) -> str:
        rows = self._rows(latex=True)
        return " \\\\\n".join(rf"{left} &= {right} && \text{{({reason})}}" for left, right, reason in rows)

    def latex(self, standalone: bool = False) -> str:
        """A LaTeX fragment (amsmath), or with standalone a document pdflatex compiles."""
        doc = Document(self.spec, latex=True)
        forward = " \\\\\n".join(rf"{doc.p.doprint(s)} &= {doc.p.doprint(v)}" for s, v in doc.short.definitions)
        notation = LATEX_NOTATION.format(out=doc.p.name(doc.output))
        body = [
            rf"\section*{{Forward mode of \texttt{{{escape_latex(self.spec.name)}}}}}",
            "Forward pass:",
            r"\begin{align*}",
            forward,
            r"\end{align*}",
            notation,
            r"\begin{align*}",
            self._aligned(),
            r"\end{align*}",
        ]
        if not standalone:
            return "\n".join(body) + "\n"
        preamble = [r"\documentclass[10pt]{article}", PAGE, r"\usepackage{amsmath}", r"\allowdisplaybreaks"]
        return "\n".join([*preamble, r"\begin{document}", *body, r"\end{document}", ""])

    def markdown(self) -> str:
        """GitHub Markdown: the forward pass and the differentials as $$ blocks of aligned LaTeX."""
        doc = Document(self.spec, latex=True)
        forward = " \\\\\n".join(rf"{doc.p.doprint(s)} &= {doc.p.doprint(v)}" for s, v in doc.short.definitions)
        out = [f"# Forward mode of {self.spec.name}", "", "<!-- written by `symattn derive`; do not edit -->", ""]
        out += ["Forward pass:", "", "$$", r"\begin{aligned}", forward, r"\end{aligned}", "$$", ""]
        out += [NOTATION.replace("{out}", self.doc.p.name(self.doc.output)), ""]
        out += ["$$", r"\begin{aligned}", self._aligned().replace("&&", r"\quad"), r"\end{aligned}", "$$", ""]
        return "\n".join(out)

    def render(self, fmt: str, standalone: bool = False) -> str:
        if fmt == "text":
            return self.text()
        if fmt == "latex":
            return self.latex(standalone)
        if fmt == "markdown":
            return self.markdown()
        raise SymattnError(f"the forward-mode derivation prints as text, latex or markdown, not {fmt}")

    def verify(self, seed: int = 0) -> list[ForwardCheck]:
        """Each step against a central difference of its value's definition (see the module docstring)."""
        rng = np.random.default_rng(seed)
        every = [self.spec.output, *self.spec.matrix_inputs, *self.spec.constants]
        names = {s.name for s in dimension_symbols(*every)}
        fixed = {"H": 4, "H_kv": 2} if "H_kv" in names else {"H": 2} if "H" in names else {}
        dims = random_dims(every, rng, low=2, high=4, fixed=fixed)
        size = {str(s.name): v for s, v in dims.items()}
        values = {x: _draw(x, dims, rng) for x in self.spec.inputs}
        indices = index_sizes(self.spec.output) if self.spec.constants else {}
        values |= {x: random_constant(x, dims, rng, indices) for x in self.spec.constants}
        checks = []
        for step in self.steps:
            checks.append(self._check(step, values, size, rng))
            reads = _reads(step.value, values)
            values[step.symbol] = lambdify(reads, step.value, dims=size)(*(values[r] for r in reads))
        return checks

    def _check(self, step: ForwardStep, values: dict, size: dict, rng: np.random.Generator) -> ForwardCheck:
        reads = _reads(step.value, values)
        moving = [r for r in reads if differential_of(r) in _nodes(step.differential)]
        tangents = {r: _like(r, f"t_{i}") for i, r in enumerate(moving)}
        rule = step.differential.xreplace({differential_of(r): t for r, t in tangents.items()})
        at = [values[r] for r in reads]
        directions = [rng.standard_normal(np.shape(values[r])) for r in moving]
        value = lambdify(reads, step.value, dims=size)
        right = lambdify([*reads, *tangents.values()], rule, dims=size)(*at, *directions)

        def moved(sign: float) -> np.ndarray:
            shifted = list(at)
            for r, d in zip(moving, directions):
                shifted[reads.index(r)] = at[reads.index(r)] + sign * STEP * d
            return np.asarray(value(*shifted), dtype=np.float64)

        difference = (moved(1.0) - moved(-1.0)) / (2 * STEP)
        scale = max(1.0, float(np.max(np.abs(difference))) if difference.size else 1.0)
        discrepancy = float(np.max(np.abs(np.asarray(right, dtype=np.float64) - difference))) / scale
        return ForwardCheck(self.doc.p.doprint(differential_of(step.symbol)), step.reason, discrepancy)

    def report(self, checks: list[ForwardCheck]) -> str:
        """One line: how many steps were checked, and every one that failed."""
        failed = [c for c in checks if not c.ok]
        lines = [f"{len(checks) - len(failed)} of {len(checks)} steps agree with a central difference"]
        lines += [f"  {c.name} [{c.reason}]: discrepancy {c.discrepancy:.2e} > {c.tolerance:.0e}" for c in failed]
        return "\n".join(lines) + "\n"


def _reason(value: Basic) -> str:
    """The forward differential's reason: the value's node's first reason (a bare name: the same value)."""
    if isinstance(value, (MatrixSymbol, sp.Symbol)):
        return "the same value"
    return node_reasons(value)[0]


def _reads(value: Basic, known: dict) -> list[Basic]:
    """The inputs, constants and earlier values that value reads, in a fixed order."""
    return sorted((s for s in value.free_symbols | matrix_symbols(value) if s in known), key=str)


def _nodes(expr: Basic) -> set:
    return set(sp.preorder_traversal(expr))


def _like(read: Basic, name: str) -> Basic:
    """A symbol of read's kind and shape, standing for its tangent."""
    return MatrixSymbol(name, *read.shape) if isinstance(read, MatrixExpr) else sp.Symbol(name, real=True)


def _draw(read: Basic, dims: dict, rng: np.random.Generator) -> np.ndarray | float:
    """A random value of an input or constant (a trainable scalar away from zero)."""
    if not isinstance(read, MatrixExpr):
        return float(rng.uniform(0.5, 1.5))
    return random_matrix(read, dims, rng)
