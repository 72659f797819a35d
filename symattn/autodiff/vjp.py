"""Vector-Jacobian products: one rule per node type, keyed by type in ``VJP_RULES``.

A rule receives a node Y and the cotangent G = ∂f/∂Y of a scalar f, and returns, for
each argument X of Y that it differentiates, the cotangent ∂f/∂X read off from
df = tr(Gᵀ dY) (for a scalar node Y with cotangent c: df = c dY). Each rule's
docstring states the trace identity it implements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import sympy as sp
from sympy import Basic, MatrixExpr
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
)

from symattn.lang.algebra import hadamard_product, product, total, transpose
from symattn.lang.functions import FUNCTIONS, FunctionRecord
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
from symattn.lang.positions import Entries, Scatter, scatter

Cotangents = list[tuple[Basic, Basic]]
VjpRule = Callable[[Basic, Basic], Cotangents]

VJP_RULES: dict[type, VjpRule] = {}


def supported(rules: dict) -> list[str]:
    """The names of the nodes the rules differentiate: the function records' rule stands for every record."""
    records = [r.__name__ for r in FUNCTIONS.values()] if FunctionRecord in rules else []
    return [t.__name__ for t in rules if t is not FunctionRecord] + records


def rule_key(node: Basic) -> type:
    """The key of node's rule: FunctionRecord for a function node (its record states its VJP and JVP), else its
    own type (a subclass of a SymPy node is not that node: Inverse is no MatPow here)."""
    return FunctionRecord if isinstance(node, FunctionRecord) else type(node)


def vjp_rule(node: Basic) -> VjpRule | None:
    """The rule for node (``rule_key``), or None if there is none."""
    return VJP_RULES.get(rule_key(node))


def defvjp(*node_types: type) -> Callable[[VjpRule], VjpRule]:
    """Register a rule for the given node types."""

    def register(rule: VjpRule) -> VjpRule:
        for t in node_types:
            VJP_RULES[t] = rule
        return rule

    return register


def merge_cotangents(outputs: Iterable[tuple[Basic, Basic]]) -> tuple[tuple[Basic, Basic], ...]:
    """One cotangent per argument: an argument that occurs several times (A ⊙ A, A·A, A^k) gets the sum.

    The terms are parts of one Ā; a step that listed them apart would name each the whole Ā.
    """
    parts: dict[Basic, list[Basic]] = {}
    for a, c in outputs:
        parts.setdefault(a, []).append(c)
    return tuple((a, added(cs)) for a, cs in parts.items())


def added(cotangents: list[Basic]) -> Basic:
    """The sum of the cotangents one node received: matrices by ``total``, a trainable scalar's by sp.Add."""
    if len(cotangents) == 1:
        return cotangents[0]
    return total(*cotangents) if isinstance(cotangents[0], MatrixExpr) else sp.Add(*cotangents)


def ones_like(a: MatrixExpr) -> OneMatrix:
    return OneMatrix(*a.shape)


# Linear nodes.


@defvjp(MatAdd)
def sum_vjp(node: MatAdd, g: Basic) -> Cotangents:
    """tr(Gᵀ d(A + B)) = tr(Gᵀ dA) + tr(Gᵀ dB): every term receives G."""
    return [(term, g) for term in node.args]


@defvjp(Transpose)
def transpose_vjp(node: Transpose, g: Basic) -> Cotangents:
    """tr(Gᵀ dAᵀ) = tr(dA G) = tr((Gᵀ)ᵀ dA): A receives Gᵀ."""
    return [(node.arg, transpose(g))]


@defvjp(MatMul)
def product_vjp(node: MatMul, g: Basic) -> Cotangents:
    """tr(Gᵀ d(c A B)) = tr((c G Bᵀ)ᵀ dA) + tr((c Aᵀ G)ᵀ dB) + dc tr(Gᵀ A B).

    For k matrix factors, factor i receives c (F₁…F_{i−1})ᵀ G (F_{i+1}…F_k)ᵀ; a scalar
    factor s receives tr(Gᵀ Y) / s (the product without s).
    """
    scalars = [a for a in node.args if not isinstance(a, MatrixExpr)]
    mats = [a for a in node.args if isinstance(a, MatrixExpr)]
    coeff = sp.Mul(*scalars)
    out: Cotangents = []
    for i, factor in enumerate(mats):
        left = [transpose(f) for f in reversed(mats[:i])]
        right = [transpose(f) for f in reversed(mats[i + 1 :])]
        out.append((factor, product(coeff, *left, g, *right)))
    for i, s in enumerate(scalars):
        rest = sp.Mul(*(scalars[:i] + scalars[i + 1 :]))
        out.append((s, Trace(product(rest, transpose(g), *mats))))
    return out


@defvjp(MatPow)
def power_vjp(node: MatPow, g: Basic) -> Cotangents:
    """A^k = A·A·…·A: tr(Gᵀ dA^k) = Σ_i tr(((A^i)ᵀ G (A^{k−1−i})ᵀ)ᵀ dA), k a positive integer."""
    base, k = node.args
    if not (k.is_Integer and k > 0):
        from symattn.errors import UnsupportedNodeError

        raise UnsupportedNodeError(node, "differentiation (only positive integer powers)", ["MatPow with k > 0"])
    return product_vjp(MatMul(*([base] * int(k))), g)


# Entrywise and row-wise nodes.


@defvjp(FunctionRecord)
def function_vjp(node: FunctionRecord, g: Basic) -> Cotangents:
    """tr(Gᵀ dY) = tr(Āᵀ dA), Ā from the node's record (entrywise: G ⊙ f′(A); softmax: P ⊙ (G − rowsum(G ⊙ P) 𝟏ᵀ))."""
    return [(node.arg, node.vjp(g))]


@defvjp(HadamardProduct)
def hadamard_vjp(node: HadamardProduct, g: Basic) -> Cotangents:
    """tr(Gᵀ d(A ⊙ B)) = tr((G ⊙ B)ᵀ dA) + tr((G ⊙ A)ᵀ dB)."""
    args = node.args
    return [(a, hadamard_product(g, *(args[:i] + args[i + 1 :]))) for i, a in enumerate(args)]


@defvjp(HadamardPower)
def hadamard_power_vjp(node: HadamardPower, g: Basic) -> Cotangents:
    """tr(Gᵀ d(A^{∘p})) = tr((p G ⊙ A^{∘(p−1)})ᵀ dA)."""
    base, p = node.args
    if p == 1:
        return [(base, g)]
    if p == 2:
        return [(base, product(2, hadamard_product(g, base)))]
    return [(base, product(p, hadamard_product(g, HadamardPower(base, p - 1))))]


@defvjp(RowSum)
def row_sum_vjp(node: RowSum, g: Basic) -> Cotangents:
    """tr(Gᵀ d(A 𝟏)) = tr((G 𝟏ᵀ)ᵀ dA): the n × 1 cotangent broadcast along each row."""
    return [(node.arg, product(g, OneMatrix(1, node.arg.shape[1])))]


# Head blocks.


@defvjp(SplitHeads)
def split_heads_vjp(node: SplitHeads, g: Basic) -> Cotangents:
    """Σ_h tr(G_hᵀ dA_h) = tr(Concat(G_1 … G_H)ᵀ dA): the blocks' cotangents side by side."""
    return [(node.arg, MergeHeads(g, node.heads))]


@defvjp(MergeHeads)
def merge_heads_vjp(node: MergeHeads, g: Basic) -> Cotangents:
    """tr(Gᵀ d Concat(A_1 … A_H)) = Σ_h tr(G_hᵀ dA_h): head h receives block h of G."""
    return [(node.arg, SplitHeads(g, node.heads))]


# Scalar-valued nodes (cotangent c is a scalar).


@defvjp(Trace)
def trace_vjp(node: Trace, c: Basic) -> Cotangents:
    """d tr(A) = tr(Iᵀ dA): A receives c I."""
    return [(node.arg, product(c, Identity(node.arg.shape[0])))]


@defvjp(SumEntries)
def sum_entries_vjp(node: SumEntries, c: Basic) -> Cotangents:
    """d sum(A) = tr((𝟏𝟏ᵀ)ᵀ dA): A receives c 𝟏𝟏ᵀ."""
    return [(node.arg, product(c, ones_like(node.arg)))]


@defvjp(sp.Add)
def scalar_sum_vjp(node: sp.Add, c: Basic) -> Cotangents:
    """d(a + b) = da + db."""
    return [(term, c) for term in node.args]


@defvjp(sp.Mul)
def scalar_product_vjp(node: sp.Mul, c: Basic) -> Cotangents:
    """d(a b) = b da + a db."""
    args = node.args
    return [(a, c * sp.Mul(*(args[:i] + args[i + 1 :]))) for i, a in enumerate(args)]


@defvjp(sp.Pow)
def scalar_power_vjp(node: sp.Pow, c: Basic) -> Cotangents:
    """d(a^p) = p a^{p−1} da, for a constant exponent p."""
    base, p = node.args
    return [(base, c * p * base ** (p - 1))]


@defvjp(Entries)
def entries_vjp(node: Entries, g: Basic) -> Cotangents:
    """tr(Gᵀ d[f(i, j)]) = Σ_τ dτ tr(Gᵀ [∂f/∂τ]) + Σ_reads tr(scatter(G ⊙ [∂f/∂b[r, c]])ᵀ db): each trainable scalar
    of the formula receives tr(Gᵀ [∂f/∂τ]), each table b the scatter of G ⊙ [∂f/∂b[r, c]] over each read b[r, c]."""
    out: Cotangents = [(s, Trace(product(transpose(g), node.derivative(s)))) for s in node.scalars]
    for table in node.tables:
        reads = [
            (r, derivative) for r in node.reads if r.parent == table and (derivative := node.derivative(r)).formula
        ]
        terms = [scatter(_weighted(g, derivative), r) for r, derivative in reads]  # none: read only in conditions
        out.append((table, total(*terms) if terms else ZeroMatrix(*table.shape)))
    return out


def _weighted(g: Basic, derivative: Entries) -> Basic:
    """G ⊙ [∂f/∂x], G itself where ∂f/∂x = 1 (a table added to the scores)."""
    return g if derivative.formula == 1 else hadamard_product(g, derivative)


@defvjp(Scatter)
def scatter_vjp(node: Scatter, c: Basic) -> Cotangents:
    """tr(Cᵀ d scatter(W)) = tr(Cᵀ scatter(dW)) = tr([C[r, c]]ᵀ dW): W receives C read at the positions."""
    return [(node.weights, node.reading(c))]


@defvjp(sp.exp, sp.log, sp.tanh)
def scalar_function_vjp(node: Basic, c: Basic) -> Cotangents:
    """d f(a) = f'(a) da for a scalar function f (exp, log, tanh of a trainable scalar)."""
    (a,) = node.args
    x = sp.Dummy("x")
    return [(a, c * sp.diff(node.func(x), x).subs(x, a))]


def zero_like(a: Basic) -> Basic:
    """The additive zero of a's kind: a zero matrix of its shape, or 0."""
    return ZeroMatrix(*a.shape) if isinstance(a, MatrixExpr) else sp.Integer(0)


# Transformer-block nodes.


@defvjp(LayerNorm)
def layer_norm_vjp(node: LayerNorm, g: Basic) -> Cotangents:
    """N = LN(A), r = rstd(A), d columns: dN = r𝟏ᵀ ⊙ (dA − dA 𝟏𝟏ᵀ/d − N ⊙ ((N ⊙ dA) 𝟏𝟏ᵀ)/d), so
    tr(Gᵀ dN) = tr((r𝟏ᵀ ⊙ (G − rowsum(G) 𝟏ᵀ/d − N ⊙ rowsum(G ⊙ N) 𝟏ᵀ/d))ᵀ dA)."""
    cols = node.shape[1]
    ones_row = OneMatrix(1, cols)
    centred = total(
        g,
        product(-1 / cols, RowSum(g), ones_row),
        product(-1 / cols, hadamard_product(node, product(RowSum(hadamard_product(g, node)), ones_row))),
    )
    return [(node.arg, hadamard_product(product(RowInvStd(node.arg, node.eps), ones_row), centred))]


@defvjp(RowInvStd)
def row_inv_std_vjp(node: RowInvStd, g: Basic) -> Cotangents:
    """r = (σ² + ε)^{−1/2}, σ² = ‖A_i − μ_i‖²/k over k columns: dσ² = (2/k) rowsum((A − μ𝟏ᵀ) ⊙ dA) (the dμ
    term sums to 0) and (A − μ𝟏ᵀ) ⊙ r𝟏ᵀ = N = LN(A), so dr = −(1/k) r^{∘2} ⊙ rowsum(N ⊙ dA) and
    tr(gᵀ dr) = tr((−(1/k) (g ⊙ r^{∘2}) 𝟏ᵀ ⊙ N)ᵀ dA)."""
    cols = node.arg.shape[1]
    weight = product(-1 / cols, hadamard_product(g, HadamardPower(node, 2)), OneMatrix(1, cols))
    return [(node.arg, hadamard_product(weight, LayerNorm(node.arg, node.eps)))]


# Grouped-query heads: H_kv key/value heads shared by H query heads.


@defvjp(RepeatHeads)
def repeat_heads_vjp(node: RepeatHeads, g: Basic) -> Cotangents:
    """Σ_h tr(G_hᵀ dA_{⌊h/g⌋}) = Σ_j tr((Σ_{h in group j} G_h)ᵀ dA_j): each kv head sums its group's cotangents."""
    return [(node.arg, SumGroups(g, node.kv_heads, node.heads))]


@defvjp(SumGroups)
def sum_groups_vjp(node: SumGroups, g: Basic) -> Cotangents:
    """tr(Gᵀ d GroupSum(A)) = Σ_h tr(G_{⌊h/g⌋}ᵀ dA_h): every head of a group receives its group's cotangent."""
    return [(node.arg, RepeatHeads(g, node.kv_heads, node.heads))]
