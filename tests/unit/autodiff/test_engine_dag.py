"""The engine walks expressions as DAGs: deep and shared graphs stay linear, and correct.

Graphs are built with SymPy's raw constructors (MatAdd(...), MatMul(...)): SymPy's
operators (+, *) call a deep doit() that re-walks a shared operand as a tree, so
building a 30-level graph with them is itself exponential. The engine must visit each
distinct subexpression once, so the number of recorded steps is linear in the depth
even where the expression's tree is exponentially large.
"""

from __future__ import annotations

import numpy as np
import pytest
from sympy import Basic, MatAdd, MatMul, MatrixSymbol, Trace, Transpose

import symattn as sa
from symattn.numeric.verify import vjp_error
from symattn.specs import dim

n, d = dim("n"), dim("d")
X = MatrixSymbol("X", n, d)
W = MatrixSymbol("W", d, d)
DEPTH = 30


def residual_tanh_chain(depth: int):
    """Y₀ = X, Y_{k+1} = tanh(Y_k W) + Y_k: Y_k is used twice per level."""
    y = X
    for _ in range(depth):
        y = MatAdd(sa.tanh(MatMul(y, W)), y)
    return y


def gated_chain(depth: int):
    """Z₀ = X, Z_{k+1} = (σ(Z_k) ⊙ Z_k) W: a doubly used chain whose tree has 2^depth leaves."""
    z = X
    for _ in range(depth):
        z = MatMul(sa.hadamard(sa.sigmoid(z), z), W)
    return z


def tree_size(expr: Basic) -> int:
    """Number of nodes of expr unfolded as a tree (counted on the DAG, without unfolding it)."""
    sizes: dict[Basic, int] = {}
    stack: list[tuple[Basic, bool]] = [(expr, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            sizes[node] = 1 + sum(sizes[a] for a in node.args)
        elif node not in sizes:
            stack.append((node, True))
            stack.extend((a, False) for a in node.args if a not in sizes)
    return sizes[expr]


def gram_trace(expr: Basic) -> Basic:
    """tr(Eᵀ E), built raw (SymPy's E.T would push the transpose through E with a deep doit)."""
    return Trace(MatMul(Transpose(expr), expr))


# (graph, scalar root, steps besides the root's: 3 per level — (+, tanh, product) or (product, ⊙, σ) —
# and for tr(Eᵀ E) its product and transpose)
CHAINS = [(residual_tanh_chain, sa.sum, 3 * DEPTH), (gated_chain, gram_trace, 3 * DEPTH + 2)]


@pytest.mark.parametrize(("build", "root", "expected_steps"), CHAINS, ids=["residual tanh", "gated"])
def test_a_deep_shared_graph_takes_steps_linear_in_its_depth(build, root, expected_steps):
    expr = build(DEPTH)
    assert tree_size(expr) > 2**DEPTH  # as a tree the expression is exponentially large
    tape = sa.backward(root(expr), [X, W])
    assert len(tape.steps) == expected_steps + 1  # one step per distinct node, the root included
    assert len({s.node for s in tape.steps}) == len(tape.steps)  # no node visited twice
    assert set(tape.gradients) == {X, W}


@pytest.mark.parametrize("build", [residual_tanh_chain, gated_chain])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_a_shared_graph_differentiates_correctly(build, batch):
    expr = build(4)
    grads = sa.grad(expr, [X, W])
    rng = np.random.default_rng(17)
    dims = {n: 3, d: 2}
    for symbol in (X, W):
        assert vjp_error(expr, symbol, grads[symbol], dims, rng, batch=batch) < 1e-7
