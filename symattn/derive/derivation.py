"""Derivations: a spec's backward pass, its closed-form gradients, their printed and checked steps.

``derive(name)`` runs the engine once for every input (``.gradients``); the step by
step derivation (``chains``) is built on first use, so asking only for gradients stays
as cheap as before. ``sweep`` chooses its layout: "per-input" replays the path from the
output to each target on its own (it reads best for a small spec), "shared" prints one
reverse sweep, each step once, and then each gradient (its cost is the backward
pass's, linear in the spec); "auto" (the default) is per-input while that replays at
most PER_INPUT_MAX steps in all. ``.latex()``, ``.markdown()``, ``.text()`` print
it, ``.verify()`` evaluates every printed equality on random float64 matrices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sympy import Basic

from symattn.autodiff.grad import Tape, backward
from symattn.derive.formats import document as render
from symattn.derive.formats.marks import chain_marks
from symattn.derive.step_check import Check, verify_chain
from symattn.derive.steps import Chain, chain, replayed_steps
from symattn.errors import SymattnError
from symattn.lang.positions import require_constant_indices
from symattn.specs import Spec, spec

FORMATS = ("latex", "markdown", "text", "html")
SWEEPS = ("auto", "shared", "per-input")
PER_INPUT_MAX = 60  # steps replayed by one chain per input, in all, above which "auto" shares one sweep


@dataclass
class Verification:
    """Every checked equality of a derivation; ok when all agree within their tolerance."""

    spec: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    @property
    def max_discrepancy(self) -> float:
        """Largest relative discrepancy among the exact equalities (not the central difference)."""
        return float(np.max([c.discrepancy for c in self.checks if c.tolerance < 1e-6], initial=0.0))  # NaN shows

    def text(self) -> str:
        """One line per checked equality, then a summary."""
        lines = []
        for c in self.checks:
            mark = "ok  " if c.ok else "FAIL"
            where = f"{c.target:>5} step {c.step:>2} {c.node:<15}"
            lines.append(f"{mark} {where} {c.discrepancy:9.2e} (tol {c.tolerance:.0e})  {c.reason}")
        verdict = "all equalities agree" if self.ok else f"{len(self.failures)} equalities FAIL"
        lines.append(
            f"{self.spec}: {len(self.checks)} equalities checked, max relative discrepancy "
            f"{self.max_discrepancy:.2e} (exact), {verdict}"
        )
        return "\n".join(lines) + "\n"


@dataclass(repr=False)
class Derivation:
    """The gradients of a spec's output (cotangent G) for every input and weight."""

    spec: Spec
    tape: Tape
    sweep: str = "auto"  # one of SWEEPS: the layout of the printed steps
    _chains: dict[tuple[str, ...], Chain] = field(default_factory=dict, compare=False)

    def __repr__(self) -> str:
        """Short: the gradients printed in full can take minutes (a failing test's report prints its locals)."""
        return f"Derivation({self.spec.name!r}, wrt=({', '.join(self.spec.input_names)}))"

    @property
    def gradients(self) -> dict[str, Basic]:
        """Input or weight name → closed-form gradient."""
        return {str(s.name): g for s, g in self.tape.gradients.items()}

    def steps(self, wrt: str | Sequence[str]) -> Chain:
        """The step-by-step derivation of ∂f/∂wrt, or one sweep for several targets (SymattnError naming
        the inputs if one is unknown)."""
        names = (wrt,) if isinstance(wrt, str) else tuple(wrt)
        if names not in self._chains:
            self._chains[names] = chain(self.spec, [self.spec.input(n) for n in names], self.tape)
        return self._chains[names]

    def chains(self, wrt: str | Sequence[str] | None = None) -> list[Chain]:
        """Derivations of the named targets (default: every input, in the spec's order), laid out by ``sweep``."""
        names = self.spec.input_names if wrt is None else ([wrt] if isinstance(wrt, str) else list(wrt))
        if self.sweep not in SWEEPS:
            raise SymattnError(f"unknown sweep {self.sweep!r}; choose from {', '.join(SWEEPS)}")
        if len(names) > 1 and self.sweep != "per-input":
            targets = [self.spec.input(n) for n in names]
            if self.sweep == "shared" or replayed_steps(self.spec, self.tape, targets, PER_INPUT_MAX) > PER_INPUT_MAX:
                return [self.steps(names)]
        return [self.steps(name) for name in names]

    def latex(self, wrt: str | Sequence[str] | None = None, standalone: bool = False) -> str:
        """A LaTeX fragment (amsmath), or with standalone a complete document for pdflatex."""
        chains = self.chains(wrt)
        return render.latex_document(self.spec, chains) if standalone else render.latex_fragment(self.spec, chains)

    def markdown(self, wrt: str | Sequence[str] | None = None) -> str:
        """Markdown with $$ math blocks, as GitHub renders it."""
        return render.markdown(self.spec, self.chains(wrt))

    def text(self, wrt: str | Sequence[str] | None = None, verification: Verification | None = None) -> str:
        """Plain unicode text; with a verification, each line marked ✓ or with its discrepancy."""
        chains = self.chains(wrt)
        marks = None if verification is None else chain_marks(chains, verification.checks)
        return render.text(self.spec, chains, marks)

    def html(self, wrt: str | Sequence[str] | None = None, figure: str | None = None) -> str:
        """One self-contained HTML page (MathML), each line verified and marked; figure: inline SVG to show."""
        from symattn.derive.formats.html import page

        return page(self.spec, self.chains(wrt), self.verify(wrt).checks, figure)

    def render(self, fmt: str, wrt: str | Sequence[str] | None = None, standalone: bool = False) -> str:
        """The derivation in one of FORMATS."""
        if fmt == "html":
            return self.html(wrt)
        if fmt == "latex":
            return self.latex(wrt, standalone=standalone)
        if fmt == "markdown":
            return self.markdown(wrt)
        if fmt == "text":
            return self.text(wrt)
        raise SymattnError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")

    def verify(self, wrt: str | Sequence[str] | None = None, seed: int = 0) -> Verification:
        """Evaluate both sides of every printed equality at random float64 matrices and differentials."""
        rng = np.random.default_rng(seed)
        checks: list[Check] = []
        for c in self.chains(wrt):
            checks += verify_chain(c, rng)
        return Verification(self.spec.name, checks)

    def _repr_latex_(self) -> str:
        return render.math_display(self.spec, self.chains())


def derive(name_or_spec: str | Spec, sweep: str = "auto", **options) -> Derivation:
    """Derive every gradient of a built-in spec (by name) or of a Spec; sweep: the printed layout (SWEEPS)."""
    if sweep not in SWEEPS:
        raise SymattnError(f"unknown sweep {sweep!r}; choose from {', '.join(SWEEPS)}")
    s = spec(name_or_spec, **options) if isinstance(name_or_spec, str) else name_or_spec
    require_constant_indices(s.name, s.output, s.inputs)
    return Derivation(s, backward(s.output, s.inputs), sweep)
