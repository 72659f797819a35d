"""Cost model: FLOPs and temporary bytes of expression DAGs, with symbolic dimensions.

An expression set is costed as a hash-consed DAG: a subexpression shared by several
gradients (P, dP, dS) or already computed (``given``, e.g. the forward pass) is
counted once, or not at all. Per node: a product of matrices costs 2·a·b·c per
pairwise step (a product with a ones matrix is a row sum, a column times 𝟏ᵀ a
broadcast), entrywise nodes one FLOP per entry (a function node: its record's ``flops``),
transposes, head splits and slices are free views, block matrices and head merges
copies. A flat ``MatMul`` is costed in its cheapest evaluation order, which
``order_products`` makes explicit by nesting. Nodes inside ``SplitHeads`` count once
per head. Sizes are symbolic unless a table of sizes (``TYPICAL_SIZES``) is given.
``peak_bytes`` replays the DAG in post-order, freeing each value after its last use
and letting an entrywise node overwrite an argument that dies there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import (
    BlockMatrix,
    HadamardPower,
    HadamardProduct,
    Identity,
    MatAdd,
    MatMul,
    MatPow,
    MatrixSlice,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)

from symattn.lang.algebra import factors
from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import VISITS, children, memo_table, rebuilt
from symattn.lang.ops import MergeHeads, RowSum, SplitHeads, SumEntries

# Sizes for evaluating symbolic costs and choosing between equal forms (a BERT-base-like head:
# n = m = 512, d_k = d_v = 64); a dimension not in the table is TYPICAL_OTHER.
TYPICAL_SIZES: dict[str, int] = {
    **{"n": 512, "m": 512, "d": 64, "d_k": 64, "d_v": 64, "d_model": 512, "H": 8},
    "d_ff": 2048,  # transformer_block's feed-forward width (4 · d_model)
    "b": 128,  # query rows per block of the generated memory-efficient variant
}
TYPICAL_OTHER = 64


@contextmanager
def sizes_at(sizes: Mapping[str, int] | None) -> Iterator[None]:
    """Within the block, every decision priced at typical sizes (the schedule's product orders, where a scalar
    goes, which form of a gradient is cheaper) prices the named dimensions at the sizes given: a user's own
    dimensions (a model width g) at the sizes their model runs at, not at ``TYPICAL_OTHER``. (The memos kept
    across calls hold structure, or FLOPs by size table: none holds a decision priced at another table.)"""
    saved = dict(TYPICAL_SIZES)
    TYPICAL_SIZES.update(sizes or {})
    try:
        yield
    finally:
        TYPICAL_SIZES.clear()
        TYPICAL_SIZES.update(saved)


VIEWS = (Transpose, SplitHeads, MatrixSlice)  # nodes that allocate nothing (NumPy/torch views)
COPIES = (BlockMatrix, MergeHeads)  # nodes that move entries without arithmetic
LEAVES = (MatrixSymbol, OneMatrix, ZeroMatrix, Identity)

Sizes = Callable[[Basic], Basic]


def size_function(sizes: Mapping[str, int] | None) -> Sizes:
    """Maps a dimension expression to a number under the table (names → ints), or leaves it symbolic."""
    if sizes is None:
        return sp.sympify
    table = {k: sp.Integer(v) for k, v in sizes.items()}
    known: dict[Basic, Basic | int] = {}

    def evaluate(dim: Basic) -> Basic | int:
        """dim under the table, once per distinct dim; a number as a Python int (costs add up as ints)."""
        if dim not in known:
            expr = sp.sympify(dim)
            value = expr.xreplace({s: table[s.name] for s in expr.free_symbols if s.name in table})
            known[dim] = int(value) if value.is_Integer else value
        return known[dim]

    return evaluate


def is_matrix_node(e: Basic) -> bool:
    """A node the cost model walks into: matrix expressions and scalar reductions of them."""
    return isinstance(e, (MatrixExpr, SumEntries, Trace))


def contains_matrices(e: Basic) -> bool:
    """A tuple or scalar expression with matrix subexpressions inside (2·tr(A), sum(X) + 1)."""
    return isinstance(e, sp.Tuple) or (isinstance(e, (sp.Add, sp.Mul, sp.Pow)) and e.has(SumEntries, Trace))


def roots(exprs: Iterable[Basic]) -> list[Basic]:
    """The expressions, a ``Tuple`` of them taken apart."""
    return [r for e in exprs for r in (e.args if isinstance(e, sp.Tuple) else (e,))]


def subexpressions(exprs: Iterable[Basic], given: Iterable[Basic] = ()) -> list[Basic]:
    """Every distinct matrix subexpression, each after its arguments (post-order, DAG).

    The given nodes (values computed before) are neither listed nor walked into.
    """
    order: list[Basic] = []
    seen: set[Basic] = set(given)
    for root in roots(exprs):
        stack: list[tuple[Basic, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                VISITS["nodes"] += 1
                order.append(node)
                continue
            if node in seen:
                continue
            if not is_matrix_node(node):
                if contains_matrices(node):  # e.g. 2·tr(A): walk through, record nothing
                    seen.add(node)
                    stack.extend((a, False) for a in reversed(node.args) if a not in seen)
                continue
            seen.add(node)
            stack.append((node, True))
            if not isinstance(node, LEAVES):
                stack.extend((a, False) for a in reversed(node.args) if is_matrix_node(a) and a not in seen)
    return order


def multiplicity(e: Basic) -> Basic:
    """How many matrices of e's shape the node stands for: H below SplitHeads, else 1."""
    return _multiplicity(e)


@cache
def _multiplicity(e: Basic) -> Basic:
    if isinstance(e, SplitHeads):
        return e.heads
    if isinstance(e, (MergeHeads, *LEAVES)) or not is_matrix_node(e):
        return sp.Integer(1)
    for a in e.args:
        if is_matrix_node(a):
            m = _multiplicity(a)
            if m != 1:
                return m
    return sp.Integer(1)


def numel(e: Basic, dim: Sizes) -> Basic:
    """Entries of e (all heads)."""
    if not isinstance(e, MatrixExpr):
        return sp.Integer(1)
    return dim(e.shape[0]) * dim(e.shape[1]) * dim(multiplicity(e))


# Products: pairwise costs and matrix-chain order.


def pair_flops(left: Basic, right: Basic, dim: Sizes) -> Basic:
    """Cost of left @ right: 2·a·b·c; a sum of b terms with ones; nothing for a broadcast x 𝟏ᵀ."""
    a, b, c = dim(left.shape[0]), dim(left.shape[1]), dim(right.shape[1])
    if isinstance(right, OneMatrix) and left.shape[1] == 1:
        return sp.Integer(0)
    if isinstance(right, OneMatrix) or isinstance(left, OneMatrix):
        return a * b * c
    return 2 * a * b * c


def _as_number(x: Basic) -> float:
    """x at ``TYPICAL_SIZES``."""
    if isinstance(x, (int, float)):
        return float(x)
    if x.is_number:
        return float(x)
    return float(x.xreplace({s: TYPICAL_SIZES.get(s.name, TYPICAL_OTHER) for s in x.free_symbols}))


def typical_size(size: Basic) -> int:
    """A dimension (or a product of dimensions) at ``TYPICAL_SIZES``."""
    return int(_as_number(sp.sympify(size)))


def chain_order(mats: Sequence[Basic], dim: Sizes) -> Basic:
    """The cheapest parenthesisation of F₁ … F_k (matrix-chain dynamic programme), as nested MatMuls.

    Decisions compare costs at the size table (typical sizes where dim leaves symbols).
    """
    k = len(mats)
    best: dict[tuple[int, int], tuple[float, Basic]] = {(i, i): (0.0, mats[i]) for i in range(k)}
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            options = []
            for split in range(i, j):
                (lc, left), (rc, right) = best[(i, split)], best[(split + 1, j)]
                step = _as_number(pair_flops(left, right, dim))
                options.append((lc + rc + step, split, left, right))
            cost, _, left, right = min(options, key=lambda o: (o[0], -o[1]))  # ties: left to right
            best[(i, j)] = (cost, Basic.__new__(MatMul, left, right))  # consecutive factors: no shape check
    return best[(0, k - 1)][1]


def _order_tree_flops(tree: Basic, leaves: set, dim: Sizes) -> Basic:
    if tree in leaves or not isinstance(tree, MatMul):
        return sp.Integer(0)
    left, right = tree.args
    return _order_tree_flops(left, leaves, dim) + _order_tree_flops(right, leaves, dim) + pair_flops(left, right, dim)


def product_flops(node: MatMul, dim: Sizes) -> Basic:
    """Cost of c F₁ … F_k in its cheapest order, c applied to the smaller outermost operand or the result."""
    coeff, mats = factors(node)
    flops, operands = sp.Integer(0), mats
    if len(mats) > 1:
        tree = chain_order(mats, dim)
        flops, operands = _order_tree_flops(tree, set(mats), dim), list(tree.args)
    if coeff not in (1, -1):  # a sign folds into the sum that holds the term
        sizes = [dim(f.shape[0]) * dim(f.shape[1]) for f in [*operands, node]]
        flops += min(sizes, key=_as_number)
    return flops


def node_flops(node: Basic, dim: Sizes) -> Basic:
    """FLOPs of one node given its arguments' values."""
    if isinstance(node, (*LEAVES, *VIEWS, *COPIES, sp.MatrixBase)) or not is_matrix_node(node):
        return sp.Integer(0)
    heads = dim(multiplicity(node))
    if isinstance(node, MatMul):
        return product_flops(node, dim) * heads
    if isinstance(node, (MatAdd, HadamardProduct)):
        matrices = [a for a in node.args if isinstance(a, MatrixExpr)]
        return (len(matrices) - 1) * numel(node, dim)
    if isinstance(node, (RowSum, SumEntries)):
        return numel(node.arg, dim)
    if isinstance(node, Trace):
        return dim(node.arg.shape[0])
    if isinstance(node, MatPow):  # A^k by k − 1 products
        rows = dim(node.shape[0])
        return (node.args[1] - 1) * 2 * rows**3 * heads
    if isinstance(node, FunctionRecord):  # entrywise and row-wise functions: their records' FLOPs per entry read
        return node.flops * numel(node.arg, dim)  # (a row's k-th largest, n × 1, reads the n × m entries)
    return numel(node, dim)


def is_view(node: Basic) -> bool:
    """A value that aliases its argument: a transpose, a head split, a broadcast ±x 𝟏ᵀ."""
    if isinstance(node, VIEWS):
        return True
    if isinstance(node, MatMul):
        coeff, mats = factors(node)
        return len(mats) == 2 and coeff in (1, -1) and mats[0].shape[1] == 1 and isinstance(mats[1], OneMatrix)
    return False


def node_bytes(node: Basic, dim: Sizes, itemsize: int = 4) -> Basic:
    """Bytes a node's value allocates (views and inputs none)."""
    if isinstance(node, (*LEAVES, sp.MatrixBase)) or is_view(node) or not isinstance(node, MatrixExpr):
        return sp.Integer(0)  # an explicit matrix here is only the container of a block matrix's blocks
    return numel(node, dim) * itemsize


def is_entrywise(node: Basic) -> bool:
    """A node that can write its value over an argument of its own shape (c X, X + Y, X ⊙ Y, f(X), softmax)."""
    if isinstance(node, MatMul):
        return len([a for a in node.args if isinstance(a, MatrixExpr)]) == 1
    return isinstance(node, (MatAdd, HadamardProduct, HadamardPower, FunctionRecord))


def flops(exprs: Basic | Sequence[Basic], given: Sequence[Basic] = (), sizes: Mapping | None = None) -> Basic:
    """FLOPs of evaluating the expressions together, shared subexpressions once, given ones free."""
    exprs = [exprs] if isinstance(exprs, Basic) else list(exprs)
    dim = size_function(sizes)
    free = set(subexpressions(given))
    table = tuple(sorted(sizes.items())) if sizes is not None else None
    memo = _NODE_FLOPS.setdefault(table, {})
    if len(memo) > 100_000:
        memo.clear()
    total = []
    for node in subexpressions(exprs):
        if node not in free:
            if node not in memo:
                memo[node] = node_flops(node, dim)
            total.append(memo[node])
    if all(isinstance(t, int) for t in total):  # numbers under a full size table: added as ints
        return sp.Integer(sum(total))
    return sp.Add(*total)


_NODE_FLOPS: dict[tuple | None, dict[Basic, Basic]] = memo_table({})  # size table → {node: its FLOPs}


def flops_value(exprs: Basic | Sequence[Basic], given: Sequence[Basic] = (), sizes: Mapping | None = None) -> float:
    """``flops`` evaluated at the size table (default ``TYPICAL_SIZES``; a dimension it lacks is ``TYPICAL_OTHER``)."""
    return _as_number(flops(exprs, given, sizes or TYPICAL_SIZES))


def peak_bytes(
    exprs: Basic | Sequence[Basic],
    given: Sequence[Basic] = (),
    sizes: Mapping | None = None,
    itemsize: int = 4,
    in_place: bool = True,
) -> float:
    """Peak bytes of live temporaries when the DAG is evaluated in post-order.

    A value is freed after its last use (a view keeps its base alive); the
    expressions' own values stay live to the end; inputs and given values cost
    nothing. With ``in_place``, an entrywise node whose argument of the same shape
    dies there writes over that argument's buffer instead of allocating.
    """
    exprs = roots([exprs] if isinstance(exprs, Basic) else exprs)
    dim = size_function(sizes or TYPICAL_SIZES)
    free = set(subexpressions(given))
    order = [n for n in subexpressions(exprs) if n not in free]
    position = {n: i for i, n in enumerate(order)}
    outputs = set(exprs)  # not the list: == on two deep trees recurses
    last_use = {n: (len(order) if n in outputs else position[n]) for n in order}
    for node in reversed(order):
        for a in node.args:
            if a in position:
                last_use[a] = max(last_use[a], last_use[node] if is_view(node) else position[node])
    releases: dict[int, list[Basic]] = {}
    for n, i in last_use.items():
        releases.setdefault(i, []).append(n)
    donated: set[Basic] = set()  # buffers taken over by an in-place node
    live = peak = 0.0
    for i, node in enumerate(order):
        size = float(node_bytes(node, dim, itemsize))
        donor = next(
            (
                a
                for a in node.args
                if in_place
                and is_entrywise(node)
                and a in position
                and a not in donated
                and last_use[a] == i
                and float(node_bytes(a, dim, itemsize)) == size > 0
            ),
            None,
        )
        if donor is not None:
            donated.add(donor)
        else:
            live += size
        peak = max(peak, live)
        live -= sum(float(node_bytes(n, dim, itemsize)) for n in releases.get(i, []) if n not in donated)
    return peak


def largest_temporaries(
    exprs: Basic | Sequence[Basic], given: Sequence[Basic] = (), sizes: Mapping | None = None, count: int = 3
) -> list[tuple[Basic, Basic]]:
    """The largest allocating subexpressions (symbolic entries), biggest first."""
    exprs = [exprs] if isinstance(exprs, Basic) else list(exprs)
    dim = size_function(sizes)
    free = set(subexpressions(given))
    nodes = [n for n in subexpressions(exprs) if n not in free and node_bytes(n, dim) != 0]
    nodes.sort(key=lambda n: -_as_number(numel(n, dim)))
    return [(n, numel(n, dim)) for n in nodes[:count]]


def order_products(expr: Basic, sizes: Mapping | None = None) -> Basic:
    """expr with every product nested in its cheapest order and its scalar on the smallest operand."""
    dim = size_function(sizes)
    memo: dict[Basic, Basic] = {}

    def visit(node: Basic) -> Basic:
        if node in memo:
            return memo[node]
        result = node
        if (is_matrix_node(node) and not isinstance(node, LEAVES)) or contains_matrices(node):
            args = tuple(visit(a) if is_matrix_node(a) or contains_matrices(a) else a for a in children(node))
            result = rebuilt(node, args)
            if isinstance(result, MatMul):
                result = _ordered_product(result, dim)
        memo[node] = result
        return result

    return visit(expr)


def _ordered_product(node: MatMul, dim: Sizes) -> Basic:
    coeff, mats = factors(node)
    tree = chain_order(mats, dim) if len(mats) > 1 else mats[0]
    if coeff == 1:
        return tree
    if coeff == -1 or len(mats) == 1:
        return MatMul(coeff, *([tree] if len(mats) == 1 else tree.args))
    return _scale_smallest(tree, coeff, dim)


def _scale_smallest(tree: MatMul, coeff: Basic, dim: Sizes) -> Basic:
    """Put c on the smaller outermost operand (so c (A B) keeps the shared A B), or on the result."""
    operands = [i for i, a in enumerate(tree.args) if not isinstance(a, LEAVES[1:])]  # not onto 𝟏, 0 or I
    sizes = {i: _as_number(dim(tree.args[i].shape[0]) * dim(tree.args[i].shape[1])) for i in operands}
    sizes[-1] = _as_number(dim(tree.shape[0]) * dim(tree.shape[1]))
    target = min(sizes, key=lambda i: (sizes[i], i == -1))  # an operand (the first) on ties
    if target == -1:
        return MatMul(coeff, *tree.args)
    return MatMul(*(MatMul(coeff, a) if i == target else a for i, a in enumerate(tree.args)))
