"""Fuzz: gradients of random well-shaped expression trees against torch autograd.

Trees of depth ≥ 4 are drawn over the whole op set — products (scalar multiples,
a symbolic 1/√n, traces as per-batch scalars), sums and differences, transposes,
Hadamard products and powers (X ⊙ X becomes HadamardPower), exp, log of positive
things, tanh, sigmoid, row softmax, row sums broadcast back by 𝟏ᵀ, split/merge of
heads around per-head attention, matrix powers — with leaves and whole subtrees
reused, so the expression is a DAG. Each tree is evaluated by an independent torch
evaluator (one torch op per node type, below) and differentiated by autograd;
symattn's closed forms, evaluated by lambdify, must agree for every leaf.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import reduce
from operator import add, mul

import numpy as np
import pytest
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import (
    HadamardPower,
    HadamardProduct,
    Identity,
    MatAdd,
    MatMul,
    MatPow,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
    hadamard_product,
)

import symattn as sa
from symattn.lang.ops import Exp, Log, MergeHeads, RowSoftmax, RowSum, Sigmoid, SplitHeads, SumEntries, Tanh
from symattn.specs import dim

torch = pytest.importorskip("torch", reason="torch autograd is the fuzz's reference")

TREES = 300
TOLERANCE = 1e-8
HEADS = 2
N, M, P = dim("n"), dim("m"), dim("p")
DIMS = (N, M, HEADS * P)  # columns 2p split into two heads of p
DIM_NAMES = {N: "n", M: "m", HEADS * P: "q"}
LEAVES_PER_SHAPE = 2


# The independent torch evaluator: node type → torch op. `ev` evaluates a child node.


def torch_product(node: MatMul, ev: Callable, env: dict):
    mats = [ev(a) for a in node.args if isinstance(a, MatrixExpr)]
    value = reduce(torch.matmul, mats)
    for s in (a for a in node.args if not isinstance(a, MatrixExpr)):
        scalar = ev(s)
        value = (scalar[..., None, None] if torch.is_tensor(scalar) else scalar) * value
    return value


def torch_split(node: SplitHeads, ev: Callable, env: dict):
    """(…, r, H·k) → (…, H, r, k): head h is column block h."""
    return torch.stack(ev(node.arg).chunk(int(node.heads), dim=-1), dim=-3)


TORCH_OPS: dict[type, Callable] = {
    MatrixSymbol: lambda node, ev, env: env["leaves"][node],
    MatMul: torch_product,
    MatAdd: lambda node, ev, env: reduce(add, (ev(a) for a in node.args)),
    Transpose: lambda node, ev, env: ev(node.arg).transpose(-2, -1),
    HadamardProduct: lambda node, ev, env: reduce(mul, (ev(a) for a in node.args)),
    HadamardPower: lambda node, ev, env: ev(node.args[0]) ** int(node.args[1]),
    MatPow: lambda node, ev, env: torch.linalg.matrix_power(ev(node.args[0]), int(node.args[1])),
    Exp: lambda node, ev, env: torch.exp(ev(node.arg)),
    Log: lambda node, ev, env: torch.log(ev(node.arg)),
    Tanh: lambda node, ev, env: torch.tanh(ev(node.arg)),
    Sigmoid: lambda node, ev, env: torch.sigmoid(ev(node.arg)),
    RowSoftmax: lambda node, ev, env: torch.softmax(ev(node.arg), dim=-1),
    RowSum: lambda node, ev, env: ev(node.arg).sum(dim=-1, keepdim=True),
    SumEntries: lambda node, ev, env: ev(node.arg).sum(dim=(-2, -1)),
    Trace: lambda node, ev, env: torch.diagonal(ev(node.arg), dim1=-2, dim2=-1).sum(dim=-1),
    SplitHeads: torch_split,
    MergeHeads: lambda node, ev, env: torch.cat(ev(node.arg).unbind(dim=-3), dim=-1),
    OneMatrix: lambda node, ev, env: torch.ones(env["shape"](node), dtype=torch.float64),
    Identity: lambda node, ev, env: torch.eye(env["shape"](node)[0], dtype=torch.float64),
    ZeroMatrix: lambda node, ev, env: torch.zeros(env["shape"](node), dtype=torch.float64),
    sp.Mul: lambda node, ev, env: reduce(mul, (ev(a) for a in node.args)),
    sp.Add: lambda node, ev, env: reduce(add, (ev(a) for a in node.args)),
    sp.Pow: lambda node, ev, env: ev(node.args[0]) ** float(node.args[1]),
}


def torch_evaluate(expr: Basic, leaves: dict, sizes: dict):
    """expr's value, each shared subexpression evaluated once."""
    memo: dict[Basic, object] = {}
    env = {"leaves": leaves, "shape": lambda node: tuple(int(sp.sympify(d).xreplace(sizes)) for d in node.shape)}

    def ev(node: Basic):
        if node not in memo:
            if node.is_Number or isinstance(node, sp.Symbol):
                memo[node] = float(node.xreplace(sizes))
            else:
                memo[node] = TORCH_OPS[type(node)](node, ev, env)
        return memo[node]

    return ev(expr)


# Random well-shaped trees.


class TreeMaker:
    """Draws expressions of a requested shape; subtrees made so far may be reused."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.made: dict[tuple, list[Basic]] = {}

    def leaf(self, shape: tuple) -> MatrixSymbol:
        r, c = shape
        return MatrixSymbol(f"L{self.rnd.randrange(LEAVES_PER_SHAPE)}_{DIM_NAMES[r]}{DIM_NAMES[c]}", r, c)

    def make(self, shape: tuple, depth: int) -> Basic:
        rnd = self.rnd
        if depth <= 0 or rnd.random() < 0.08:
            return self.leaf(shape)
        if self.made.get(shape) and rnd.random() < 0.15:
            return rnd.choice(self.made[shape])
        r, c = shape
        productions = [self.product, self.sum, self.transpose, self.hadamard, self.square]
        productions += [self.elementwise, self.logarithm, self.softmax, self.row_sum, self.trace_scaled]
        if c == HEADS * P:
            productions += [self.heads, self.heads]
        if r == c:
            productions.append(self.power)
        expr = rnd.choice(productions)(shape, depth - 1)
        self.made.setdefault(shape, []).append(expr)
        return expr

    def product(self, shape, depth):
        k = self.rnd.choice(DIMS)
        scale = self.rnd.choice([1, 1, sp.Rational(1, 2), -1, 1 / sp.sqrt(N), 1 / sp.sqrt(P)])
        return scale * self.make((shape[0], k), depth) * self.make((k, shape[1]), depth)

    def sum(self, shape, depth):
        a, b = self.make(shape, depth), self.make(shape, depth)
        return a - b if self.rnd.random() < 0.5 else a + b

    def transpose(self, shape, depth):
        return self.make(shape[::-1], depth).T

    def hadamard(self, shape, depth):
        return sa.hadamard(self.make(shape, depth), self.make(shape, depth))

    def square(self, shape, depth):
        a = self.make(shape, depth)
        return hadamard_product(a, a)  # SymPy turns X ⊙ X into HadamardPower(X, 2)

    def elementwise(self, shape, depth):
        return self.rnd.choice([sa.exp, sa.tanh, sa.sigmoid])(self.make(shape, depth))

    def logarithm(self, shape, depth):
        positive = self.rnd.choice([sa.exp, sa.sigmoid, sa.softmax])(self.make(shape, depth))
        return sa.log(positive)

    def softmax(self, shape, depth):
        return sa.softmax(self.make(shape, depth))

    def row_sum(self, shape, depth):
        k = self.rnd.choice(DIMS)
        return sa.rowsum(self.make((shape[0], k), depth)) * OneMatrix(1, shape[1])

    def trace_scaled(self, shape, depth):
        k = self.rnd.choice(DIMS)
        scalar = self.rnd.choice([sp.Trace, sa.sum])(self.make((k, k), depth))
        return scalar * self.make(shape, depth)

    def power(self, shape, depth):
        return sp.MatPow(self.make(shape, depth), self.rnd.choice([2, 3]))

    def heads(self, shape, depth):
        """MergeHeads of a per-head expression built from split heads."""
        if self.rnd.random() < 0.5:
            inner = sa.split_heads(self.make(shape, depth), HEADS)
            per_head = self.rnd.choice([sa.tanh, sa.softmax, sa.sigmoid])(inner)
        else:
            k = self.rnd.choice(DIMS)
            q, kk, v = (sa.split_heads(self.make(s, depth), HEADS) for s in [shape, (k, shape[1]), (k, shape[1])])
            per_head = sa.softmax(q * kk.T / sp.sqrt(P)) * v
        return sa.merge_heads(per_head, HEADS)

    def root(self, depth: int) -> Basic:
        shape = (self.rnd.choice(DIMS), self.rnd.choice(DIMS))
        kind = self.rnd.random()
        if kind < 0.2:
            return sp.Trace(self.make((shape[0], shape[0]), depth))
        if kind < 0.35:
            return sa.sum(self.make(shape, depth))
        return self.make(shape, depth)


def depth_of(expr: Basic) -> int:
    memo: dict[Basic, int] = {}

    def depth(node: Basic) -> int:
        if node not in memo:
            inner = [a for a in node.args if isinstance(a, (MatrixExpr, SumEntries, sp.Trace))]
            inner += [a for a in node.args if isinstance(a, sp.Expr) and a.has(MatrixSymbol)]
            memo[node] = 0 if isinstance(node, MatrixSymbol) or not inner else 1 + max(map(depth, inner))
        return memo[node]

    return depth(expr)


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """‖ours − reference‖ / ‖reference‖, the norm floored at 1e-4: some gradients are exactly 0
    (the row sums of a softmax are constant), where float noise has no scale to be relative to."""
    return float(np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-4))


def fuzz_one(rnd: random.Random) -> tuple[Basic, float] | None:
    """A random tree and its worst relative gradient error (None: tree redrawn, too shallow or ill-scaled)."""
    maker = TreeMaker(rnd)
    expr = maker.root(depth=rnd.choice([4, 5]))
    leaves = sorted(expr.atoms(MatrixSymbol), key=lambda s: s.name)
    if depth_of(expr) < 4 or not leaves:  # e.g. A − A collapsed to a zero matrix
        return None
    sizes = {N: rnd.randint(1, 3), M: rnd.randint(1, 3), P: rnd.randint(1, 2)}
    batch = rnd.choice([(), (2,)])
    np_rng = np.random.default_rng(rnd.randrange(2**32))
    shape = {s: tuple(int(sp.sympify(d).xreplace(sizes)) for d in s.shape) for s in leaves}
    values = {s: 0.5 * np_rng.standard_normal(batch + shape[s]) for s in leaves}
    tensors = {s: torch.tensor(v, requires_grad=True) for s, v in values.items()}
    out = torch_evaluate(expr, tensors, sizes)
    if not torch.isfinite(out).all() or out.abs().max() > 1e6:
        return None
    scalar_root = not isinstance(expr, MatrixExpr)
    g = np.ones(tuple(out.shape)) if scalar_root else np_rng.standard_normal(tuple(out.shape))
    grads = dict(zip(tensors, torch.autograd.grad((out * torch.tensor(g)).sum(), list(tensors.values()))))

    closed = sa.grad(expr, leaves)
    args = leaves if scalar_root else [*leaves, sp.MatrixSymbol("G", *expr.shape)]
    arrays = [values[s] for s in leaves] + ([] if scalar_root else [g])
    dims = {"n": sizes[N], "m": sizes[M], "p": sizes[P]}
    worst = 0.0
    for s in leaves:
        ours = np.broadcast_to(sa.lambdify(args, closed[s], dims=dims)(*arrays), values[s].shape)
        error = relative_error(ours, grads[s].numpy())
        assert np.isfinite(error), (expr, sizes, batch, s)  # max() would drop a NaN
        worst = max(worst, error)
    assert worst < TOLERANCE, (expr, sizes, batch, worst)
    return expr, worst


@pytest.mark.slow  # 300 random trees
def test_random_trees_match_torch_autograd():
    rnd = random.Random(20261122)
    errors: list[float] = []
    node_types: set[type] = set()
    rejected = 0
    while len(errors) < TREES:
        result = fuzz_one(rnd)
        if result is None:
            rejected += 1
            continue
        expr, error = result
        errors.append(error)
        node_types |= {type(node) for node in sp.preorder_traversal(expr)}
    print(f"\nfuzz: {len(errors)} trees (depth ≥ 4; {rejected} redrawn), worst relative error {max(errors):.3e}")
    assert rejected < TREES  # the generator mostly draws usable trees
    assert FUZZED_OPS <= node_types, FUZZED_OPS - node_types


# The op set of the language the fuzz must exercise (each has a VJP rule and a torch op).
FUZZED_OPS = {
    MatMul, MatAdd, Transpose, HadamardProduct, HadamardPower, MatPow, Exp, Log, Tanh, Sigmoid,
    RowSoftmax, RowSum, SumEntries, Trace, SplitHeads, MergeHeads, OneMatrix,
}  # fmt: skip


def test_every_fuzzed_op_has_a_rule_and_a_torch_op():
    from symattn.autodiff.vjp import VJP_RULES
    from symattn.lang.functions import FunctionRecord

    differentiable = FUZZED_OPS - {OneMatrix}
    by_record = {t for t in differentiable if issubclass(t, FunctionRecord)}  # their kind's rule asks the record
    assert differentiable - by_record <= set(VJP_RULES)
    assert all(any(k in VJP_RULES for k in t.__mro__) for t in by_record)
    assert FUZZED_OPS <= set(TORCH_OPS)
