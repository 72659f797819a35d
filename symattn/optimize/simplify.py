"""Simplification: rewrite rules applied to a fixpoint, kept where the cost model says so.

``simplify`` applies ``REWRITES`` (never costlier) bottom-up to a fixpoint, then each
of ``COST_REWRITES`` anywhere it lowers the FLOPs of the whole expression DAG, shared
and given subexpressions counted once (``symattn.optimize.cost``); then it shares transposed
pairs (V Gᵀ and G Vᵀ) and puts products in matrix-chain order. The rules themselves
live in ``symattn.optimize.rewrites``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul, Trace, Transpose

from symattn.lang import graph
from symattn.lang.naming.safe import expression
from symattn.lang.ops import SumEntries
from symattn.optimize.cost import TYPICAL_SIZES, contains_matrices, flops_value, order_products, subexpressions
from symattn.optimize.rewrites import COST_REWRITES, REWRITES, Rule, flatten_product
from symattn.optimize.transposes import CONSTANTS, count_transposes, transposed

__all__ = ["COST_REWRITES", "REWRITES", "improve", "rewrite", "share_transposes", "simplify", "simplify_all"]

# The engine.

MAX_REWRITES_PER_NODE = 100


def _walks_into(e: Basic) -> bool:
    if isinstance(e, (MatrixExpr, SumEntries, Trace)):
        return not isinstance(e, (MatrixSymbol, *CONSTANTS))
    return contains_matrices(e)


# rules → {node: its fixpoint}; the rules are pure functions of a node, so results hold across calls
_FIXPOINTS: dict[tuple, dict[Basic, Basic]] = graph.memo_table({})
MAX_CACHED = 200_000
IMPROVE_MAX_NODES = 600  # the built-ins' joint forward and gradients: at most 138


def rewrite(expr: Basic, rules: Sequence[Rule] = REWRITES) -> Basic:
    """Apply the rules bottom-up, each node's result rewritten again, until none applies."""
    memo = _FIXPOINTS.setdefault(tuple(rules), {})
    if len(memo) > MAX_CACHED:
        memo.clear()

    def visit(root: Basic) -> Basic:
        stack = [root]  # arguments first, on an explicit stack: a deep DAG is no deeper for Python
        while stack:
            node = stack[-1]
            if node in memo:
                stack.pop()
                continue
            walks = _walks_into(node)
            pending = [a for a in graph.children(node) if _walks_into(a) and a not in memo] if walks else []
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            current = node
            if walks:
                current = graph.rebuilt(node, tuple(memo[a] if _walks_into(a) else a for a in graph.children(node)))
                for _ in range(MAX_REWRITES_PER_NODE):
                    new = next((r for r in (rule(current) for rule in rules) if r is not None and r != current), None)
                    if new is None:
                        break
                    current = visit(new)  # a rule's result: as deep as the rule, its arguments mostly known
            current = graph.intern(current)
            memo[node] = memo[current] = current
        return memo[root]

    return visit(expression(expr))


def improve(
    expr: Basic,
    cost: Callable[[Basic], float],
    cost_rules: Sequence[Rule] = COST_REWRITES,
    rules: Sequence[Rule] = REWRITES,
    given: int = 0,
) -> Basic:
    """Apply cost-guided rules anywhere in expr while the total cost goes down.

    Each pass tries every rule at every node of the expression as the pass began
    (a node an earlier rewrite removed is skipped); passes repeat until one keeps
    nothing. A rewrite once rejected is not tried again (greedy). Each try costs the whole
    DAG, so a DAG of more than IMPROVE_MAX_NODES nodes is returned as it is: a deep stack's
    gradients written out in full (``cost_report``'s simplified column; the schedules simplify
    value by value, each with its names as leaves, and stay far below).

    ``given``: expr is a Tuple whose first ``given`` arguments are values computed anyway (a forward
    pass): they count in the cost, where the others can reuse them, but no rule is tried at a node that
    only they hold (their values are what they are).
    """
    if len(subexpressions([expr])) > IMPROVE_MAX_NODES:
        return expr
    best = None  # the cost of expr, computed once a rule applies somewhere (mostly none does)
    rejected: set[tuple[Basic, Rule]] = set()
    improved = True
    while improved:
        improved = False
        snapshot = subexpressions([sp.Tuple(*expr.args[given:])] if given else [expr])
        present = None  # every node of the snapshot, until a rewrite is kept
        for node in snapshot:
            if present is not None and node not in present:
                continue
            for rule in cost_rules:
                if (node, rule) in rejected:
                    continue
                candidate = rule(node)
                if candidate is None or candidate == node:
                    rejected.add((node, rule))
                    continue
                best = cost(expr) if best is None else best
                new = rewrite(replaced(expr, node, candidate), rules)
                new_cost = cost(new)
                if new_cost < best:
                    expr, best, improved = new, new_cost, True
                    present = set(subexpressions([expr]))
                    break
                rejected.add((node, rule))
    return expr


def replaced(expr: Basic, old: Basic, new: Basic) -> Basic:
    """expr with every occurrence of old replaced by new (``xreplace`` on the DAG: each shared node rebuilt once)."""
    return graph.rewrite(expr, lambda node: new if node == old else None)


def share_transposes(expr: Basic, rules: Sequence[Rule] = REWRITES) -> Basic:
    """Where both M and Mᵀ occur (V Gᵀ and G Vᵀ), write one of them as the transpose of the other.

    The orientation kept has fewer transposes, or occurs first; transposes are free
    views, so the pair costs one evaluation.
    """
    kinds = (MatMul, MatAdd, HadamardProduct)
    nodes = subexpressions([expr])
    position = {n: i for i, n in enumerate(nodes)}
    shapes = {n: n.shape for n in nodes if isinstance(n, kinds)}
    present = {(type(n), shape) for n, shape in shapes.items()}
    replace: dict[Basic, Basic] = {}
    for node in nodes:
        if not isinstance(node, kinds) or node in replace:
            continue
        if (type(node), shapes[node][::-1]) not in present:  # no node of its kind has the transposed shape
            continue
        other = rewrite(transposed(node), rules)
        if other == node or other not in position or other in replace:
            continue
        keep_other = (count_transposes(other), position[other]) < (count_transposes(node), position[node])
        if keep_other:
            replace[node] = other
        else:
            replace[other] = node
    memo: dict[Basic, Basic] = {}

    def rebuild(node: Basic) -> Basic:
        # bottom-up, so a kept orientation carries the replacements inside it wherever it occurs
        if node not in memo:
            if node in replace:
                memo[node] = Transpose(rebuild(replace[node]))
            elif _walks_into(node):
                args = tuple(rebuild(a) for a in graph.children(node))
                memo[node] = graph.rebuilt(node, args)
            else:
                memo[node] = node
        return memo[node]

    return rebuild(expr) if replace else expr


def simplify(
    expr: Basic,
    given: Sequence[Basic] = (),
    cost: Callable[[Basic], float] | None = None,
    rules: Sequence[Rule] = REWRITES,
    cost_rules: Sequence[Rule] = COST_REWRITES,
    sizes: Mapping[str, int] | None = None,
) -> Basic:
    """An equal expression that is no more costly to evaluate, products in cost order.

    ``given``: expressions whose values are at hand anyway (a spec's forward output
    when simplifying its gradients). They are simplified together with expr, so the
    nodes they share come out equal, and counted once, so a rewrite that reuses them
    (rowsum(dP ⊙ P) → rowsum(dO ⊙ O)) is taken. ``cost`` maps an expression to a
    number (default: FLOPs of its DAG at ``sizes``, ``TYPICAL_SIZES`` by default).
    """
    options = {"cost": cost, "rules": rules, "cost_rules": cost_rules, "sizes": sizes}
    return simplify_all([*given, expr], **options, given=len(given))[-1]


def simplify_all(
    exprs: Sequence[Basic],
    cost: Callable[[Basic], float] | None = None,
    rules: Sequence[Rule] = REWRITES,
    cost_rules: Sequence[Rule] = COST_REWRITES,
    sizes: Mapping[str, int] | None = None,
    given: int = 0,
) -> list[Basic]:
    """Simplify several expressions as one DAG (e.g. a forward output and all its gradients); the first
    ``given`` are values at hand anyway: counted, reused, not rewritten by the cost-guided rules.

    Shared subexpressions come out as identical nodes, so a schedule computes them
    once; a cost-guided rule is kept where the FLOPs of all of them together go down.
    """
    table = sizes or TYPICAL_SIZES
    if cost is None:

        def cost(e: Basic) -> float:
            return flops_value(e, sizes=table)

    original = sp.Tuple(*(expression(e) for e in exprs))
    joint = improve(rewrite(original, rules), cost, cost_rules, rules, given)
    joint = order_products(share_transposes(joint, rules), table)
    # once products are nested, their sub-products can be shared too (W_Kᵀ Xᵀ = (X W_K)ᵀ)
    joint = share_transposes(joint, tuple(r for r in rules if r is not flatten_product))
    # flattening a product may lose a sharing the input spelled out (A B in (A B) C and (A B) D)
    # that the chain order does not find again: never return something costlier than the input
    return list(joint.args if cost(joint) <= cost(original) else original.args)
