"""The check of a printed derivation: ``verify_chain`` evaluates both sides of every equality of a chain.

At random float64 inputs, a random cotangent G and a random differential dW of every target, the
differentials expand through ``differentials`` (never through the VJP rules), the named cotangents
through their printed definitions, and df itself is checked against a central difference of
f = tr(Gᵀ Y) along all the dW at once; at small sizes, exact rational evaluation rechecks what
float64 cannot decide.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.autodiff.differentials import Differential, ScalarDifferential, differential
from symattn.autodiff.grad import MASKS
from symattn.derive.steps import DF, Chain, Definition, Equation, Side, Term, pairing
from symattn.lang.functions import StopGradient
from symattn.lang.graph import children, postorder
from symattn.lang.naming.names import differential_name
from symattn.lang.positions import index_sizes
from symattn.numeric.dag import DagValues
from symattn.numeric.lambdify import lambdify
from symattn.numeric.verify import dimension_symbols, random_constant, random_dims, random_matrix


@dataclass(frozen=True)
class Check:
    """One checked equality: its place, the two values and their relative discrepancy."""

    target: str
    step: int  # the equation's number in the chain (0: df = tr(Gᵀ dY))
    node: str
    equality: int  # sides[equality] = sides[equality + 1]; −1 for checks outside the printed sides
    reason: str
    discrepancy: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(self.discrepancy <= self.tolerance)


EXACT_TOL = 1e-9  # both sides are the same number up to float64 rounding
DIFFERENCE_TOL = 1e-6  # a central difference against df


class Evaluator:
    """Values of the sides of a chain at one random point (inputs, G, dW)."""

    def __init__(
        self,
        c: Chain,
        rng: np.random.Generator,
        dims: Mapping | None = None,
        dtype: type = np.float64,
        weight_scale: float = 1.0,
    ) -> None:
        """weight_scale: the projections W_… drawn that many times smaller (a better conditioned point)."""
        self.chain = c
        self.weight_scale = weight_scale
        spec = c.spec
        every = [spec.output, *spec.matrix_inputs, *getattr(spec, "constants", ())]
        names = {s.name for s in dimension_symbols(*every)}
        fixed = {"H": 2} if "H" in names else {}
        if "H_kv" in names:  # grouped-query heads: H_kv must divide H
            fixed.update({"H": 4, "H_kv": 2})
        fixed.update(dims or {})
        self.dims = random_dims(every, rng, low=2, high=4, fixed=fixed)
        self.fixed = {s.name: v for s, v in self.dims.items()}
        taken = {str(x.name) for x in (*spec.inputs, *getattr(spec, "constants", ()), c.seed) if hasattr(x, "name")}
        taken |= {label for label, _ in spec.intermediates}
        names = {t: differential_name(str(t.name), taken) for t in c.targets}
        self.d_targets = {
            t: MatrixSymbol(names[t], *t.shape) if isinstance(t, MatrixExpr) else sp.Symbol(names[t]) for t in c.targets
        }
        self.args = [*spec.inputs, c.seed, *self.d_targets.values()]
        self.values = [
            self._draw(s, rng, dtype) if isinstance(s, MatrixExpr) else rng.uniform(0.5, 1.5) for s in self.args
        ]
        constants = getattr(spec, "constants", ())
        indices = index_sizes(spec.output) if constants else {}
        self.constants = {s: random_constant(s, self.dims, rng, indices).astype(dtype) for s in constants}
        self.scalar_differentials: dict[Basic, bool] = {}  # node → does it hold a dτ? (see _holds_scalar_differential)
        self.tangents = dict(self.d_targets)
        self.known: dict[MatrixSymbol, np.ndarray] = {s: v for s, v in zip(self.args, self.values)}
        self.known.update(self.constants)
        self.dag = DagValues(self.known, self.fixed, self.tangents)
        self.differentials: dict[Basic, Basic] = {}
        for item in c.items:  # each name's value, from its printed definition
            if isinstance(item, Definition):
                self.known[item.symbol] = self.matrix(item.value)

    def _draw(self, symbol: MatrixSymbol, rng: np.random.Generator, dtype: type) -> np.ndarray:
        """A random value of symbol's shape; a projection W_… at the usual initial scale, entries of variance
        1/fan-in (its rows), so that a deep stack's values, and their float64 rounding, stay of order one."""
        value = random_matrix(symbol, self.dims, rng)
        if str(getattr(symbol, "name", "")).startswith("W_"):
            value *= self.weight_scale / np.sqrt(value.shape[0])
        return value.astype(dtype)

    def matrix(self, expr: Basic) -> np.ndarray:
        """The value of a matrix expression that may hold names and differentials (dA: A's full differential at dW).

        Evaluated node by node over the expression's DAG (``numeric.dag``), each distinct
        subexpression once, so a deep spec's shared values are never written out as a tree.
        """
        if not self._holds_scalar_differential(expr):
            return self.dag.value(expr)
        # a trainable scalar's dτ: its differentials stand as symbols holding their values
        expr = expr.replace(lambda e: isinstance(e, (Differential, ScalarDifferential)), self._differential_symbol)
        args = sorted({a for a in (*expr.atoms(MatrixSymbol), *expr.free_symbols) if a in self.known}, key=str)
        return lambdify(args, expr, dims=self.fixed)(*(self.known[a] for a in args))

    def _holds_scalar_differential(self, expr: Basic) -> bool:
        """Does expr hold a dτ? Found on its DAG, each node once across all calls (``has`` walks the tree)."""
        memo = self.scalar_differentials
        for node in postorder(expr, seen=memo):
            memo[node] = isinstance(node, ScalarDifferential) or any(memo[a] for a in children(node))
        return memo[expr]

    def _differential_symbol(self, d: Basic) -> Basic:
        """A symbol standing for dA (dτ), its value the full differential at dW."""
        if d not in self.differentials:
            name = f"_d{len(self.differentials)}"
            full = differential(d.arg, self.tangents)
            if isinstance(d, Differential):
                symbol = MatrixSymbol(name, *d.shape)
                self.known[symbol] = self.matrix(sp.ZeroMatrix(*d.shape) if full is None else full)
            else:
                symbol = sp.Symbol(name)
                self.known[symbol] = 0.0 if full is None else self.number(full)
            self.differentials[d] = symbol
        return self.differentials[d]

    def number(self, expr: Basic) -> float:
        """The value of a scalar expression (of trainable scalars, sums of entries, differentials)."""
        if not expr.free_symbols:
            return float(expr)
        return float(np.sum(self.matrix(expr)))

    def side(self, side: Side) -> float:
        if side == DF:
            return self.df()
        return float(
            sum(
                self.number(t.matrix) if t.is_scalar else np.sum(np.trace(self.matrix(t.matrix), axis1=-2, axis2=-1))
                for t in side
            )
        )

    def df(self) -> float:
        return self.side((Term(pairing(self.chain.seed, Differential(self.chain.spec.output))),))

    def central_difference(self, eps: float = 1e-6) -> float:
        """(f(W + ε dW) − f(W − ε dW)) / 2ε for f = tr(Gᵀ Y), every target W moved at once; each stop-gradient
        sg(A) held at its value at W (a constant of the differential, as the derivation has it)."""
        spec, c = self.chain.spec, self.chain
        g = self.matrix(c.seed)  # the seed's value: G, or 1 for a 1 × 1 output
        frozen = {n: self.dag.value(n) for n in _outside_masks(spec.output) if isinstance(n, StopGradient)}

        def f(sign: float) -> float:
            moved: dict = dict(zip(spec.inputs, self.values))
            for t, d in self.d_targets.items():
                moved[t] = moved[t] + sign * eps * self.known[d]
            moved.update(self.constants)
            return float(np.sum(g * DagValues(moved, self.fixed, frozen=frozen).value(spec.output)))

        return (f(1.0) - f(-1.0)) / (2 * eps)

    def value(self, expr: Basic, target: Basic) -> np.ndarray:
        """A gradient's value: a matrix, or a number for a trainable scalar's."""
        return np.asarray(self.matrix(expr) if isinstance(target, MatrixExpr) else self.number(expr))


def _outside_masks(root: Basic) -> set[Basic]:
    """The nodes of root met on some path that enters no mask (``MASKS``: derivative 0). A stop-gradient met only
    inside masks (a top-k threshold under no_grad, compared with the scores) need not be held: no derivative reaches
    it, and held it would move a tie with it (s ≥ kth(s) at the k-th entry) across the mask's jump."""
    seen: set[Basic] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(() if isinstance(node, MASKS) else children(node))
    return seen


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(a), abs(b))


# Where an exact equality fails at the first point, it is evaluated again at these (dtype, weight scale),
# in order, while some still fail: the same point in long double, then points with smaller weights.
RECHECKS = (
    (np.longdouble, 1.0, "long double"),
    (np.float64, 0.25, "weights ×1/4"),
    (np.float64, 1 / 16, "weights ×1/16"),
)


def verify_chain(c: Chain, rng: np.random.Generator) -> list[Check]:
    """Every equality of the chain evaluated on both sides at one random point.

    Also checked: df itself against a central difference of f = tr(Gᵀ Y) along dW,
    and the printed gradient (named and in closed form) against the engine's.

    A deep spec's values carry float64 rounding past EXACT_TOL on equal sides (a residual
    stack's values grow layer by layer, and its softmaxes saturate). A check that fails is
    evaluated again (RECHECKS): at the same point in long double (NumPy's extended precision,
    where the platform has one), where rounding shrinks and a wrong equality does not; then at
    a point whose projections W_… are 4 and 16 times smaller, where the values stay of order
    one. An equality holds everywhere or almost nowhere, so it passes where one such evaluation
    agrees within its tolerance, and its reason names which.
    """
    state = copy.deepcopy(rng)
    checks = _checks(c, Evaluator(c, rng))
    extended = np.finfo(np.longdouble).eps < np.finfo(np.float64).eps
    for dtype, scale, where in RECHECKS:
        if all(check.ok for check in checks):
            break
        if dtype is np.longdouble and not extended:
            continue
        again = _checks(c, Evaluator(c, copy.deepcopy(state), dtype=dtype, weight_scale=scale))
        checks = [
            check if check.ok or not retry.ok else replace(retry, reason=f"{retry.reason} ({where})")
            for check, retry in zip(checks, again)
        ]
    return checks


def _checks(c: Chain, ev: Evaluator) -> list[Check]:
    """df against a central difference, then the exact checks, at ev's point."""
    gap = _relative(ev.df(), ev.central_difference())
    first = Check(c.label, 0, "output", -1, "df against a central difference", gap, DIFFERENCE_TOL)
    return [first, *_exact_checks(c, ev)]


def _exact_checks(c: Chain, ev: Evaluator) -> list[Check]:
    """The chain's printed equalities and its printed gradient against the engine's, at ev's point."""
    name = c.label
    checks = []
    equations = [item for item in c.items if isinstance(item, Equation)]
    for i, item in enumerate(equations):
        values = [ev.side(s) for s in item.sides]
        for k, reason in enumerate(item.reasons):
            checks.append(Check(name, i, item.node, k, reason, _relative(values[k], values[k + 1]), EXACT_TOL))
    for k, target in enumerate(c.targets):  # each gradient's result line: step len(equations) + k
        engine = ev.value(c.tape.gradients[target], target)
        scale = max(1.0, float(np.max(np.abs(engine), initial=0.0)))
        of = "" if len(c.targets) == 1 else f" of {target.name}"
        printed_forms = [(f"gradient{of} = engine's gradient", c.gradients[target])]
        closed = c.closed_form(target)
        if closed is not None:  # printed (and checked) only when short enough to write out
            printed_forms.append((f"closed form{of} = engine's gradient", closed))
        for reason, printed in printed_forms:
            gap = float(np.max(np.abs(ev.value(printed, target) - engine), initial=0.0)) / scale
            checks.append(Check(name, len(equations) + k, "result", -1, reason, gap, EXACT_TOL))
    return checks


__all__ = ["Check", "verify_chain"]
