"""Reverse-mode trace-differential engine.

``backward`` walks an expression as a DAG, root first, applying one VJP rule per
node (see ``vjp``); a subexpression reached along several paths is visited once,
after all its cotangents have arrived, and their sum is what it passes on. Every
rule application is recorded as a ``Step`` for the derivation printer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import Identity, ZeroMatrix

from symattn.autodiff.vjp import VJP_RULES, merge_cotangents, supported, vjp_rule, zero_like
from symattn.errors import ShapeMismatchError, SymattnError, UnsupportedNodeError
from symattn.lang import functions
from symattn.lang.algebra import total
from symattn.lang.dims import same_dim
from symattn.lang.functions import StopGradient, sg
from symattn.lang.graph import children, postorder
from symattn.lang.lazy import Matrix, plain
from symattn.lang.naming.safe import expression
from symattn.lang.piecewise import DropoutMask
from symattn.lang.shapes import check_shapes


@dataclass(frozen=True)
class Step:
    """One rule application: node Y with cotangent ∂f/∂Y passed to its arguments."""

    node: Basic
    rule: str
    cotangent: Basic
    outputs: tuple[tuple[Basic, Basic], ...]


@dataclass
class Tape:
    """Everything a backward pass found: steps in order, cotangents, gradients."""

    expr: Basic
    seed: Basic
    wrt: tuple[MatrixSymbol, ...]
    steps: list[Step] = field(default_factory=list)
    cotangents: dict[Basic, Basic] = field(default_factory=dict)
    gradients: dict[MatrixSymbol, Basic] = field(default_factory=dict)


def is_scalar(expr: Basic) -> bool:
    """Scalar-valued: a SymPy scalar Expr (Trace, sum, …) or a 1 × 1 matrix."""
    if isinstance(expr, MatrixExpr):
        return expr.shape == (1, 1)
    return True


def default_seed(expr: Basic, cotangent: Basic | None) -> Basic:
    """The cotangent ∂f/∂expr: given, G of expr's shape, or 1 for a scalar expr."""
    if cotangent is not None:
        cotangent = expression(cotangent, "the cotangent")
        if isinstance(expr, MatrixExpr):
            if not isinstance(cotangent, MatrixExpr) or not all(
                same_dim(a, b) for a, b in zip(cotangent.shape, expr.shape)
            ):
                shape = getattr(cotangent, "shape", ())
                raise ShapeMismatchError("cotangent of the expression", shape, expr.shape)
        return cotangent
    if not isinstance(expr, MatrixExpr):
        return sp.Integer(1)
    if expr.shape == (1, 1):
        return Identity(1)
    return MatrixSymbol("G", *expr.shape)


# the masks of a call, piecewise constant (derivative 0): dropout's, step(A) (a comparison), keep(A) (its −∞/0 form)
MASKS = (DropoutMask, functions.Step, functions.Keep)
# the nodes no cotangent passes: sg(A) of a matrix, sg(x) of a scalar, and the masks
STOPPED = (StopGradient, sg, *MASKS)


def varies(roots: Iterable[Basic], targets: Iterable[Basic]) -> dict[Basic, bool]:
    """For every subexpression of the roots: does it move with one of targets? (as ``lang.graph.depends``, but a
    stop-gradient never moves: what the backward sweep and the derivation's replay both read)"""
    wanted = set(targets)
    out: dict[Basic, bool] = {}
    for node in postorder(*roots):
        out[node] = node in wanted or (not isinstance(node, STOPPED) and any(out[a] for a in children(node)))
    return out


def _topological(expr: Basic, depends: dict[Basic, bool]) -> list[Basic]:
    """Dependent subexpressions, each after every node that uses it (root first)."""
    order: list[Basic] = []
    done: set[Basic] = set()
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in done:
            continue
        done.add(node)
        stack.append((node, True))
        stack.extend((a, False) for a in children(node) if depends.get(a) and a not in done)
    return order[::-1]


def _rule_for(node: Basic):
    rule = vjp_rule(node)
    if rule is None:
        names = supported(VJP_RULES)
        raise UnsupportedNodeError(node, "differentiation", names)
    return rule


def _sum(terms: list[Basic]) -> Basic:
    return total(*terms) if isinstance(terms[0], MatrixExpr) else sp.Add(*terms)


def backward(expr: Basic, wrt: Iterable[MatrixSymbol], cotangent: Basic | None = None) -> Tape:
    """Run reverse mode from expr, seeded with cotangent, down to the wrt symbols."""
    expr = expression(expr)
    wrt = tuple(plain(w) for w in wrt)
    cotangent = plain(cotangent)
    for w in wrt:
        if isinstance(w, sp.Symbol) and w.is_integer:
            raise SymattnError(
                f"{w} is a dimension; differentiate with respect to a MatrixSymbol or a real scalar Symbol"
            )
        if not isinstance(w, (MatrixSymbol, sp.Symbol)):
            raise SymattnError(
                f"can only differentiate with respect to a MatrixSymbol or a scalar Symbol, got {type(w).__name__} {w}"
            )
    check_shapes(expr)
    seed = default_seed(expr, cotangent)
    tape = Tape(expr=expr, seed=seed, wrt=wrt)
    depends = varies([expr], wrt)
    pending: dict[Basic, list[Basic]] = {expr: [seed]} if depends[expr] else {}
    for node in _topological(expr, depends):
        terms = pending.pop(node, [])
        if not terms:
            continue
        g = _sum(terms)
        tape.cotangents[node] = g
        if node in tape.wrt:
            continue
        rule = _rule_for(node)
        outputs = merge_cotangents((a, c) for a, c in rule(node, g) if depends.get(a))
        missing = [a for a in children(node) if depends.get(a) and a not in {o for o, _ in outputs}]
        if missing:
            raise UnsupportedNodeError(node, f"differentiation through {missing[0]}", [rule.__name__])
        tape.steps.append(Step(node=node, rule=rule.__name__, cotangent=g, outputs=outputs))
        for a, c in outputs:
            pending.setdefault(a, []).append(c)
    for w in wrt:
        tape.gradients[w] = tape.cotangents.get(w, zero_like(w))
    return tape


def grad(expr: Basic, wrt: Sequence[MatrixSymbol] | MatrixSymbol, cotangent: Basic | None = None) -> dict:
    """Closed-form gradients of tr(cotangentᵀ expr) (or of a scalar expr) for each symbol in wrt."""
    if isinstance(wrt, (MatrixSymbol, sp.Symbol, Matrix)):
        wrt = [wrt]
    return dict(backward(expr, wrt, cotangent).gradients)


__all__ = ["Step", "Tape", "ZeroMatrix", "backward", "grad", "is_scalar", "varies"]
