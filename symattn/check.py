"""Is a claimed gradient right? ``check(spec, wrt, claim)`` answers, with a counterexample if not.

The claim is a formula of symattn's expression language (``parse``) in the spec's
names: its inputs, G = ∂f/∂Y (the output's cotangent), its intermediates (S, A, P,
O, …; per head Q_h, …, C) and its dimensions (n, d_k, …). The truth is the engine's
gradient of f = tr(Gᵀ Y) with respect to an input, or to an intermediate Z (then Z
is cut loose from what computes it and everything after Z is differentiated).
Both are evaluated at small random matrices of small, pairwise different sizes, so
that a formula of the wrong shape or value shows as a concrete counterexample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.errors import SymattnError
from symattn.grad import backward, default_seed
from symattn.lambdify import lambdify
from symattn.latex import text as text_of
from symattn.names import Abbreviations
from symattn.ops import MergeHeads, SplitHeads
from symattn.parse import parse
from symattn.shapes import same_dim
from symattn.specs import Spec, spec
from symattn.verify import concrete_shape, dimension_symbols

TOLERANCE = 1e-9  # relative to the largest entry of the true gradient


@dataclass
class Counterexample:
    """Concrete sizes and matrices at which the claim and the truth differ."""

    dims: dict[str, int]
    inputs: dict[str, np.ndarray]
    claimed: np.ndarray
    true: np.ndarray

    @property
    def max_error(self) -> float:
        if np.shape(self.claimed) != np.shape(self.true):
            return float("inf")
        return float(np.max(np.abs(self.claimed - self.true), initial=0.0))

    def text(self) -> str:
        def show(a: np.ndarray) -> str:
            return np.array2string(np.asarray(a), precision=4, suppress_small=True, max_line_width=100)

        sizes = ", ".join(f"{k} = {v}" for k, v in self.dims.items())
        lines = [f"counterexample ({sizes}):"]
        for name, value in self.inputs.items():
            lines.append(f"{name} =\n{show(value)}")
        lines.append(f"claimed value, shape {np.shape(self.claimed)} =\n{show(self.claimed)}")
        lines.append(f"true value, shape {np.shape(self.true)} =\n{show(self.true)}")
        if np.isfinite(self.max_error):
            lines.append(f"largest difference: {self.max_error:.4g}")
        return "\n".join(lines)


@dataclass
class CheckResult:
    """The verdict on one claimed gradient; truthy when the claim is right."""

    spec: str
    wrt: str
    claim: Basic
    truth: Basic
    right: bool
    reason: str
    counterexample: Counterexample | None = None
    names: Abbreviations | None = field(default=None, repr=False)  # prints intermediates by name

    def __bool__(self) -> bool:
        return self.right

    def text(self) -> str:
        """The verdict, the claim and the true closed form, and any counterexample."""
        short = self.names or (lambda e: e)
        verdict = "right" if self.right else "wrong"
        lines = [
            f"{verdict}: ∂f/∂{self.wrt} for {self.spec}: {self.reason}",
            f"claimed: ∂f/∂{self.wrt} = {text_of(short(self.claim))}",
            f"true:    ∂f/∂{self.wrt} = {text_of(short(self.truth))}",
        ]
        if self.counterexample is not None:
            lines.append(self.counterexample.text())
        return "\n".join(lines) + "\n"


def namespace(s: Spec) -> dict[str, Basic]:
    """The names a claim may use: inputs, G, intermediates, dimensions."""
    names: dict[str, Basic] = {str(d): d for d in dimension_symbols(s.output, *s.inputs)}
    names.update({name: expr for name, expr in s.intermediates})
    names.update({str(x.name): x for x in s.inputs})
    names["G"] = default_seed(s.output, None)
    return names


def heads_of(s: Spec) -> Basic | None:
    """The number of heads of a multi-head spec, None for a single head."""
    for node in sp.preorder_traversal(s.output):
        if isinstance(node, (SplitHeads, MergeHeads)):
            return node.heads
    return None


def true_gradient(s: Spec, wrt: str) -> Basic:
    """∂f/∂wrt for f = tr(Gᵀ Y): wrt an input, or an intermediate cut loose from its inputs."""
    if wrt in s.input_names:
        symbol = s.input(wrt)
        return backward(s.output, [symbol]).gradients[symbol]
    named = dict(s.intermediates)
    if wrt not in named:
        raise SymattnError(
            f"spec {s.name!r} has no input or intermediate {wrt!r}; inputs: {', '.join(s.input_names)}; "
            f"intermediates: {', '.join(named)}"
        )
    short = Abbreviations(s.intermediates)
    loose = short.symbols[wrt]
    definitions = {symbol: d for symbol, d in short.definitions if symbol != loose}
    downstream = short(s.output)
    while downstream.has(*definitions):  # expand every other name, keep the loose one
        downstream = downstream.xreplace(definitions)
    gradient = backward(downstream, [loose], default_seed(s.output, None)).gradients[loose]
    return gradient.xreplace({loose: named[wrt]})


def _sizes(s: Spec, rng: np.random.Generator) -> dict[sp.Symbol, int]:
    """Pairwise different small sizes, so that a transposed or misplaced factor cannot fit by chance."""
    symbols = dimension_symbols(s.output, *s.inputs)
    values = rng.permutation(np.arange(2, 2 + len(symbols)))
    return {d: int(v) for d, v in zip(symbols, values)}


def check(
    name_or_spec: str | Spec, wrt: str, claim: str | Basic, trials: int = 3, seed: int = 0, **options
) -> CheckResult:
    """Compare a claimed ∂f/∂wrt (text in the expression language, or a SymPy expression) with the truth."""
    s = spec(name_or_spec, **options) if isinstance(name_or_spec, str) else name_or_spec
    truth = true_gradient(s, wrt)
    claimed = parse(claim, namespace(s), heads_of(s)) if isinstance(claim, str) else sp.sympify(claim)
    if not isinstance(claimed, MatrixExpr):
        raise SymattnError(f"the claimed gradient is a scalar ({claimed}); ∂f/∂{wrt} has shape {truth.shape}")
    shape_ok = all(same_dim(a, b) for a, b in zip(claimed.shape, truth.shape))
    names = Abbreviations(s.intermediates)
    rng = np.random.default_rng(seed)
    symbols = sorted((truth.atoms(MatrixSymbol) | claimed.atoms(MatrixSymbol)), key=lambda m: str(m.name))
    for _ in range(trials):
        sizes = _sizes(s, rng)
        fixed = {str(d): v for d, v in sizes.items()}
        values = {m: rng.standard_normal(concrete_shape(m, sizes)).round(1) for m in symbols}
        claimed_value = np.asarray(lambdify(symbols, claimed, dims=fixed)(*values.values()), dtype=float)
        true_value = np.asarray(lambdify(symbols, truth, dims=fixed)(*values.values()), dtype=float)
        example = Counterexample(fixed, {str(m.name): v for m, v in values.items()}, claimed_value, true_value)
        scale = max(1.0, float(np.max(np.abs(true_value), initial=0.0)))
        if not shape_ok or example.max_error > TOLERANCE * scale:
            reason = (
                f"its shape {claimed.shape} is not ∂f/∂{wrt}'s shape {truth.shape}"
                if not shape_ok
                else "it differs from the true gradient at the matrices below"
            )
            return CheckResult(s.name, wrt, claimed, truth, False, reason, example, names)
    reason = f"it agrees with the true gradient at {trials} random points (tolerance {TOLERANCE:.0e})"
    return CheckResult(s.name, wrt, claimed, truth, True, reason, None, names)
