"""Expressions as DAGs: walks that visit every distinct subexpression once, without recursion.

A spec of L layers shares each layer's value among the next layer's uses, so the tree
SymPy prints or walks (``has``, ``preorder_traversal``, ``xreplace``, ``sort_key``) grows
exponentially in L while the DAG grows linearly. Everything here works on the DAG, with
an explicit stack (no recursion limit tied to the depth), and counts the nodes it visits
in ``VISITS`` so tests can check that work grows linearly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from sympy import Basic, Expr, MatrixExpr, MatrixSymbol, Symbol, default_sort_key
from sympy.matrices.expressions import FunctionMatrix, HadamardProduct, MatAdd, MatMul
from sympy.matrices.expressions.matexpr import MatrixElement

T = TypeVar("T")
VISITS = {"nodes": 0}  # distinct nodes visited by the walks below (for tests that count work)
_MEMOS: list[dict] = []  # the tables that keep a value per expression across calls (``memo_table``)


def memo_table(table: dict) -> dict:
    """table, registered as a memo that ``clear_memos`` empties."""
    _MEMOS.append(table)
    return table


def clear_memos() -> None:
    """Empty every memo kept across calls: what a fresh process would compute is computed again (a test that
    counts the work of one spec is then not helped by another's)."""
    for table in _MEMOS:
        table.clear()
    matrix_symbols.cache_clear()


def children(node: Basic) -> tuple[Basic, ...]:
    """The arguments a walk descends into: none of a matrix symbol; of a matrix of positions, the trainable scalars
    and the tables its formula reads (the rest of the formula is scalars of its own, ``lang.positions``); of a node
    that counts its operands (``operand_count``), those first arguments."""
    if isinstance(node, FunctionMatrix):
        formula = node.lamda.expr
        scalars = {x for x in formula.free_symbols if isinstance(x, Symbol) and not x.is_integer}
        return tuple(sorted(scalars | {r.parent for r in formula.atoms(MatrixElement)}, key=default_sort_key))
    if hasattr(type(node), "operand_count"):  # a node with operands first, then sizes and formulas of its own
        return node.args[: node.operand_count] + _formula_tables(node)
    return () if isinstance(node, MatrixSymbol) else node.args


def _formula_tables(node: Basic) -> tuple[Basic, ...]:
    """The matrices a node's own formulas read (a scatter's index reading a constant: Swin's idx of (idx[i, j], h)),
    after its operands: operands too."""
    reads = {r.parent for a in node.args[node.operand_count :] for r in a.atoms(MatrixElement)}
    return tuple(sorted(reads, key=default_sort_key))


def postorder(*roots: Basic, seen: Container[Basic] = ()) -> Iterator[Basic]:
    """Every distinct subexpression of the roots once, each after its arguments (leaves first).

    Nodes in seen (a memo of an earlier walk) are neither yielded nor walked into.
    """
    done: set[Basic] = set()
    for root in roots:
        if root in done or root in seen:
            continue
        stack: list[tuple[Basic, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                VISITS["nodes"] += 1
                yield node
                continue
            if node in done or node in seen:
                continue
            done.add(node)
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(children(node)) if a not in done and a not in seen)


def bottom_up(
    root: Basic,
    memo: dict[Basic, T],
    parts: Callable[[Basic], Sequence[Basic]],
    combine: Callable[[Basic, dict[Basic, T]], T],
    max_size: int = 1 << 17,
) -> T:
    """combine(node, memo) for root and, first, for every part (``parts``) below it not yet in memo.

    A value per distinct node kept across calls (memo, cleared when over max_size), computed on an
    explicit stack: a deep DAG is no deeper for Python.
    """
    if root in memo:
        return memo[root]
    if len(memo) > max_size:
        memo.clear()
    stack: list[tuple[Basic, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        inner = [x for x in parts(node) if x not in memo]
        if expanded or not inner:
            memo[node] = combine(node, memo)
        else:
            stack.append((node, True))
            stack.extend((x, False) for x in inner)
    return memo[root]


def nodes(*roots: Basic) -> list[Basic]:
    """The distinct subexpressions of the roots (leaves first)."""
    return list(postorder(*roots))


@functools.lru_cache(maxsize=1 << 14)
def matrix_symbols(expr: Basic) -> frozenset:
    """The matrix symbols expr reads (``expr.atoms(MatrixSymbol)``), found on its DAG once per expression."""
    return frozenset(n for n in postorder(expr) if isinstance(n, MatrixSymbol))


def fold(root: Basic, leaf: Callable[[Basic], object], combine: Callable[[Basic, list], object]) -> object:
    """A value per node computed bottom-up once per distinct node: leaf(node) or combine(node, arg values)."""
    value: dict[Basic, object] = {}
    for node in postorder(root):
        args = children(node)
        value[node] = combine(node, [value[a] for a in args]) if args else leaf(node)
    return value[root]


def tree_size(expr: Basic, cap: int) -> int:
    """The number of leaves expr has when printed as a tree, counted on the DAG; at most cap + 1."""
    return fold(expr, lambda _: 1, lambda _, sizes: min(cap + 1, sum(sizes) or 1))


def depends(roots: Iterable[Basic], targets: Iterable[Basic]) -> dict[Basic, bool]:
    """For every subexpression of the roots: does it contain one of targets?"""
    wanted = set(targets)
    out: dict[Basic, bool] = {}
    for node in postorder(*roots):
        out[node] = node in wanted or any(out[a] for a in children(node))
    return out


def first(root: Basic, where: Callable[[Basic], bool]) -> Basic | None:
    """A subexpression for which where holds (None if there is none)."""
    return next((n for n in postorder(root) if where(n)), None)


def rewrite(root: Basic, replace: Callable[[Basic], Basic | None]) -> Basic:
    """root with each distinct subexpression rebuilt bottom-up; replace(node) (None: keep) is tried first.

    Like ``xreplace``, but a shared subexpression is rewritten once, and replaced
    subexpressions are not entered.
    """
    out: dict[Basic, Basic] = {}
    done: set[Basic] = set()
    stack: list[tuple[Basic, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            args = [out[a] for a in children(node)]
            out[node] = rebuilt(node, args)
            continue
        if node in done:
            continue
        done.add(node)
        VISITS["nodes"] += 1
        new = replace(node)
        if new is not None:
            out[node] = new
            continue
        if not children(node):
            out[node] = node
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in children(node) if a not in done)
    return out[root]


_SORT_KEYS: dict[Basic, tuple] = memo_table({})  # expression → sympy.default_sort_key(expression), kept across calls
_SORT_KEYS_MAX = 1 << 19


def sort_key(expr: Basic) -> tuple:
    """``sympy.default_sort_key(expr)``, each distinct subexpression's key computed once.

    SymPy's ``Expr.sort_key`` recurses into the arguments through a bounded LRU cache, so
    a deep DAG's key costs its tree size once the cache overflows. Here the keys are
    computed leaves first (no deep recursion) while ``Expr.sort_key`` looks them up in a
    table; the keys are SymPy's own, so orders do not change.
    """
    if expr in _SORT_KEYS:
        return _SORT_KEYS[expr]
    if len(_SORT_KEYS) > _SORT_KEYS_MAX:
        _SORT_KEYS.clear()
    original = Expr.sort_key

    def memoized(self: Expr, order=None) -> tuple:
        if order is not None:
            return original(self, order)
        key = _SORT_KEYS.get(self)
        if key is None:
            key = _SORT_KEYS[self] = original(self)
        return key

    Expr.sort_key = memoized
    try:
        _warm(expr)
        return _SORT_KEYS[expr]
    finally:
        Expr.sort_key = original


@contextmanager
def sort_keys_of(*exprs: Basic) -> Iterator[None]:
    """Within the block, SymPy's sort keys of exprs' subexpressions come from ``sort_key``'s table (no recursion)."""
    for e in exprs:
        sort_key(e)
    original = Expr.sort_key

    def memoized(self: Expr, order=None) -> tuple:
        key = _SORT_KEYS.get(self) if order is None else None
        return original(self, order) if key is None else key

    Expr.sort_key = memoized
    try:
        yield
    finally:
        Expr.sort_key = original


def _warm(expr: Basic) -> None:
    """Sort keys of expr's subexpressions into the table, leaves first (Expr.sort_key already memoized)."""
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if node in _SORT_KEYS:
            continue
        if expanded or not node.args:
            VISITS["nodes"] += 1
            _SORT_KEYS[node] = default_sort_key(node)
            continue
        stack.append((node, True))
        stack.extend((a, False) for a in node.args if isinstance(a, Basic) and a not in _SORT_KEYS)


_INTERNED: dict[Basic, Basic] = memo_table({})


def rebuilt(node: Basic, args) -> Basic:
    """node with new arguments (in the order of ``children``), interned; node itself when every argument is the same
    object (no deep ``==``).

    A product, sum or entrywise product of matrices is put together directly: its new arguments stand for
    the old ones (same shapes), so SymPy's constructor would only sympify and validate them again.
    """
    if isinstance(node, FunctionMatrix):  # a matrix of positions: new trainable scalars in its formula
        operands = children(node)
        return node if all(a is b for a, b in zip(args, operands)) else intern(node.xreplace(dict(zip(operands, args))))
    if hasattr(type(node), "operand_count"):  # (the tables its formulas read: replaced in them)
        count, operands = node.operand_count, children(node)
        if all(a is b for a, b in zip(args, operands)):
            return node
        tables = dict(zip(operands[count:], args[count:]))
        return intern(node.func(*args[:count], *(a.xreplace(tables) for a in node.args[count:])))
    if all(a is b for a, b in zip(args, node.args)):
        return node
    kind = type(node)
    if kind in (MatAdd, HadamardProduct) and all(isinstance(a, MatrixExpr) for a in args):
        return intern(Basic.__new__(kind, *args))
    if kind is MatMul and all(isinstance(a, Basic) for a in args) and any(isinstance(a, MatrixExpr) for a in args):
        return intern(Basic.__new__(kind, *args))
    return intern(node.func(*args))


def hash_consed(roots: Iterable[Basic]) -> list[Basic]:
    """The roots with every subexpression replaced by the one interned object equal to it.

    An expression built with SymPy's operators (a spec file's) holds equal subtrees as distinct
    objects, which SymPy's ``==`` compares down the whole tree, in every dictionary lookup.
    The walk goes by object identity, so each object is visited once, without comparing any.
    """
    memo: dict[int, Basic] = {}  # the roots keep every object walked alive: no id is reused during the walk
    out = []
    for root in roots:
        stack: list[tuple[Basic, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in memo:
                continue
            if expanded or not children(node):
                args = [memo[id(a)] for a in children(node)] if expanded else []
                memo[id(node)] = intern(rebuilt(node, args) if expanded else node)
                continue
            stack.append((node, True))
            stack.extend((a, False) for a in children(node) if id(a) not in memo)
        out.append(memo[id(root)])
    return out


def intern(expr: Basic) -> Basic:
    """The one object equal to expr that builders hand out (hash-consing).

    SymPy compares two equal expressions that are distinct objects argument by argument,
    down the whole tree; built from interned arguments, the comparison stops one level
    down (identical arguments), so dictionaries of deep expressions stay fast.
    """
    if len(_INTERNED) > _SORT_KEYS_MAX:
        _INTERNED.clear()
    return _INTERNED.setdefault(expr, expr)


__all__ = [
    "VISITS",
    "children",
    "clear_memos",
    "depends",
    "first",
    "fold",
    "hash_consed",
    "intern",
    "matrix_symbols",
    "memo_table",
    "nodes",
    "postorder",
    "rebuilt",
    "rewrite",
    "sort_key",
    "tree_size",
]
