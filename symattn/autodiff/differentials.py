"""Forward differentials: dY in terms of the differentials of Y's arguments, one rule per node type.

These rules (``JVP_RULES``) are written independently of the VJP rules of ``vjp``:
the derivation printer uses them for the line tr(Ḡᵀ dY) = tr(Ḡᵀ (product rule …)),
and the step verifier uses them to evaluate every dY at random differentials, so a
wrong VJP rule shows up as a step whose two sides disagree. The function nodes' rules
both read the node's record (f′(A) for an entrywise f; the row-wise VJP and JVP, each
written out); every record's f′ is checked against SymPy's derivative of its scalar
function (tests/unit/test_function_records.py).
``Differential(A)`` is the node dA; ``differential(expr, tangents)`` expands d(expr)
all the way down to the differentials of the symbols in ``tangents``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol, sympify
from sympy.matrices.expressions import (
    BlockMatrix,
    HadamardPower,
    HadamardProduct,
    MatAdd,
    MatMul,
    MatPow,
    MatrixSlice,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.autodiff.vjp import rule_key, supported
from symattn.errors import UnsupportedNodeError
from symattn.lang.algebra import hadamard_product, total, transpose
from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import children, postorder
from symattn.lang.ops import (
    LayerNorm,
    MergeHeads,
    RepeatHeads,
    RowInvStd,
    RowSum,
    SplitHeads,
    SumEntries,
    SumGroups,
)
from symattn.lang.positions import Entries, Scatter


class Differential(MatrixExpr):
    """dA: the differential of the matrix expression A (same shape)."""

    def __new__(cls, arg: MatrixExpr) -> Differential:
        return Basic.__new__(cls, sympify(arg))

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return self.arg.shape


class ScalarDifferential(sp.Expr):
    """dτ: the differential of a scalar expression τ (a trainable scalar)."""

    is_commutative = True

    def __new__(cls, arg: Basic) -> ScalarDifferential:
        return Basic.__new__(cls, sympify(arg))

    @property
    def arg(self) -> Basic:
        return self.args[0]


def differential_of(a: Basic) -> Basic:
    """dA for a matrix expression, dτ for a scalar one."""
    return Differential(a) if isinstance(a, MatrixExpr) else ScalarDifferential(a)


Tangent = Callable[[Basic], Basic | None]  # an argument's differential, None where it is constant
JvpRule = Callable[[Basic, Tangent], Basic | None]

JVP_RULES: dict[type, JvpRule] = {}


def defjvp(*node_types: type) -> Callable[[JvpRule], JvpRule]:
    """Register a forward-differential rule for the given node types."""

    def register(rule: JvpRule) -> JvpRule:
        for t in node_types:
            JVP_RULES[t] = rule
        return rule

    return register


def _total(terms: list[Basic]) -> Basic | None:
    """The sum of the terms (None for none), canonical at the top only: a deep doit re-walks shared operands."""
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else total(*terms)


@defjvp(MatMul)
def product_jvp(node: MatMul, d: Tangent) -> Basic | None:
    """d(c A B) = dc A B + c dA B + c A dB (product rule; dc ≠ 0 for a trainable scalar c = τ)."""
    scalars = [a for a in node.args if not isinstance(a, MatrixExpr)]
    mats = [a for a in node.args if isinstance(a, MatrixExpr)]
    coeff = sp.Mul(*scalars)
    dc = d(coeff) if coeff.free_symbols else None
    terms = [] if dc is None else [MatMul(dc, *mats)]
    for i, m in enumerate(mats):
        dm = d(m)
        if dm is not None:
            terms.append(
                MatMul(coeff, *mats[:i], dm, *mats[i + 1 :]) if coeff != 1 else MatMul(*mats[:i], dm, *mats[i + 1 :])
            )
    return _total(terms)


@defjvp(BlockMatrix)
def block_jvp(node: BlockMatrix, d: Tangent) -> Basic | None:
    """d[A | B] = [dA | dB]: placing blocks side by side is linear (a constant block moves by 0)."""
    rows = node.blocks.tolist()
    moved = [[d(b) for b in row] for row in rows]
    if all(db is None for row in moved for db in row):
        return None
    return BlockMatrix(
        [[ZeroMatrix(*b.shape) if db is None else db for b, db in zip(row, drow)] for row, drow in zip(rows, moved)]
    )


@defjvp(MatrixSlice)
def slice_jvp(node: MatrixSlice, d: Tangent) -> Basic | None:
    """d(A[r, c]) = dA[r, c]: taking a block is linear."""
    da = d(node.parent)
    return None if da is None else MatrixSlice(da, *node.args[1:])


@defjvp(MatAdd)
def sum_jvp(node: MatAdd, d: Tangent) -> Basic | None:
    """d(A + B) = dA + dB."""
    return _total([t for t in map(d, node.args) if t is not None])


@defjvp(Transpose)
def transpose_jvp(node: Transpose, d: Tangent) -> Basic | None:
    """d(Aᵀ) = (dA)ᵀ, pushed through dA's products and sums once per distinct node (never SymPy's re-walking .T)."""
    da = d(node.arg)
    return None if da is None else transpose(da)


@defjvp(HadamardProduct)
def hadamard_jvp(node: HadamardProduct, d: Tangent) -> Basic | None:
    """d(A ⊙ B) = dA ⊙ B + A ⊙ dB."""
    args = node.args
    terms = []
    for i, a in enumerate(args):
        da = d(a)
        if da is not None:
            terms.append(hadamard_product(*args[:i], da, *args[i + 1 :]))
    return _total(terms)


@defjvp(HadamardPower)
def hadamard_power_jvp(node: HadamardPower, d: Tangent) -> Basic | None:
    """d(A^{∘p}) = p A^{∘(p−1)} ⊙ dA."""
    base, p = node.args
    da = d(base)
    if da is None:
        return None
    if p == 1:
        return da
    power = base if p == 2 else HadamardPower(base, p - 1)
    return MatMul(p, hadamard_product(power, da)).doit(deep=False)


@defjvp(MatPow)
def power_jvp(node: MatPow, d: Tangent) -> Basic | None:
    """A^k = A·…·A, differentiated by the product rule (k a positive integer)."""
    base, k = node.args
    if not (k.is_Integer and k > 0):
        raise UnsupportedNodeError(node, "differentials (only positive integer powers)", ["MatPow with k > 0"])
    return product_jvp(MatMul(*([base] * int(k))), d)


@defjvp(FunctionRecord)
def function_jvp(node: FunctionRecord, d: Tangent) -> Basic | None:
    """dY from dA by the node's record (entrywise: f′(A) ⊙ dA; softmax: P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ))."""
    da = d(node.arg)
    return None if da is None else node.jvp(da)


@defjvp(RowSum)
def row_sum_jvp(node: RowSum, d: Tangent) -> Basic | None:
    """d(A 𝟏) = dA 𝟏."""
    da = d(node.arg)
    return None if da is None else RowSum(da)


@defjvp(Entries)
def entries_jvp(node: Entries, d: Tangent) -> Basic | None:
    """d[f(i, j)] = Σ_τ dτ [∂f/∂τ] + [Σ_reads ∂f/∂b[r, c] · db[r, c]] over the formula's trainable scalars and the
    entries of the tables it reads (the tangent db read at the same positions; none moving: a constant)."""
    terms = [MatMul(ds, node.derivative(s)) for s in node.scalars if (ds := d(s)) is not None]
    moving = {t: dt for t in node.tables if (dt := d(t)) is not None}
    reads = [
        node.derivative(r).formula * MatrixElement(moving[r.parent], *r.indices)
        for r in node.reads
        if r.parent in moving
    ]
    if reads:
        terms.append(Entries(node.rows, node.cols, sp.Lambda(node.lamda.variables, sp.Add(*reads))))
    return _total(terms)


@defjvp(Scatter)
def scatter_jvp(node: Scatter, d: Tangent) -> Basic | None:
    """d scatter(W) = scatter(dW): a scatter is linear."""
    dw = d(node.weights)
    return None if dw is None else node.func(dw, *node.args[1:])


@defjvp(SumEntries)
def sum_entries_jvp(node: SumEntries, d: Tangent) -> Basic | None:
    """d(𝟏ᵀ A 𝟏) = 𝟏ᵀ dA 𝟏."""
    da = d(node.arg)
    return None if da is None else SumEntries(da)


@defjvp(Trace)
def trace_jvp(node: Trace, d: Tangent) -> Basic | None:
    """d tr(A) = tr(dA)."""
    da = d(node.arg)
    return None if da is None else Trace(da)


@defjvp(SplitHeads)
def split_heads_jvp(node: SplitHeads, d: Tangent) -> Basic | None:
    """d(A_h) = (dA)_h: taking column blocks is linear."""
    da = d(node.arg)
    return None if da is None else SplitHeads(da, node.heads)


@defjvp(MergeHeads)
def merge_heads_jvp(node: MergeHeads, d: Tangent) -> Basic | None:
    """d Concat(A_1 … A_H) = Concat(dA_1 … dA_H)."""
    da = d(node.arg)
    return None if da is None else MergeHeads(da, node.heads)


@defjvp(RowInvStd)
def row_inv_std_jvp(node: RowInvStd, d: Tangent) -> Basic | None:
    """r = rstd(A) = (σ² + ε)^{−1/2}, k columns: dr = −½ r^{∘3} ⊙ dσ², dσ² = (2/k)(A − μ𝟏ᵀ ⊙ dA)𝟏 and
    (A − μ𝟏ᵀ) ⊙ r𝟏ᵀ = LN(A), so dr = −(1/k) r^{∘2} ⊙ ((LN(A) ⊙ dA) 𝟏)."""
    da = d(node.arg)
    if da is None:
        return None
    cols = node.arg.shape[1]
    spread = hadamard_product(LayerNorm(node.arg, node.eps), da)
    return MatMul(-1 / cols, hadamard_product(HadamardPower(node, 2), RowSum(spread)))


@defjvp(LayerNorm)
def layer_norm_jvp(node: LayerNorm, d: Tangent) -> Basic | None:
    """N = LN(A) = (A − A𝟏𝟏ᵀ/k) ⊙ r𝟏ᵀ with r = rstd(A), k columns:
    dN = r𝟏ᵀ ⊙ (dA − dA 𝟏𝟏ᵀ/k − N ⊙ ((N ⊙ dA) 𝟏𝟏ᵀ)/k)."""
    da = d(node.arg)
    if da is None:
        return None
    cols = node.shape[1]
    square = OneMatrix(cols, cols)
    spread = MatMul(RowInvStd(node.arg, node.eps), OneMatrix(1, cols))
    inner = _total(
        [
            da,
            MatMul(-1 / cols, da, square),
            MatMul(-1 / cols, hadamard_product(node, MatMul(hadamard_product(node, da), square))),
        ]
    )
    return hadamard_product(spread, inner)


def _rule(node: Basic) -> JvpRule:
    rule = JVP_RULES.get(rule_key(node))
    if rule is None:
        raise UnsupportedNodeError(node, "differentials", supported(JVP_RULES))
    return rule


def local_differential(node: Basic, varying: set[Basic]) -> Basic | None:
    """dY for the node Y, written with Differential(a) (dτ for a scalar) for each of its arguments a in varying."""
    return _rule(node)(node, lambda a: differential_of(a) if a in varying else _scalar_part(a, varying))


def _scalar_part(a: Basic, varying: set[Basic]) -> Basic | None:
    """d of a product's coefficient c = 2τ: the coefficient is no node, its varying factors are."""
    if isinstance(a, sp.Mul) and any(f in varying for f in a.args):
        return _rule(a)(a, lambda f: differential_of(f) if f in varying else None)
    return None


# Scalar nodes (trainable scalars and functions of them).


@defjvp(sp.Add, sp.Mul, sp.Pow, sp.exp, sp.log, sp.tanh)
def scalar_jvp(node: Basic, d: Tangent) -> Basic | None:
    """d f(a₁, …, a_k) = Σ_i ∂f/∂a_i da_i for a scalar node (τ², e^τ, 2τ, …)."""
    terms = []
    for i, a in enumerate(node.args):
        da = d(a) if a.free_symbols else None
        if da is not None:
            x = sp.Dummy("x")
            partial = sp.diff(node.func(*node.args[:i], x, *node.args[i + 1 :]), x).subs(x, a)
            terms.append(partial * da)
    return sp.Add(*terms) if terms else None


def differential(expr: Basic, tangents: Mapping[MatrixSymbol, Basic]) -> Basic | None:
    """d(expr) when each symbol s in tangents moves by tangents[s] (None: expr is constant).

    Which nodes move is found in one walk of the DAG (each node once, its arguments first), so the cost is
    linear in the expression; a node a rule builds that the walk did not meet is asked with ``has``."""
    expr = sympify(expr)
    memo: dict[Basic, Basic | None] = {}
    walked: set[Basic] = set()
    moving: set[Basic] = set(tangents)
    for node in postorder(expr):
        walked.add(node)
        if node not in moving and any(a in moving for a in children(node)):
            moving.add(node)

    def d(e: Basic) -> Basic | None:
        if e in memo:
            return memo[e]
        if e in tangents:
            out = tangents[e]
        elif isinstance(e, MatrixSymbol) or (e not in moving if e in walked else not e.has(*tangents)):
            out = None
        else:
            out = _rule(e)(e, d)
        memo[e] = out
        return out

    return d(expr)


# Grouped-query heads: H_kv key/value heads shared by H query heads.


@defjvp(RepeatHeads)
def repeat_heads_jvp(node: RepeatHeads, d: Tangent) -> Basic | None:
    """d Rep(A) = Rep(dA): repeating blocks is linear."""
    da = d(node.arg)
    return None if da is None else RepeatHeads(da, node.kv_heads, node.heads)


@defjvp(SumGroups)
def sum_groups_jvp(node: SumGroups, d: Tangent) -> Basic | None:
    """d GroupSum(A) = GroupSum(dA): summing blocks is linear."""
    da = d(node.arg)
    return None if da is None else SumGroups(da, node.kv_heads, node.heads)
