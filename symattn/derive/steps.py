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

``step_check.verify_chain`` evaluates both sides of every equality at random points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul, MatPow, Trace, Transpose

from symattn.autodiff.differentials import Differential, ScalarDifferential, local_differential
from symattn.autodiff.grad import Tape, backward, default_seed, varies
from symattn.autodiff.scalars import entry_sums
from symattn.autodiff.vjp import added, merge_cotangents, vjp_rule
from symattn.derive.folding import fold_scalars, scaled
from symattn.derive.naming import named_intermediates
from symattn.errors import UnsupportedNodeError
from symattn.lang.functions import HADAMARD_MOVE, FunctionRecord
from symattn.lang.graph import children, postorder
from symattn.lang.ops import LayerNorm, MergeHeads, RepeatHeads, RowInvStd, RowSum, SplitHeads, SumEntries, SumGroups
from symattn.lang.positions import Entries, Scatter
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
    Entries: (
        "differentiating the entry formula in each trainable scalar and each table entry it reads",
        "collecting the scalar differential; each table entry collects the cotangent where it is read (a scatter)",
    ),
    Scatter: ("a scatter is linear", "its transpose reads the cotangent at the positions"),
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
        moves = varies([root], list(targets))
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
        moves = varies([spec.output], [target])
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


__all__ = ["DF", "Chain", "Definition", "Equation", "Term", "chain", "replayed_steps"]
