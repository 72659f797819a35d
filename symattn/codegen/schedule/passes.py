"""Passes over a schedule's assignments that make the generated code cheaper and clearer.

Each pass takes assignments and returns equal ones: a scalar multiple folded into
its only user, the three projections of self-attention fused into one product,
row sums named (FlashAttention's D), compound scalars named (scale = 1/√d_k).
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import BlockMatrix, HadamardProduct, MatMul, OneMatrix, Transpose

from symattn.codegen.schedule.chains import left_to_right_flops, tree_flops
from symattn.codegen.schedule.dag import Assignment, count_uses, is_name, is_trivial, is_weight
from symattn.codegen.schedule.dag import typical_size as schedule_size
from symattn.lang import graph
from symattn.lang.algebra import factors, product, terms, transpose
from symattn.lang.naming.names import fresh_name
from symattn.lang.ops import MergeHeads, RepeatHeads, RowWise, SplitHeads, SumGroups
from symattn.optimize.cost import chain_order
from symattn.optimize.orders import priced_at_typical_sizes


def fold_scalar_multiples(forward: list[Assignment], keep: set, trainable: frozenset = frozenset()) -> list[Assignment]:
    """Fold S into A when A = c·S (or c·S + M) and S is used nowhere else: one n × m pass fewer.

    Not when c holds a trainable scalar τ: its gradient reads S, which A/τ gives only for τ ≠ 0.

    (The printer then puts c on the smaller factor: A = (c·Q) Kᵀ.)
    """
    while True:
        counts = count_uses([a.value for a in forward])
        for a in forward:
            if a.target in keep or counts[a.target] != 1:
                continue
            found = next(
                ((b, t) for b in forward for t in terms(b.value) if _is_multiple_of(t, a.target, trainable)), None
            )
            if found is None:
                continue
            user, term = found
            merged = product(factors(term)[0], a.value, canonical=False, flatten=True)
            value = (
                merged
                if term is user.value
                else user.value.func(*(merged if t is term else t for t in user.value.args))
            )
            forward = [Assignment(b.target, value) if b is user else b for b in forward if b is not a]
            break
        else:
            return forward


def _is_multiple_of(term: Basic, symbol: MatrixSymbol, trainable: frozenset = frozenset()) -> bool:
    """Is term c·symbol for a scalar c free of trainable scalars (τ may be 0: S = A/τ is no way back)?"""
    return isinstance(term, MatMul) and factors(term)[1] == [symbol] and not factors(term)[0].free_symbols & trainable


def fuse_projections(forward: list[Assignment], backward: list[Assignment], parameters=None) -> tuple[list, list]:
    """One product of X with [W_Q | W_K | W_V] instead of three, forward and backward.

    Forward: QKV = X W_QKV, W_QKV = [W_Q | W_K | W_V], and Q, K, V its column blocks.
    Backward: dX = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ = [dQ | dK | dV] W_QKVᵀ, and
    dW_QKV = Xᵀ [dQ | dK | dV] holds dW_Q, dW_K, dW_V as column blocks.
    """
    groups: dict[Basic, list[Assignment]] = {}
    values = {a.target for a in forward}  # an intermediate labelled W_h is no weight

    def weight(m: Basic) -> bool:
        return is_weight(m, parameters) and m not in values

    for a in forward:
        coeff, mats = factors(a.value)
        if coeff == 1 and len(mats) == 2 and not weight(mats[0]) and weight(mats[1]):
            groups.setdefault(mats[0], []).append(a)
    for x, group in groups.items():
        if len(group) < 2:
            continue
        label = "".join(str(a.target.name) for a in group)
        weights = [factors(a.value)[1][1] for a in group]
        w_all = MatrixSymbol("W_" + label, x.shape[1], sum(w.shape[1] for w in weights))
        fused = MatrixSymbol(label, x.shape[0], w_all.shape[1])
        columns, start = [], sp.Integer(0)
        for w in weights:
            columns.append((start, start + w.shape[1]))
            start += w.shape[1]
        made = [Assignment(w_all, BlockMatrix([weights])), Assignment(fused, x * w_all)]
        made += [Assignment(a.target, fused[:, c0:c1]) for a, (c0, c1) in zip(group, columns)]
        first = forward.index(group[0])
        forward = [*forward[:first], *made, *(a for a in forward[first:] if a not in group)]
        backward = _fuse_backward(backward, x, weights, w_all, label, columns)
    return forward, backward


def _fuse_backward(backward: list[Assignment], x, weights, w_all, label: str, columns) -> list[Assignment]:
    """dX = Σ G_i W_iᵀ → [G_1 | … ] W_allᵀ, and dW_i = Xᵀ G_i → column blocks of Xᵀ [G_1 | … ]."""
    d_fused = MatrixSymbol("d" + label, x.shape[0], w_all.shape[1])
    cotangents: dict[Basic, Basic] = {}
    for a in backward:
        if isinstance(a.value, sp.MatAdd):
            for term in a.value.args:
                coeff, mats = factors(term)
                if coeff == 1 and len(mats) == 2 and isinstance(mats[1], Transpose) and mats[1].arg in weights:
                    cotangents[mats[1].arg] = mats[0]
            if len(cotangents) == len(weights) and len(a.value.args) == len(weights):
                total = a
                break
            cotangents = {}
    else:
        return backward
    blocks = [cotangents[w] for w in weights]
    d_weights = {}
    for a in backward:
        coeff, mats = factors(a.value)
        if coeff == 1 and mats[:1] == [x.T] and len(mats) == 2 and mats[1] in blocks:
            d_weights[mats[1]] = a
    out: list[Assignment] = []
    for a in backward:
        if a is total:
            out.append(Assignment(d_fused, BlockMatrix([blocks])))
            out.append(Assignment(a.target, d_fused * w_all.T, a.reduce_batch))
        elif a in d_weights.values() and len(d_weights) == len(blocks):
            if a is next(iter(d_weights.values())):
                d_all = MatrixSymbol("d" + str(w_all.name), *w_all.shape)
                out.append(Assignment(d_all, x.T * d_fused, reduce_batch=True))
            g = _cotangent_block(a.value)
            c0, c1 = columns[blocks.index(g)]
            out.append(Assignment(a.target, MatrixSymbol("d" + str(w_all.name), *w_all.shape)[:, c0:c1]))
        else:
            out.append(a)
    return out


def _cotangent_block(value: Basic) -> Basic:
    """G in Xᵀ G."""
    return factors(value)[1][1]


def inline_aliases(backward: list[Assignment], keep: set) -> list[Assignment]:
    """t = X or t = Xᵀ (X a name, t not among keep): X is read wherever t was, and t = X is no line of code.

    Passes leave such lines behind (a shared value renamed D₁ by ``name_row_sums``, f₂'s cotangent of G_X that
    is the direction X_v); an output (dB = dA, returned under its own name) stays.
    """
    alias: dict[Basic, Basic] = {}
    out = []
    for a in backward:
        value = graph.rewrite(a.value, alias.get) if alias else a.value
        if a.target not in keep and is_name(value):
            alias[a.target], alias[a.target.T] = value, transpose(value)
            continue
        out.append(a if value is a.value else Assignment(a.target, value, a.reduce_batch))
    return out


def unshared_constant_gradients(
    backward: list[Assignment], gradients: set, taken: frozenset[str] = frozenset()
) -> list[Assignment]:
    """A constant's gradient that other values read (dM, the scores' cotangent, read by dX) computed under a
    name of its own (dM_full), read there, and the gradient assigned from it (dM = dM_full).

    Generated code sums a constant's gradient to the shape the constant was given in (a float attn_mask
    broadcast along the batch), which the values that read the full cotangent must not see.
    """
    read = {x for a in backward for x in graph.matrix_symbols(a.value)}
    names = set(taken) | {str(a.target.name) for a in backward}
    renamed: dict[Basic, Basic] = {}
    out = []
    for a in backward:
        value = graph.rewrite(a.value, renamed.get) if renamed else a.value
        if a.target in gradients and a.target in read:
            label = next(
                f"{a.target.name}_full{k or ''}"
                for k in range(len(names) + 1)
                if f"{a.target.name}_full{k or ''}" not in names
            )
            names.add(label)
            full = renamed[a.target] = MatrixSymbol(label, *a.target.shape)
            out += [Assignment(full, value, a.reduce_batch), Assignment(a.target, full, a.reduce_batch)]
            continue
        out.append(a if value is a.value else Assignment(a.target, value, a.reduce_batch))
    return out


def save_forward_values(forward: list[Assignment], backward: list[Assignment], seed: Basic) -> tuple[list, list]:
    """A backward value the forward computes anyway, named there and saved, never computed twice.

    A backward value that reads no cotangent (neither the seed nor another backward value) and that is a
    subexpression of a forward value — softmax(X W Xᵀ + M) inside Y = (B + softmax(…)) X, left unnamed by
    the spec — is assigned in the forward, just before the first value that contains it, which reads it
    by name; the backward reads the saved value (the standard variant saves what a GEMM made).
    """
    first: dict[Basic, int] = {}  # each forward subexpression → the first forward value that holds it
    for i, f in enumerate(forward):
        for node in graph.nodes(f.value):
            first.setdefault(node, i)
    pending = {a.target for a in backward}
    moved: dict[int, list[Assignment]] = {}
    names: dict[Basic, Basic] = {}
    kept = []
    for a in backward:
        reads = graph.matrix_symbols(a.value)
        where = first.get(a.value) if seed not in reads and not reads & pending and _costly(a.value) else None
        if where is None:
            kept.append(a)
            continue
        pending.discard(a.target)  # a value that reads it may move too
        moved.setdefault(where, []).append(Assignment(a.target, a.value))
        names[a.value] = a.target
    if not names:
        return forward, backward
    out: list[Assignment] = []
    for i, f in enumerate(forward):
        out += moved.get(i, [])
        out.append(Assignment(f.target, graph.rewrite(f.value, names.get), f.reduce_batch))
    return out, kept


def _costly(value: Basic) -> bool:
    """Worth keeping rather than computing again: a value that takes a GEMM or a softmax (a row-wise pass over
    an n × m array), or a row or column (a reduction, cheap to keep). An entrywise function of a saved value is
    recomputed instead (its array would cost as much memory as its input's)."""
    if is_trivial(value):
        return False
    if 1 in value.shape:
        return True
    for node in graph.nodes(value):
        if isinstance(node, RowWise):
            return True
        if isinstance(node, MatMul) and sum(not isinstance(m, OneMatrix) for m in factors(node)[1]) >= 2:
            return True
    return False


def hoist_hadamard_scalars(backward: list[Assignment]) -> list[Assignment]:
    """(a X) ⊙ (b Y) → (a b)(X ⊙ Y), products of scalars merged: one scalar multiple of an n × m array, not three."""

    def hoisted(node: Basic) -> Basic:
        if not isinstance(node, HadamardProduct):
            return node
        split = [factors(a) for a in node.args]
        if all(c == 1 or len(mats) != 1 for c, mats in split):
            return node
        coeff = sp.Mul(*(c for c, mats in split if len(mats) == 1))
        args = [mats[0] if len(mats) == 1 else a for (c, mats), a in zip(split, node.args)]
        return product(coeff, HadamardProduct(*args), canonical=False)

    def nested(node: Basic) -> bool:
        return isinstance(node, MatMul) and len(factors(node)[1]) == 1 and isinstance(factors(node)[1][0], MatMul)

    def flattened(node: Basic) -> Basic:  # a (b X Y) → (a b) X Y
        outer, (inner,) = factors(node)
        coeff, mats = factors(inner)
        return product(outer * coeff, *mats, canonical=False)

    def merged(expr: Basic) -> Basic:
        return expr.replace(lambda e: isinstance(e, HadamardProduct), hoisted).replace(nested, flattened)

    return [Assignment(a.target, merged(a.value), a.reduce_batch) for a in backward]


def reassociate_products(values: list[Assignment]) -> list[Assignment]:
    """c F₁ F₂ … F_k in its cheapest order (at typical sizes) when that is under half the cost of left to
    right, as nested products: X (W_Kᵀ Xᵀ) instead of (X W_Kᵀ) Xᵀ. Run before sharing is found, so that
    dS (X W_K), read by dX and dW_Q, is computed once."""

    def cheaper(node: Basic) -> Basic:
        coeff, mats = factors(node)
        if len(mats) < 3 or any(isinstance(m, OneMatrix) for m in mats):
            return node
        priced_at_typical_sizes(mats)
        tree = chain_order(mats, sp.sympify)
        if tree_flops(tree) >= left_to_right_flops(mats):
            return node
        return tree if coeff == 1 else MatMul(coeff, tree)

    def rewrite(expr: Basic) -> Basic:
        return expr.replace(lambda e: isinstance(e, MatMul), cheaper)

    return [Assignment(a.target, rewrite(a.value), a.reduce_batch) for a in values]


def stack_products(
    values: list[Assignment], unbatched: frozenset[str], taken: set[str], earlier: tuple[Assignment, ...] = ()
) -> list[Assignment]:
    """Σ_i c_i L_i R_i (two or more products of one large result) as one product [c_1 L_1 | c_2 L_2 | …] [R_1; R_2; …]
    where the operands are smaller than the result: one GEMM of inner dimension Σ k_i writes the result once,
    instead of one array per product and a pass that adds them (Ȧ = c·Q K̇ᵀ + c·Q̇ Kᵀ = c·[Q | Q̇] [K̇ | K]ᵀ).

    The concatenations are named (their names added to taken) just before the value that reads them. Operands
    joined must have the same leading axes: all batched or all weights (unbatched: the names of the unbatched
    inputs), with the same heads axis or none (``_layout``); earlier: the assignments before values (a forward
    mode's forward), which they read.
    """
    definitions = {a.target: a.value for a in (*earlier, *values)}
    layouts: dict[Basic, tuple] = {}
    out: list[Assignment] = []
    for a in values:
        found = _stackable(a.value, lambda x: _layout(x, definitions, unbatched, layouts))
        if found is None:
            out.append(a)
            continue
        products, rest = found
        coeffs = [c for c, _, _ in products]
        common = coeffs[0] if len(set(coeffs)) == 1 else sp.Integer(1)
        lefts = [left if common != 1 or c == 1 else c * left for c, left, _ in products]
        rights = [right for _, _, right in products]
        left, left_value = _stacked(lefts, taken, side=1)
        right, right_value = _stacked(rights, taken, side=0)
        out += [Assignment(_symbol(left), left_value), Assignment(_symbol(right), right_value)]
        value = product(common, left, right, canonical=False)
        out.append(Assignment(a.target, sp.MatAdd(value, *rest) if rest else value, a.reduce_batch))
    return out


def _stackable(value: Basic, layout) -> tuple[list, list] | None:
    """([(c_i, L_i, R_i)], the other terms) of a sum worth one product of concatenations, else None."""
    products, rest = [], []
    for term in terms(value):
        coeff, mats = factors(term)
        named = all(isinstance(m, MatrixSymbol) or (isinstance(m, Transpose) and is_name(m.arg)) for m in mats)
        if len(mats) == 2 and named and not any(isinstance(x, MatrixExpr) for x in sp.preorder_traversal(coeff)):
            products.append((coeff, *mats))
        else:
            rest.append(term)
    if len(products) < 2:
        return None
    operands = sum(schedule_size(m.shape[0]) * schedule_size(m.shape[1]) for _, *mats in products for m in mats)
    if schedule_size(value.shape[0]) * schedule_size(value.shape[1]) <= operands:
        return None
    for side in (1, 2):
        kinds = {layout(_bare(p[side])) for p in products}
        if len(kinds) != 1 or None in kinds:  # a batch or heads axis on one operand and not another
            return None
    return products, rest


def _stacked(parts: list[Basic], taken: set[str], side: int) -> tuple[Basic, Basic]:
    """(the factor that stands for the parts side by side, the concatenation it names): the left factors of the
    products joined along their columns (side 1), the right ones along their rows (side 0). Transposed parts are
    joined untransposed, along the other axis, and the factor is the transpose of their concatenation."""
    transposed = all(isinstance(p, Transpose) for p in parts)
    blocks = [p.arg for p in parts] if transposed else parts
    along = 1 - side if transposed else side
    names = [str(_bare(p).name) for p in parts]
    stem = "_".join(names) if len("".join(names)) <= 12 else "stacked"
    name = fresh_name(stem, taken, bare=True, first=2, sep="_")
    taken.add(name)
    value = BlockMatrix([blocks]) if along == 1 else BlockMatrix([[b] for b in blocks])
    symbol = MatrixSymbol(name, *value.shape)
    return (symbol.T if transposed else symbol), value


def _symbol(factor: Basic) -> MatrixSymbol:
    return factor.arg if isinstance(factor, Transpose) else factor


def _bare(m: Basic) -> Basic:
    """The name under a scalar multiple or a transpose."""
    m = factors(m)[1][0] if isinstance(m, MatMul) else m
    return m.arg if isinstance(m, Transpose) else m


def _layout(x: Basic, definitions: dict, unbatched: frozenset[str], memo: dict) -> tuple | None:
    """(batched, heads) of a value's leading axes: whether it carries the batch, and its heads axis (H of
    split_heads, none after merge_heads); None where its operands disagree on the heads. Walked iteratively
    (post-order through the definitions), each value once."""
    stack = [x]
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        if isinstance(node, MatrixSymbol):
            parts = [definitions[node]] if node in definitions else []
        else:
            parts = [a for a in node.args if isinstance(a, MatrixExpr)]
        waiting = [p for p in parts if p not in memo]
        if waiting:
            stack += waiting
            continue
        stack.pop()
        memo[node] = _layout_of(node, [memo[p] for p in parts], unbatched)
    return memo[x]


def _layout_of(node: Basic, parts: list, unbatched: frozenset[str]) -> tuple | None:
    """A value's layout from its operands' (a name: its definition's, or an input's own)."""
    if isinstance(node, MatrixSymbol):
        return parts[0] if parts else (str(node.name) not in unbatched, None)
    if isinstance(node, (SplitHeads, RepeatHeads, SumGroups, MergeHeads)):
        heads = {SplitHeads: "heads", RepeatHeads: "heads", SumGroups: "kv_heads"}.get(type(node))
        return None if parts[0] is None else (parts[0][0], getattr(node, heads) if heads else None)
    heads = {p[1] for p in parts if p is not None and p[1] is not None}
    return None if None in parts or len(heads) > 1 else (any(p[0] for p in parts), next(iter(heads), None))
