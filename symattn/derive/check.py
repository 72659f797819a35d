"""Is a claimed gradient right? ``check(spec, wrt, claim)`` answers, with a counterexample if not.

The claim is a formula of symattn's expression language (``parse``) in the spec's
names: its inputs, G = ∂f/∂Y (the output's cotangent), its intermediates (S, A, P,
O, …; per head Q_h, …, C) and its dimensions (n, d_k, …). The truth is the engine's
gradient of f = tr(Gᵀ Y) with respect to an input, or to an intermediate Z (then Z
is cut loose from what computes it and everything after Z is differentiated).

Both are evaluated in float64 at ``trials`` random points; the verdict (``status``) is

- ``"wrong"``: proved. The shapes differ symbolically, or at the sizes and matrices
  shown both values are finite and differ by more than TOLERANCE · max(1, max|true|).
- ``"right"``: evidence, not proof. At every point both values were finite real
  numbers, no floating-point overflow, division by zero or invalid operation
  occurred, and they agreed within the tolerance.
- ``"undecided"`` ("cannot be checked"): no point refuted the claim, but at some
  point a value was NaN, ±∞ or complex, or its evaluation failed (an arithmetic
  error, or a matrix larger than MAX_ENTRIES). Never reported as right.

The points. The first uses small, pairwise different sizes (2, 3, …), so that a
misplaced transpose shows as a shape error. Every other point draws each dimension d
independently and uniformly from [2, b_d]: b_d = 64, lowered (evenly, see
``size_ranges``) until all of the spec's matrices together hold at most ENTRY_BUDGET
entries at the largest sizes, so every trial stays fast. Entries are standard normal
numbers rounded to one decimal.

What "right" is worth (Schwartz–Zippel). Suppose claim − truth = (c(dims) − 1) · truth
with c a rational function of the dimensions and c − 1 = p/q, p a nonzero polynomial
of total degree k (a stray factor 1 + (n−2)(n−3)(n−4)(n−5), or d_k / 2, …). One
random point misses the error only if p vanishes there, which happens with
probability at most k / (B − 1), B the smallest b_d of the dimensions p involves; all
trials − 1 random points miss it with probability at most (k / (B − 1))^(trials − 1).
For an error polynomial of degree k in the matrix entries the bound is k · 0.04 per
point (0.04 ≈ the largest probability of one value of a rounded standard normal, that
of 0.0). No bound is claimed for an error of any other form, nor for one below the
tolerance. With grouped-query heads H_kv is a random divisor of H, not uniform.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.autodiff.grad import backward, default_seed
from symattn.derive.formats.latex import text as text_of
from symattn.derive.steps import CLOSED_FORM_LEAVES
from symattn.errors import SymattnError
from symattn.lang.dims import same_dim
from symattn.lang.graph import nodes, rewrite, tree_size
from symattn.lang.naming.names import Names
from symattn.lang.naming.parse import parse
from symattn.lang.ops import MergeHeads, SplitHeads
from symattn.numeric.dag import DagValues
from symattn.numeric.verify import concrete_shape, dimension_symbols, evaluate_finite
from symattn.specs import Spec, spec

RIGHT, WRONG, UNDECIDED = "right", "wrong", "undecided"  # CheckResult.status
TOLERANCE = 1e-9  # relative to the largest entry of the true gradient (at least 1)
DEFAULT_TRIALS = 5
MAX_TRIALS = 1000
SIZES = (2, 64)  # the widest range a dimension is drawn from
ENTRY_BUDGET = 2**20  # entries of all of a spec's matrices at the largest sizes
MAX_ENTRIES = 2**22  # entries of any one matrix in a claim at a point


@dataclass
class Counterexample:
    """Concrete sizes and matrices at which the claim and the truth differ."""

    dims: dict[str, int]
    inputs: dict[str, np.ndarray]
    claimed: np.ndarray
    true: np.ndarray

    @property
    def max_error(self) -> float:
        """max |claimed − true| over the entries (∞ when the shapes differ)."""
        if np.shape(self.claimed) != np.shape(self.true):
            return float("inf")
        return float(np.max(np.abs(self.claimed - self.true), initial=0.0))

    def text(self) -> str:
        def show(a: np.ndarray) -> str:
            return np.array2string(np.asarray(a), precision=4, suppress_small=True, max_line_width=100)

        lines = [f"counterexample ({_sizes_text(self.dims)}):"]
        for name, value in self.inputs.items():
            lines.append(f"{name} =\n{show(value)}")
        lines.append(f"claimed value, shape {np.shape(self.claimed)} =\n{show(self.claimed)}")
        lines.append(f"true value, shape {np.shape(self.true)} =\n{show(self.true)}")
        if np.isfinite(self.max_error):
            lines.append(f"largest difference: {self.max_error:.4g}")
        return "\n".join(lines)


@dataclass
class CheckResult:
    """The verdict on one claimed gradient: status "right", "wrong" or "undecided" (cannot be checked).

    Truthy only when the claim is right; ``right`` is ``status == "right"``.
    """

    spec: str
    wrt: str
    claim: Basic
    truth: Basic
    status: str
    reason: str
    counterexample: Counterexample | None = None
    names: Names | None = field(default=None, repr=False)  # prints intermediates by name

    @property
    def right(self) -> bool:
        return self.status == RIGHT

    @property
    def wrong(self) -> bool:
        return self.status == WRONG

    @property
    def undecided(self) -> bool:
        return self.status == UNDECIDED

    def __bool__(self) -> bool:
        return self.right

    def text(self) -> str:
        """The verdict, the claim and the true closed form, and any counterexample."""
        short = self.names or (lambda e: e)
        verdict = "cannot be checked" if self.undecided else self.status
        lines = [
            f"{verdict}: ∂f/∂{self.wrt} for {self.spec}: {self.reason}",
            f"claimed: ∂f/∂{self.wrt} = {_printed(short(self.claim))}",
            f"true:    ∂f/∂{self.wrt} = {_printed(short(self.truth))}",
        ]
        if self.counterexample is not None:
            lines.append(self.counterexample.text())
        return "\n".join(lines) + "\n"


def _printed(expr: Basic) -> str:
    """expr as text, or its size where the tree is longer than CLOSED_FORM_LEAVES symbols (deep specs)."""
    if tree_size(expr, CLOSED_FORM_LEAVES) > CLOSED_FORM_LEAVES:
        return f"(a closed form of over {CLOSED_FORM_LEAVES} symbols; `symattn derive` prints it step by step)"
    return text_of(expr)


def namespace(s: Spec) -> dict[str, Basic]:
    """The names a claim may use: inputs, G, intermediates, dimensions."""
    names: dict[str, Basic] = {str(d): d for d in dimension_symbols(s.output, *s.inputs)}
    names.update({name: expr for name, expr in s.intermediates})
    names.update({str(x.name): x for x in s.inputs})
    names["G"] = default_seed(s.output, None)
    return names


def heads_of(s: Spec) -> Basic | None:
    """The number of heads of a multi-head spec, None for a single head."""
    for node in nodes(s.output):  # the DAG: a deep spec's tree is exponentially larger
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
    short = Names(s.intermediates)
    loose = short.symbols[wrt]
    expanded: dict[Basic, Basic] = {}  # every other name by its definition, on the DAG; the loose one kept
    for symbol, definition in short.definitions:
        if symbol != loose:
            expanded[symbol] = rewrite(definition, expanded.get)
    downstream = rewrite(short(s.output), expanded.get)
    gradient = backward(downstream, [loose], default_seed(s.output, None)).gradients[loose]
    return rewrite(gradient, {loose: named[wrt]}.get)


# Sizes.


def _copies(expr: MatrixExpr, memo: dict) -> Basic:
    """How many blocks a matrix of expr's shape stands for: H for per-head blocks, else 1."""
    if expr not in memo:
        if isinstance(expr, MergeHeads):
            memo[expr] = sp.Integer(1)
        elif hasattr(expr, "heads"):  # SplitHeads, RepeatHeads, SumGroups
            memo[expr] = expr.heads
        else:
            inner = [_copies(a, memo) for a in expr.args if isinstance(a, MatrixExpr)]
            memo[expr] = next((c for c in inner if c != 1), sp.Integer(1))
    return memo[expr]


def spec_entries(s: Spec) -> Basic:
    """Σ rows · cols · copies over the inputs, constants, G and intermediates: a polynomial in the sizes."""
    memo: dict = {}
    matrices = [*s.inputs, *s.constants, default_seed(s.output, None), *(e for _, e in s.intermediates)]
    return sp.Add(*(m.shape[0] * m.shape[1] * _copies(m, memo) for m in matrices if isinstance(m, MatrixExpr)))


def size_ranges(s: Spec) -> dict[sp.Symbol, tuple[int, int]]:
    """[2, b_d] for each dimension d: the largest bounds ≤ 64, lowered evenly, that fit ENTRY_BUDGET.

    The largest bound is lowered one at a time until the spec's matrices fit; then each
    bound in turn is raised again while they still fit (so n, m keep more room than H, d_k).
    """
    symbols = tuple(dimension_symbols(s.output, *s.inputs))
    return dict(zip(symbols, _ranges(spec_entries(s), symbols)))


@lru_cache(maxsize=64)
def _ranges(entries: Basic, symbols: tuple[sp.Symbol, ...]) -> list[tuple[int, int]]:
    low, high = SIZES
    upper = dict.fromkeys(symbols, high)

    def fits() -> bool:
        return bool(entries.xreplace(upper) <= ENTRY_BUDGET)

    while not fits() and max(upper.values(), default=low) > low:
        widest = max(symbols, key=lambda d: (upper[d], d.name))
        upper[widest] -= 1
    grown = True
    while grown:
        grown = False
        for d in symbols:
            if upper[d] < high:
                upper[d] += 1
                if fits():
                    grown = True
                else:
                    upper[d] -= 1
    return [(low, upper[d]) for d in symbols]


def _draw_sizes(ranges: Mapping[sp.Symbol, tuple[int, int]], rng: np.random.Generator, first: bool) -> dict:
    """Sizes for one point: small and pairwise different at the first, uniform in the ranges after."""
    symbols = list(ranges)
    if first:
        values = rng.permutation(np.arange(SIZES[0], SIZES[0] + len(symbols)))
        sizes = {d: min(int(v), ranges[d][1]) for d, v in zip(symbols, values)}
    else:
        sizes = {d: int(rng.integers(ranges[d][0], ranges[d][1] + 1)) for d in symbols}
    by_name = {d.name: d for d in symbols}
    if "H" in by_name and "H_kv" in by_name:  # grouped-query heads: H_kv divides H
        heads = sizes[by_name["H"]]
        sizes[by_name["H_kv"]] = int(rng.choice([k for k in range(1, heads + 1) if heads % k == 0]))
    return sizes


def _shapes(expr: Basic) -> set[tuple[Basic, Basic]]:
    """The distinct shapes of the matrix subexpressions of expr."""
    found: set[tuple[Basic, Basic]] = set()
    seen: set[Basic] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, MatrixExpr):
            found.add(tuple(sp.sympify(d) for d in node.shape))
        stack.extend(a for a in node.args if isinstance(a, Basic))
    return found


def _largest(shapes: set[tuple[Basic, Basic]], sizes: Mapping[sp.Symbol, int]) -> int:
    """Entries of the largest of these shapes at these sizes (a shape with unknown symbols is left to lambdify)."""
    entries = (sp.sympify(sp.sympify(r * c).xreplace(sizes)) for r, c in shapes)
    return max((int(e) for e in entries if e.is_Integer), default=0)


def _broadcast(value: np.ndarray, shape: tuple) -> np.ndarray:
    try:
        return np.broadcast_to(value, shape)
    except ValueError:  # compared as it is: a shape that differs counts as a difference
        return value


def _sizes_text(dims: Mapping) -> str:
    return ", ".join(f"{k} = {v}" for k, v in dims.items())


# The check.


def _validate(trials: object, seed: object) -> None:
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or not 1 <= trials <= MAX_TRIALS:
        raise SymattnError(f"trials must be an integer from 1 to {MAX_TRIALS}, got {trials!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise SymattnError(f"seed must be a non-negative integer, got {seed!r}")


def _claimed(claim: object, s: Spec) -> Basic:
    """The claim as a SymPy expression: text is parsed (never evaluated), SymPy objects taken as they are."""
    if isinstance(claim, str):
        return parse(claim, namespace(s), heads_of(s))
    if isinstance(claim, Basic):
        return claim
    raise SymattnError(f"the claim must be a formula (str) or a SymPy expression, got {type(claim).__name__}")


def check(
    name_or_spec: str | Spec,
    wrt: str,
    claim: str | Basic,
    trials: int = DEFAULT_TRIALS,
    seed: int = 0,
    **options,
) -> CheckResult:
    """Compare a claimed ∂f/∂wrt (text in the expression language, or a SymPy expression) with the truth.

    The result's status is "right", "wrong" (with a counterexample where one was
    evaluated) or "undecided" (cannot be checked); see the module docstring for what
    each proves.
    """
    _validate(trials, seed)
    s = spec(name_or_spec, **options) if isinstance(name_or_spec, str) else name_or_spec
    truth = true_gradient(s, wrt)
    if not isinstance(truth, MatrixExpr):  # ∂f/∂τ of a trainable scalar
        raise SymattnError(
            f"check compares matrix gradients; {wrt} is a trainable scalar (`symattn derive --wrt {wrt} --verify` "
            "checks its derivation)"
        )
    claimed = _claimed(claim, s)
    if not isinstance(claimed, MatrixExpr):
        raise SymattnError(f"the claimed gradient is a scalar ({claimed}); ∂f/∂{wrt} has shape {truth.shape}")
    shape_ok = all(same_dim(a, b) for a, b in zip(claimed.shape, truth.shape))
    shape_reason = f"its shape {claimed.shape} is not ∂f/∂{wrt}'s shape {truth.shape}"
    names = Names(s.intermediates)

    def verdict(status: str, reason: str, example: Counterexample | None = None) -> CheckResult:
        return CheckResult(s.name, wrt, claimed, truth, status, reason, example, names)

    rng = np.random.default_rng(int(seed))
    ranges = size_ranges(s)
    claim_shapes = _shapes(claimed)
    symbols = sorted({m for m in nodes(truth, claimed) if isinstance(m, MatrixSymbol)}, key=lambda m: str(m.name))
    undecided = ""
    for trial in range(trials):
        sizes = _draw_sizes(ranges, rng, first=trial == 0)
        fixed = {str(d): v for d, v in sizes.items()}
        if _largest(claim_shapes, sizes) > MAX_ENTRIES:
            undecided = undecided or f"the claim needs a matrix of over {MAX_ENTRIES} entries at {_sizes_text(fixed)}"
            continue
        values = {m: rng.standard_normal(concrete_shape(m, sizes)).round(1) for m in symbols}
        claimed_value, claim_trouble = evaluate_finite(DagValues(values, fixed).value, [claimed])
        true_value, truth_trouble = evaluate_finite(DagValues(values, fixed).value, [truth])
        if claim_trouble or truth_trouble:
            what = f"the claim {claim_trouble}" if claim_trouble else f"the true gradient {truth_trouble}"
            undecided = undecided or f"{what} at {_sizes_text(fixed)}"
            continue
        if shape_ok:  # one shape symbolically: a scalar-shaped value (e.g. a zero matrix) broadcasts
            claimed_value = _broadcast(claimed_value, np.shape(true_value))
        example = Counterexample(fixed, {str(m.name): v for m, v in values.items()}, claimed_value, true_value)
        if not shape_ok:
            return verdict(WRONG, shape_reason, example)
        scale = max(1.0, float(np.max(np.abs(true_value), initial=0.0)))
        if example.max_error > TOLERANCE * scale:
            return verdict(WRONG, "it differs from the true gradient at the matrices below", example)
    if not shape_ok:
        return verdict(WRONG, shape_reason)
    if undecided:
        return verdict(UNDECIDED, f"{undecided}, and no point refuted it")
    tops = {b for _, b in ranges.values()}
    sizes = (
        f"sizes 2 to {tops.pop()}"
        if len(tops) == 1
        else "sizes " + ", ".join(f"{d} ≤ {b}" for d, (_, b) in ranges.items())
    )
    return verdict(
        RIGHT, f"it agrees with the true gradient at {trials} random points ({sizes}; tolerance {TOLERANCE:.0e})"
    )
