"""Derivation steps from the engine's tape, and a numeric check of every printed equality.

For targets W (one input, or several sharing one sweep), ``chain`` replays ``Tape.steps``
(root first) in the trace-differential style of the seeds. It starts from df = tr(Gᵀ dY),
G = ∂f/∂Y, and for each node Y with cotangent Ȳ = ∂f/∂Y writes

    tr(Ȳᵀ dY) = tr(Ȳᵀ D_Y) = Σ_a tr(Āᵀ da)

where D_Y is Y's differential in terms of its arguments' (product rule, softmax
differential, … from ``differentials``) and Ā the cotangents the VJP rule passes on
(cyclic property of the trace). Named intermediates get their cotangent's name Ā once
it is complete; the chain ends at df = Σ_W tr(W̄ᵀ dW), so ∂f/∂W = W̄. Each step is
printed once whatever the number of targets: a shared sweep costs what the backward
pass costs, where one chain per target replays the path from the output to each.

``verify_chain`` evaluates both sides of every equality at random float64 inputs,
a random cotangent G and a random differential dW of every target: the differentials expand through
``differentials`` (never through the VJP rules), the named cotangents through their
printed definitions, and df itself is checked against a central difference of
f = tr(Gᵀ Y) along all the dW at once.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, MatPow, Trace, Transpose

from symattn.autodiff.differentials import Differential, ScalarDifferential, differential, local_differential
from symattn.autodiff.grad import Tape, backward, default_seed
from symattn.autodiff.scalars import entry_sums
from symattn.autodiff.vjp import added, merge_cotangents, vjp_rule
from symattn.derive.folding import fold_scalars, scaled
from symattn.derive.naming import named_intermediates
from symattn.errors import UnsupportedNodeError
from symattn.lang.functions import HADAMARD_MOVE, FunctionRecord
from symattn.lang.graph import children, depends, postorder
from symattn.lang.names import differential_name
from symattn.lang.ops import LayerNorm, MergeHeads, RepeatHeads, RowInvStd, RowSum, SplitHeads, SumEntries, SumGroups
from symattn.numeric.dag import DagValues
from symattn.numeric.lambdify import lambdify
from symattn.numeric.verify import dimension_symbols, random_dims, random_matrix
from symattn.specs import Spec

# (differential of the node, reading off the cotangents), per node type; a function node's are in its record.
# Words only: they are set as \text{…} in LaTeX.
SCALAR_CHAIN = ("chain rule for a scalar", "collecting the scalar differential")
REASONS: dict[type, tuple[str, str]] = {
    MatMul: ("product rule", "cyclic property of the trace"),
    MatPow: ("product rule", "cyclic property of the trace"),
    MatAdd: ("sum rule", "linearity of the trace"),
    Transpose: ("differential of a transpose", "a trace equals the trace of the transpose"),
    HadamardProduct: ("product rule for the Hadamard product", HADAMARD_MOVE),
    HadamardPower: ("power rule, entrywise", HADAMARD_MOVE),
    LayerNorm: ("LayerNorm differential", HADAMARD_MOVE + ", cyclic property"),
    RowInvStd: ("differential of the row variance", HADAMARD_MOVE + ", cyclic property"),
    RowSum: ("row sums are linear", "cyclic property of the trace"),
    Trace: ("the trace is linear", "tr(dA) = tr(Iᵀ dA)"),
    SumEntries: ("the sum of entries is linear", "sum(dA) = tr((𝟏𝟏ᵀ)ᵀ dA)"),
    SplitHeads: ("head blocks are linear", "sum over heads is the trace of the concatenation"),
    MergeHeads: ("concatenation is linear", "trace of a concatenation is the sum over heads"),
    RepeatHeads: ("repeating head blocks is linear", "a kv head collects the sum over its group of heads"),
    SumGroups: ("summing head blocks is linear", "each head of a group receives its group's cotangent"),
    **dict.fromkeys((sp.Mul, sp.Add, sp.Pow, sp.exp, sp.log, sp.tanh), SCALAR_CHAIN),
}


def node_reasons(node: Basic) -> tuple[str, str]:
    """The step's two reasons for differentiating node: its record's, else the table's."""
    if isinstance(node, FunctionRecord):
        return node.reason
    if type(node) in REASONS:
        return REASONS[type(node)]
    raise UnsupportedNodeError(node, "derivation steps", [t.__name__ for t in REASONS])


@dataclass(frozen=True)
class Term:
    """tr(matrix), or Σ_h tr(matrix) when the matrix holds one block per head; a scalar c dτ stands as itself."""

    matrix: Basic
    per_head: bool = False

    @property
    def is_scalar(self) -> bool:
        return not isinstance(self.matrix, MatrixExpr)


DF = "df"  # the side that is df itself

Side = tuple[Term, ...] | str


@dataclass(frozen=True)
class Equation:
    """sides[0] = sides[1] = …; reasons[i] justifies sides[i] = sides[i + 1]."""

    node: str
    sides: tuple[Side, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Definition:
    """A cotangent given its name: symbol := value (value may use earlier names)."""

    symbol: MatrixSymbol
    value: Basic
    per_head: bool = False


CLOSED_FORM_LEAVES = 1500  # symbols in a closed form written out; longer ones stay in the named form


@dataclass(repr=False)
class Chain:
    """The derivation of ∂f/∂W for each target W, item by item (one sweep shared by the targets)."""

    spec: Spec
    targets: tuple[Basic, ...]
    tape: Tape
    seed: MatrixSymbol
    items: list[Equation | Definition] = field(default_factory=list)
    gradients: dict[Basic, Basic] = field(default_factory=dict)  # ∂f/∂W, written with the definitions' names
    forward: frozenset = frozenset()  # the forward pass's values: scalar folding does not enter them
    _named: tuple[int, dict] | None = field(default=None, repr=False, compare=False)
    _sizes: tuple[tuple[int, int], dict] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        """Short: a failing test's report prints its locals, and the tape and items printed in full take minutes."""
        targets = ", ".join(str(t) for t in self.targets)
        return f"Chain({self.spec.name!r}, targets=({targets}), {len(self.items)} items)"

    @property
    def label(self) -> str:
        """The target's name, or "all" for a sweep shared by several (the key of its checks and marks)."""
        return str(self.targets[0].name) if len(self.targets) == 1 else "all"

    @property
    def target(self) -> Basic:
        """The one target of a per-input chain."""
        if len(self.targets) != 1:
            raise ValueError(f"a shared sweep has {len(self.targets)} targets; name one")
        return self.targets[0]

    @property
    def gradient(self) -> Basic:
        """∂f/∂target of a per-input chain, with the names of the definitions."""
        return self.gradients[self.target]

    def definition(self, symbol: Basic) -> Basic | None:
        """The value a cotangent name was given (None for anything else)."""
        return self._definitions().get(symbol)

    def _definitions(self) -> dict[Basic, Basic]:
        """Name → value, in the order given (kept until an item is added)."""
        if self._named is None or self._named[0] != len(self.items):
            self._named = (len(self.items), {i.symbol: i.value for i in self.items if isinstance(i, Definition)})
        return self._named[1]

    def closed_form_size(self, target: Basic | None = None, cap: int = CLOSED_FORM_LEAVES) -> int:
        """How many symbols ∂f/∂target has written out (at most cap + 1), counted without building it.

        Each name's size is counted once per chain (in the order given, from the earlier names' sizes).
        """
        if self._sizes is None or self._sizes[0] != (len(self.items), cap):
            sizes: dict[Basic, int] = {}
            for symbol, value in self._definitions().items():
                sizes[symbol] = _size(value, sizes, cap)
            self._sizes = ((len(self.items), cap), sizes)
        return _size(self.gradients[self.target if target is None else target], self._sizes[1], cap)

    def closed_form(self, target: Basic | None = None) -> Basic | None:
        """∂f/∂target with every name replaced by its definition (None when longer than CLOSED_FORM_LEAVES)."""
        target = self.target if target is None else target
        if self.closed_form_size(target) > CLOSED_FORM_LEAVES:
            return None
        definitions = self._definitions()
        needed, stack = set(), [self.gradients[target]]  # the names it reads, through each other
        while stack:
            for x in stack.pop().atoms(MatrixSymbol):
                if x in definitions and x not in needed:
                    needed.add(x)
                    stack.append(definitions[x])
        full: dict[MatrixSymbol, Basic] = {}
        for symbol, value in definitions.items():  # in the order given: each reads earlier names only
            if symbol in needed:
                full[symbol] = value.xreplace(full)
        return fold_scalars(self.gradients[target].xreplace(full), self.forward)


def _size(expr: Basic, sizes: dict[Basic, int], cap: int) -> int:
    """Symbols in expr written out, at most cap + 1; sizes: a memo of the nodes counted so far, a name
    entered with its value's size (each node is counted once, whatever the number of expressions)."""
    for node in postorder(expr, seen=sizes):
        args = children(node)
        sizes[node] = min(cap + 1, sum(sizes[a] for a in args) or 1) if args else 1
    return sizes[expr]


def cotangent_symbol(name: str, shape: tuple) -> MatrixSymbol:
    """Ā for the intermediate A: the symbol bar_A."""
    return MatrixSymbol(f"bar_{name}", *shape)


def is_per_head(expr: Basic, per_head_symbols: frozenset = frozenset(), memo: dict | None = None) -> bool:
    """Does expr hold one block per head (a SplitHeads not undone by a MergeHeads)?

    Walks the DAG once (memo keeps the answers across calls with the same per_head_symbols).
    """
    memo = {} if memo is None else memo
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        if isinstance(node, SplitHeads) or node in per_head_symbols:
            memo[node] = True
        elif isinstance(node, (MergeHeads, MatrixSymbol)) or not node.args:
            memo[node] = False
        elif expanded:
            memo[node] = any(memo[a] for a in node.args)
        else:
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if a not in memo)
    return memo[expr]


class _Replay:
    """Walks a tape root first, writing one equation per step and naming cotangents as they complete."""

    def __init__(self, spec: Spec, targets: tuple[Basic, ...], tape: Tape | None) -> None:
        root = spec.output
        moves = depends([root], list(targets))
        tape = tape if tape is not None else backward(root, list(targets))
        seed = default_seed(root, None)
        self.forward = frozenset(postorder(root))
        self.out = Chain(spec=spec, targets=targets, tape=tape, seed=seed, forward=self.forward)
        # the steps that move with a target (a tape of more targets holds others too)
        self.steps = [
            (step.node, {a for a, _ in step.outputs if moves.get(a)}) for step in tape.steps if moves.get(step.node)
        ]
        self.named = {expr: name for name, expr in named_intermediates(spec)}
        for target in targets:
            self.named.setdefault(target, str(target.name))
        self.per_head: set[MatrixSymbol] = set()
        self.head_memo: dict[Basic, bool] = {}  # is_per_head's answers, until per_head grows
        # how many cotangents each node receives in all: a name is given once all have arrived
        self.arrivals: dict[Basic, int] = {}
        for _, varying in self.steps:
            for a in varying:
                self.arrivals[a] = self.arrivals.get(a, 0) + 1
        self.received: dict[Basic, list[Basic]] = {root: [seed]}
        self.shown: dict[Basic, Basic] = {root: seed}  # the cotangent of a node as the text writes it

    def heads(self, e: Basic) -> bool:
        return is_per_head(e, frozenset(self.per_head), self.head_memo)

    def term(self, cotangent: Basic, node: Basic) -> Term:
        if not isinstance(node, MatrixExpr):  # a trainable scalar: c dτ
            return Term(cotangent * ScalarDifferential(node))
        return Term(pairing(cotangent, Differential(node)), self.heads(node))

    def symbol(self, node: Basic) -> MatrixSymbol:
        """Node's cotangent name (bar_P for P), marked per head where the node is."""
        symbol = cotangent_symbol(self.named[node], node.shape)
        if self.heads(node):
            self.per_head.add(symbol)
            self.head_memo.clear()
        return symbol

    def define(self, node: Basic) -> None:
        """Name node's cotangent: the sum of all it received."""
        symbol = self.symbol(node)
        value = fold_scalars(added(self.received[node]), self.forward)
        self.out.items.append(Definition(symbol, value, symbol in self.per_head))
        self.shown[node] = symbol

    def run(self) -> Chain:
        out, root = self.out, self.out.spec.output
        out.items.append(Equation("output", (DF, (self.term(out.seed, root),)), ("G is the cotangent of the output",)))
        for node, varying in self.steps:
            self.step(node, varying)
        for target in out.targets:
            if target not in self.shown:
                if target in self.received and isinstance(target, MatrixExpr):
                    self.define(target)
                elif target in self.received:  # a trainable scalar: its gradient is the sum it received
                    self.shown[target] = sp.Add(*self.received[target])
                else:  # the output does not depend on the target
                    matrix = isinstance(target, MatrixExpr)
                    self.shown[target] = sp.ZeroMatrix(*target.shape) if matrix else sp.Integer(0)
            out.gradients[target] = self.shown[target]
        collected = tuple(self.term(out.gradients[t], t) for t in out.targets)
        out.items.append(Equation("result", (DF, collected), ("collecting every term",)))
        return out

    def step(self, node: Basic, varying: set[Basic]) -> None:
        """tr(Ȳᵀ dY) = tr(Ȳᵀ D_Y) = Σ_a tr(Āᵀ da) [= the same with the complete Ā named]."""
        if node not in self.shown:
            if node in self.named and self.arrivals.get(node, 0) > 1:
                self.define(node)
            else:
                self.shown[node] = fold_scalars(added(self.received[node]), self.forward)
        bar = self.shown[node]
        passed = merge_cotangents(
            (a, c if isinstance(a, MatrixExpr) else entry_sums(c))  # tr(Āᵀ S) written as 𝟏ᵀ(Ā ⊙ S)𝟏
            for a, c in vjp_rule(node)(node, bar)
            if a in varying
        )
        passed = tuple((a, fold_scalars(c, self.forward)) for a, c in passed)  # checked by the next equality
        first = (self.term(bar, node),)
        local = fold_scalars(local_differential(node, varying), self.forward)
        expanded = (Term(pairing(bar, local), self.heads(node)) if isinstance(node, MatrixExpr) else Term(bar * local),)
        read_off = tuple(self.term(c, a) for a, c in passed)
        reasons = list(node_reasons(node))
        sides: list[Side] = [first, expanded, read_off]
        if isinstance(node, Transpose):  # d(Aᵀ) = (dA)ᵀ reads the same as the line before
            sides, reasons = [first, read_off], reasons[1:]
        for a, c in passed:
            self.received.setdefault(a, []).append(c)
        complete = [a for a, _ in passed if a in self.named and self.arrivals[a] == 1 and isinstance(a, MatrixExpr)]
        if complete:
            sides.append(tuple(self.term(self.symbol(a) if a in complete else c, a) for a, c in passed))
            reasons.append("naming the cotangents")
        self.out.items.append(Equation(type(node).__name__, tuple(sides), tuple(reasons)))
        for a in complete:
            self.define(a)


def chain(spec: Spec, targets: Basic | Sequence[Basic], tape: Tape | None = None) -> Chain:
    """Replay the tape of the spec's backward pass (run for the targets if not given) for each ∂f/∂target,
    every step once."""
    return _Replay(spec, tuple(targets) if isinstance(targets, Sequence) else (targets,), tape).run()


def replayed_steps(spec: Spec, tape: Tape, targets: Sequence[Basic], cap: int) -> int:
    """How many steps one chain per target replays in all, counted up to just past cap."""
    total = 0
    for target in targets:
        moves = depends([spec.output], [target])
        total += sum(1 for step in tape.steps if moves.get(step.node))
        if total > cap:
            break
    return total


def pairing(cotangent: Basic, differential: Basic) -> Basic:
    """Cᵀ · D, the matrix inside tr(Cᵀ D), with Cᵀ kept whole (not distributed by SymPy)."""
    right = differential.args if isinstance(differential, MatMul) else (differential,)
    scalars = [a for a in right if not isinstance(a, MatrixExpr)]
    if scalars and isinstance(cotangent, MatMul):  # (c C)ᵀ (k D) = (c k) Cᵀ D: one coefficient, as a textbook folds it
        coeff, matrix = scaled(cotangent)
        mats = [a for a in right if isinstance(a, MatrixExpr)]
        return MatMul(coeff * sp.Mul(*scalars), Transpose(matrix), *mats)
    left = cotangent.T if isinstance(cotangent, MatrixSymbol) else Transpose(cotangent)
    return MatMul(left, *right)


# Verification.


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
        self.constants = {s: random_matrix(s, self.dims, rng).astype(dtype) for s in getattr(spec, "constants", ())}
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
        """(f(W + ε dW) − f(W − ε dW)) / 2ε for f = tr(Gᵀ Y), every target W moved at once."""
        spec, c = self.chain.spec, self.chain
        g = self.matrix(c.seed)  # the seed's value: G, or 1 for a 1 × 1 output

        def f(sign: float) -> float:
            moved: dict = dict(zip(spec.inputs, self.values))
            for t, d in self.d_targets.items():
                moved[t] = moved[t] + sign * eps * self.known[d]
            moved.update(self.constants)
            return float(np.sum(g * DagValues(moved, self.fixed).value(spec.output)))

        return (f(1.0) - f(-1.0)) / (2 * eps)

    def value(self, expr: Basic, target: Basic) -> np.ndarray:
        """A gradient's value: a matrix, or a number for a trainable scalar's."""
        return np.asarray(self.matrix(expr) if isinstance(target, MatrixExpr) else self.number(expr))


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


__all__ = ["DF", "Chain", "Check", "Definition", "Equation", "Term", "chain", "replayed_steps", "verify_chain"]
