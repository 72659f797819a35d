"""Values of expression DAGs, node by node: each distinct subexpression evaluated once.

A deep spec's expression printed as a tree is exponentially long (every layer's value
is used by the next layer's several uses), and ``lambdify`` compiles the printed tree.
``DagValues`` walks the DAG leaves first instead (``lang.graph.postorder``) and computes
each node Y = f(A₁, …, A_k) from its arguments' values with a small compiled function
of the node alone, whose matrix arguments are placeholders; nodes of one pattern (type,
argument shapes, scalar arguments) share one function, compiled once per process.

``tangent`` does the same for forward differentials: for Y = f(A₁, …, A_k),
dY = J_f(A)[dA₁, …, dA_k] from the node's JVP rule applied to the node alone, so the
differential of a deep expression costs one small evaluation per node, never the
differential written out as one formula.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import FunctionMatrix

from symattn.autodiff.differentials import Differential, differential, local_differential
from symattn.errors import SymattnError
from symattn.lang.graph import children, postorder, rewrite
from symattn.lang.shapes import dimension_symbols
from symattn.numeric.printers import ExpAtom, NumPyMatrixPrinter

_CACHE_MAX = 1 << 16
# (node, known scalars) → (the node with its matrix arguments as placeholders, those arguments): the node's pattern
_PATTERNS: dict[tuple, tuple[Basic, tuple[Basic, ...]]] = {}
# (pattern, varying placeholders or None for the value) → (function, its argument symbols, dimension symbols)
_COMPILED: dict[tuple, tuple[Callable, tuple[Basic, ...], tuple[sp.Symbol, ...]]] = {}


def _placeholder(i: int, arg: Basic) -> Basic:
    return MatrixSymbol(f"_a{i}", *arg.shape) if isinstance(arg, MatrixExpr) else sp.Symbol(f"_s{i}")


def _tangent_symbol(p: Basic) -> MatrixSymbol:
    return MatrixSymbol("_d" + p.name[1:], *p.shape)


def compile_expression(args: tuple[Basic, ...], expr: Basic) -> tuple[Callable, tuple[sp.Symbol, ...]]:
    """A NumPy function of args followed by expr's dimension symbols (printed as a tree: expr must be small)."""
    printer = NumPyMatrixPrinter()
    body = printer.doprint(expr)
    dims = tuple(s for s in dimension_symbols(expr, *args) if s not in args)
    names = [a.name for a in (*args, *dims)]
    source = printer.helper_source() + f"\n\ndef _evaluate({', '.join(names)}):\n    return {body}\n"
    namespace: dict = {"np": np, "sp": sp, "ExpAtom": ExpAtom}
    exec(compile(source, "<symattn-dag-node>", "exec"), namespace)
    return namespace["_evaluate"], dims


class DagValues:
    """Values (and differentials) of expressions over known leaves, each distinct node computed once.

    known: the value of every MatrixSymbol (and scalar Symbol) the expressions use; it may
    grow between calls (names defined in order). dims: every dimension's size, by name. frozen: subexpressions
    held at given values whatever the leaves (a stop-gradient at the point a difference moves away from).
    tangents: dS, an expression over known symbols, for each symbol S that moves (the others
    are constant).
    """

    def __init__(
        self,
        known: Mapping[Basic, object],
        dims: Mapping[str, int],
        tangents: Mapping | None = None,
        frozen: Mapping[Basic, object] | None = None,
    ):
        self.known = known
        self.dims = dict(dims)
        self.tangents = dict(tangents or {})
        self.values: dict[Basic, object] = dict(frozen or {})  # frozen: nodes held at given values (stop-gradients)
        self.moving: dict[Basic, object] = {}  # node → dY (None: constant)
        self.matrices: dict[Basic, bool] = {}  # node → does it contain a matrix (is it evaluated by value)?
        self.scalars = frozenset(k for k in known if isinstance(k, sp.Symbol))  # known scalars are values too

    def _holds_matrix(self, node: Basic) -> bool:
        held = self.matrices.get(node)
        if held is None:
            for n in postorder(node, seen=self.matrices):
                self.matrices[n] = (
                    isinstance(n, (MatrixExpr, sp.Symbol)) and (isinstance(n, MatrixExpr) or n in self.known)
                ) or any(self.matrices[a] for a in _args(n))
            held = self.matrices[node]
        return held

    def _pattern(self, node: Basic) -> tuple[Basic, tuple[Basic, ...]]:
        found = _PATTERNS.get((node, self.scalars))
        if found is None:
            children = tuple(a for a in _args(node) if self._holds_matrix(a))
            holders = {a: _placeholder(i, a) for i, a in enumerate(_args(node)) if a in children}
            if isinstance(node, FunctionMatrix) or hasattr(type(node), "operand_count"):  # (and in its formulas)
                pattern = node.xreplace(holders)
            else:
                pattern = node.func(*(holders.get(a, a) for a in node.args)) if holders else node
            found = (pattern, children)
            if len(_PATTERNS) > _CACHE_MAX:
                _PATTERNS.clear()
            _PATTERNS[node, self.scalars] = found
        return found

    def _run(self, key: tuple, build: Callable[[], tuple[tuple[Basic, ...], Basic]], values: dict) -> object:
        compiled = _COMPILED.get(key)
        if compiled is None:
            args, expr = build()
            function, dims = compile_expression(args, expr)
            if len(_COMPILED) > _CACHE_MAX:
                _COMPILED.clear()
            compiled = _COMPILED[key] = (function, args, dims)
        function, args, dims = compiled
        try:
            sizes = [self.dims[s.name] for s in dims]
        except KeyError as err:
            raise SymattnError(f"dimension {err.args[0]} has no size") from None
        return function(*(values[a] for a in args), *sizes)

    def value(self, expr: Basic) -> object:
        """expr's value; a Differential(A) in it is A's differential (zero where A is constant)."""
        if expr in self.values:
            return self.values[expr]
        for node in postorder(expr, seen=self.values):
            if isinstance(node, (MatrixSymbol, sp.Symbol)) and node in self.known:  # a symbol's value, never 𝟙's
                self.values[node] = self.known[node]
            elif isinstance(node, Differential):
                self.values[node] = self._tangent_value(node.arg)
            elif isinstance(node, MatrixSymbol):
                raise SymattnError(f"{node.name} has no value")
            elif not self._holds_matrix(node):
                continue  # a scalar coefficient or a dimension: part of its parent's pattern
            else:
                pattern, children = self._pattern(node)
                holders = [_placeholder(i, a) for i, a in enumerate(_args(node)) if a in children]
                given = {h: self.values[a] for h, a in zip(holders, children)}
                self.values[node] = self._run((pattern, None), _constant((tuple(holders), pattern)), given)
        return self.values[expr]

    def _tangent_value(self, expr: Basic) -> object:
        d = self.tangent(expr)
        if d is None:
            sizes = {s: self.dims[s.name] for s in dimension_symbols(*expr.shape) if s.name in self.dims}
            return np.zeros(tuple(int(sp.sympify(s).xreplace(sizes)) for s in expr.shape))
        return d

    def tangent(self, expr: Basic) -> object | None:
        """dY for Y = expr when each symbol S of tangents moves by tangents[S]; None where Y is constant."""
        if expr in self.moving:
            return self.moving[expr]
        for node in postorder(expr, seen=self.moving):
            if node in self.tangents:
                self.moving[node] = self.value(self.tangents[node])
            elif isinstance(node, (MatrixSymbol, Differential)) or not self._holds_matrix(node):
                self.moving[node] = None
            else:
                self.moving[node] = self._node_tangent(node)
        return self.moving[expr]

    def _node_tangent(self, node: Basic) -> object | None:
        pattern, children = self._pattern(node)
        if all(self.moving[a] is None for a in children):
            return None
        if any(self.moving[a] is not None and not isinstance(a, MatrixExpr) for a in children):
            # a moving scalar argument: its differential written out (small: scalars are short)
            full = differential(node, self.tangents)
            return None if full is None else self.value(full)
        holders = [_placeholder(i, a) for i, a in enumerate(_args(node)) if a in children]
        varying = frozenset(h for h, a in zip(holders, children) if self.moving[a] is not None)
        given = {h: self.value(a) for h, a in zip(holders, children)}
        given.update({_tangent_symbol(h): self.moving[a] for h, a in zip(holders, children) if h in varying})

        def build() -> tuple[tuple[Basic, ...], Basic]:
            local = local_differential(pattern, set(varying))
            if local is None:
                return (), sp.ZeroMatrix(*pattern.shape)
            named = rewrite(local, lambda e: _tangent_symbol(e.arg) if isinstance(e, Differential) else None)
            return (*holders, *(_tangent_symbol(h) for h in holders if h in varying)), named

        return self._run((pattern, varying), build, given)


def _constant(value: tuple) -> Callable[[], tuple]:
    return lambda: value


def _args(node: Basic) -> tuple[Basic, ...]:
    """The node's operands: a matrix of positions' are its trainable scalars (``lang.graph.children``)."""
    return children(node)


__all__ = ["DagValues", "compile_expression"]
