"""Naming passes of a schedule: which forward values get a name (and which name), whatever the spec named.

``inline_products`` writes a spec's named products out where they are read (the schedule chooses which
products to name); ``name_forward_values`` names what the backward reads (a product's operands, a function's
argument and value, O = P V for the D identity, the S a trainable scalar multiplies); ``name_product_runs``
names the inner products of a chain in its cheapest order; ``save_entrywise_outputs`` names f(X) where the
backward reads it again (the record's ``reads_value``); ``name_row_sums`` and ``name_constants`` name the
backward's row sums and scalar constants.
"""

from __future__ import annotations

from collections.abc import Collection

import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatMul, OneMatrix, Transpose

from symattn.codegen.schedule.dag import Assignment, expand, is_trivial, is_weight
from symattn.lang import graph
from symattn.lang.algebra import factors, product, transpose
from symattn.lang.functions import FunctionRecord
from symattn.lang.naming.names import Names, fresh_name
from symattn.lang.ops import Elementwise, RowSoftmax, RowSum, RowWise
from symattn.lang.ops_block import _RowStatistic
from symattn.optimize.cost import chain_order
from symattn.optimize.orders import priced_at_typical_sizes


def inline_products(forward: list[Assignment], keep: set) -> tuple[list[Assignment], dict[Basic, str]]:
    """The forward with every named product (Q = X W_Q, S = Q Kᵀ, c·S) but those in keep written out where it is
    read, and the spec's labels of the products: {X W_Q: "Q", …}.

    Which products a schedule names is then its own choice (the operands the backward reads,
    ``name_forward_values``; the cheapest order of a chain, ``name_product_runs``), whichever the spec named:
    σ(X W_K)ᵀ X W_V is (σ(X W_K)ᵀ X) W_V although the spec named V = X W_V. A product it names takes the
    spec's label.
    """
    definitions: dict[Basic, Basic] = {}
    labels: dict[Basic, str] = {}
    out: list[Assignment] = []
    for a in forward:
        value = expand(a.value, definitions) if definitions else a.value
        if isinstance(value, MatMul) and a.target not in keep:
            definitions[a.target] = value
            definitions[a.target.T] = transpose(value)
            labels.setdefault(value, str(a.target.name))
            labels.setdefault(product(*factors(value)[1]), str(a.target.name))  # S in c·S
            continue
        out.append(Assignment(a.target, value, a.reduce_batch))
    return out, labels


def name_forward_values(
    forward: list[Assignment], taken: set[str], trainable: frozenset = frozenset(), labels: dict | None = None
) -> list[Assignment]:
    """Every value of the forward that its backward reads named, whether or not the spec named it.

    A VJP reads the operands of a product (a GEMM's, an entrywise product's), the argument and value of a
    row-wise or entrywise function (softmax, row sums and statistics, σ, tanh, exp, x^∘p), and the matrix a
    trainable scalar multiplies (dτ = ⟨dA, S⟩ for A = τ·S); FlashAttention's D identity reads O = P V. Each is
    named, with the earlier names in it, before the value that reads it: the schedule that follows depends on
    the function, not on which parts the spec named (``fold_scalar_multiples`` folds a constant-scaled value
    back where that is cheaper). labels: the spec's names for values (``inline_products``), taken where free.
    """
    taken = set(taken) | {str(a.target.name) for a in forward}
    labels = labels or {}
    names = Names()
    softmaxes: set = set()
    out: list[Assignment] = []
    for a in forward:
        wanted: dict[Basic, str] = {}  # value → its label's stem if the spec gives none (A for a softmax's argument)
        for node in graph.nodes(a.value):
            for value, stem in _read_by_backward(node, trainable, softmaxes):
                wanted[value] = wanted.get(value) or stem
        for value, stem in wanted.items():
            if value == a.value or is_trivial(value) or value in names.table:
                continue
            label = _value_label(value, taken, labels, stem)
            taken.add(label)
            target = MatrixSymbol(label, *value.shape)
            out.append(Assignment(target, names.substitute(_broadcasts(value, names)), a.reduce_batch))
            names.add(value, target)
            softmaxes.update([target] if _weights(out[-1].value, softmaxes) else [])
        value = names.substitute(_broadcasts(a.value, names)) if names.table else a.value
        out.append(Assignment(a.target, value, a.reduce_batch))
        softmaxes.update([a.target] if _weights(value, softmaxes) else [])
    return out


def _weights(value: Basic, softmaxes: set) -> bool:
    """Is value attention weights: a row softmax, or a softmax's name times a mask entrywise (W = P ⊙ Z_p(P),
    dropout's)? Its product with V is named as P V is: O = W V is what the D identity reads (rowsum(P ⊙ dP) =
    rowsum(O ⊙ G) holds for W too) and what the memory-efficient variant's loop makes block by block."""
    if isinstance(value, HadamardProduct):
        return any(isinstance(x, RowSoftmax) or x in softmaxes for x in value.args)
    return isinstance(value, RowSoftmax)


def _column(node: Basic) -> Basic | None:
    """u for a column u broadcast across columns, u 𝟏ᵀ (SymPy writes F G 𝟏_{k×1} 𝟏_{1×c} as F G 𝟏_{k×c})."""
    if not isinstance(node, MatMul):
        return None
    coeff, mats = factors(node)
    last = mats[-1]
    if len(mats) < 2 or not isinstance(last, OneMatrix) or last.shape[1] == 1:
        return None
    if last.shape[0] == 1:
        return product(coeff, *mats[:-1])
    return product(coeff, *mats[:-1], OneMatrix(last.shape[0], 1))


def _broadcasts(value: Basic, names: Names) -> Basic:
    """value with each broadcast of a named column written as the name broadcast: F G 𝟏_{k×c} → Z 𝟏_{1×c}."""

    def named(node: Basic) -> Basic | None:
        fused = isinstance(node, MatMul) and isinstance(node.args[-1], OneMatrix) and node.args[-1].shape[0] != 1
        column = _column(node) if fused else None  # (u 𝟏ᵀ with u named: substitute finds u itself)
        if column is None or column not in names.table:
            return None
        return MatMul(names.table[column], OneMatrix(1, node.shape[1]))

    return graph.rewrite(value, named)


ROW_AND_ENTRYWISE = (FunctionRecord, RowSum, _RowStatistic, HadamardPower)


def _read_by_backward(node: Basic, trainable: frozenset, softmaxes: set) -> list[tuple[Basic, str]]:
    """The values node's VJP reads, arguments first, each with a label stem ("" for the default); softmaxes: the
    names of row softmaxes and of weights made of them (``_weights``). Names and broadcasts (u 𝟏ᵀ) among them are
    left out later (``is_trivial``)."""
    if isinstance(node, ROW_AND_ENTRYWISE):  # f(u 𝟏ᵀ) = f(u) 𝟏ᵀ: the column is the value, printed broadcast
        column = _column(node.args[0])
        if column is not None:
            return [(column, "")]
        if isinstance(node, RowWise):  # A and P for a softmax, A and L for a log-softmax
            return [(node.arg, node.arg_letter), (node, node.letter)]
        return [(node.args[0], ""), (node, "")]
    if isinstance(node, HadamardProduct):  # (an entrywise function among them is named by the rule above)
        return [(_column(a) or a, "") for a in node.args if not isinstance(a, ROW_AND_ENTRYWISE)]
    if not isinstance(node, MatMul):
        return []
    coeff, mats = factors(node)
    if any(isinstance(m, OneMatrix) for m in mats):
        return []
    operands = [m.arg if isinstance(m, Transpose) else m for m in mats] if len(mats) > 1 else []
    # O = P V: the D identity reads it; S in τ·S: dτ does
    read = coeff.free_symbols & trainable or any(_weights(m, softmaxes) or m in softmaxes for m in operands)
    return [(m, "") for m in [*operands, *([product(*mats)] if read else [])]]


def _value_label(value: Basic, taken: set[str], labels: dict, stem: str = "") -> str:
    """The spec's label of value, else the stem (A, A2, … for a softmax's argument, P, P2, … for a softmax), XW_Q for
    a product of two names (``_run_label``), else F1, F2, …; never in taken."""
    if labels.get(value, "") not in ("", *taken):
        return labels[value]
    if stem:
        return fresh_name(stem, taken, bare=True, first=2)
    return _run_label(value, taken) if isinstance(value, MatMul) else fresh_name("F", taken)


def name_product_runs(forward: list[Assignment], taken: set[str], labels: dict | None = None) -> list[Assignment]:
    """Each product of three or more matrices in a forward value split in its cheapest order (the matrix-chain
    programme at typical sizes) and every inner product of it named, before the value that reads it.

    P X W_V is P (X W_V) with XW_V named; X W_Q W_Kᵀ Xᵀ is (X W_Q)(W_Kᵀ Xᵀ): the forward computes in the
    cheapest order whether the spec named Q, K, V or not, and the backward reads these values by name
    instead of computing them again. taken: the names in use (a label never shadows one); labels: the spec's
    names for products (``inline_products``), taken where free.
    """
    taken = set(taken) | {str(a.target.name) for a in forward}
    labels = labels or {}
    out: list[Assignment] = []
    for a in forward:
        runs: list[Basic] = []
        for node in graph.nodes(a.value):
            _, mats = factors(node) if isinstance(node, MatMul) else (1, [])
            if len(mats) >= 3 and not any(isinstance(m, OneMatrix) for m in mats):
                priced_at_typical_sizes(mats)
                _inner_runs(chain_order(mats, sp.sympify), runs)
        if not runs:
            out.append(a)
            continue
        names = Names()
        for run in dict.fromkeys(runs):  # children before parents: each written with the names before it
            flipped = transpose(run)  # W_Kᵀ Xᵀ is named as X W_K, read as its transpose
            run = flipped if _transposes(flipped) < _transposes(run) else run
            label = _value_label(run, taken, labels)
            taken.add(label)
            target = MatrixSymbol(label, *run.shape)
            out.append(Assignment(target, names.substitute(run), a.reduce_batch))
            names.add(run, target)
        out.append(Assignment(a.target, names.substitute(a.value), a.reduce_batch))
    return out


def _transposes(run: Basic) -> int:
    """How many of a product's factors are transposed."""
    return sum(isinstance(m, Transpose) for m in factors(run)[1])


def _inner_runs(tree: Basic, runs: list[Basic]) -> None:
    """The products below the root of a binary product tree (chain_order's), children first, as canonical
    products of their factors."""
    stack: list[tuple[Basic, bool]] = [(arg, False) for arg in reversed(tree.args)]
    while stack:
        node, expanded = stack.pop()
        if not (isinstance(node, MatMul) and len(node.args) == 2):
            continue
        if expanded:
            runs.append(product(*_leaves(node)))
        else:
            stack.append((node, True))
            stack.extend((arg, False) for arg in reversed(node.args))


def _leaves(tree: Basic) -> list[Basic]:
    """The factors of a binary product tree, left to right."""
    if isinstance(tree, MatMul) and len(tree.args) == 2:
        return [*_leaves(tree.args[0]), *_leaves(tree.args[1])]
    return [tree]


def _run_label(run: Basic, taken: set[str]) -> str:
    """XW_V for X W_V (the factors' names, a transposed one's with T: XTW_K), else F1, F2, …; never in taken, never
    a weight's name."""
    _, mats = factors(run)
    inner = [m.arg if isinstance(m, Transpose) else m for m in mats]
    if all(isinstance(m, MatrixSymbol) for m in inner):
        label = "".join(str(m.name) + ("T" if isinstance(f, Transpose) else "") for m, f in zip(inner, mats))
        if label.isidentifier() and label not in taken and not is_weight(MatrixSymbol(label, 1, 1)):
            return label  # (W_VTXT would read as a weight: unbatched)
    return fresh_name("F", taken)


def name_row_sums(backward: list[Assignment], taken: frozenset[str] = frozenset()) -> list[Assignment]:
    """Name each row sum inside a larger value: D = rowsum(dO ⊙ O), an n × 1 column (FlashAttention's D).

    taken: names already in use (inputs, forward values), which a row sum's name must not shadow.
    """
    sums: list[Basic] = []
    for a in backward:
        for node in sp.preorder_traversal(a.value):
            if isinstance(node, RowSum) and node != a.value and node not in sums:
                sums.append(node)
    taken = taken | {str(a.target.name) for a in backward}
    labels: list[str] = []
    for _ in sums:  # one: D; several: D1, D2, …
        labels.append(fresh_name("D", {*taken, *labels}, bare=len(sums) == 1))
    table = {node: MatrixSymbol(label, *node.shape) for node, label in zip(sums, labels)}
    renamed = [Assignment(a.target, a.value.xreplace(table), a.reduce_batch) for a in backward]
    return [Assignment(symbol, node) for node, symbol in table.items()] + renamed


def name_constants(forward: list[Assignment], backward: list[Assignment], taken: set) -> tuple:
    """Name each compound scalar factor (1/√d_k → scale) once, so it is computed once; taken: the names (or
    symbols) a label must not shadow (options, inputs, values)."""
    found: list[Basic] = []
    for a in forward + backward:
        for node in sp.preorder_traversal(a.value):
            if isinstance(node, MatMul):
                coeff, _ = factors(node)
                # only a scalar of scalars: tr(A) or 𝟏ᵀA𝟏 is a per-batch value, printed where its matrix is
                pure = not any(isinstance(x, MatrixSymbol) for x in coeff.free_symbols)
                if coeff.free_symbols and pure and not coeff.is_Symbol and coeff not in found:
                    found.append(coeff)
    labels = iter(["scale", *(f"c{i}" for i in range(1, len(found) + 1))])
    constants = []
    for c in found:
        label = next(label for label in labels if label not in {str(t) for t in taken})
        constants.append((sp.Symbol(label, real=True), c))
    table = {c: s for s, c in constants}

    def rename(a: Assignment) -> Assignment:
        return Assignment(a.target, a.value.xreplace(table), a.reduce_batch)

    return tuple(constants), [rename(a) for a in forward], [rename(a) for a in backward]


def save_entrywise_outputs(
    forward: list[Assignment], backward: list[Assignment], taken: Collection[str] = frozenset()
) -> tuple[list, list]:
    """Name T = f(X) in the forward when the backward reads f(X) again: the backward reads T, not X. The name is
    new: none of taken (the spec's inputs and constants), nor a value's or a symbol's that a statement reads or
    writes (σ(Z) of an input Z is Z1, never Z: Z = σ(Z) would overwrite the input the backward reads).

    The rules with an output form (tanh: 𝟏𝟏ᵀ − T^∘2, σ: T ⊙ (𝟏𝟏ᵀ − T), exp: T) then read the forward's
    output instead of recomputing f; saving T costs what saving X did (X, read only there, is not kept),
    and f (tanh, σ, exp: ~10-20 flops an entry) is not evaluated a second time.
    """
    targets = {a.target for a in forward}
    wanted = []
    for a in backward:
        for node in sp.preorder_traversal(a.value):
            if (
                isinstance(node, Elementwise)
                and node.reads_value()
                and node not in wanted
                and node.free_symbols <= _forward_atoms(forward)
            ):
                if any(node in sp.preorder_traversal(f.value) and node != f.value for f in forward):
                    wanted.append(node)
    taken = {*taken, *(str(t.name) for t in targets), *(str(b.target.name) for b in backward)}
    taken |= {str(x.name) for a in (*forward, *backward) for x in a.value.free_symbols if hasattr(x, "name")}
    names: dict[Basic, Basic] = {}  # the nodes named so far: σ(σ(X)) reads σ(Z) once σ(X) is Z
    for node in wanted:
        node = node.xreplace(names)
        first = next((i for i, f in enumerate(forward) if node in sp.preorder_traversal(f.value)), None)
        if first is None:
            continue
        label = next(name for name in _labels(node) if name not in taken)
        taken.add(label)
        symbol = MatrixSymbol(label, *node.shape)
        rename = {node: symbol}
        names[node] = symbol
        forward = [
            *forward[:first],
            Assignment(symbol, node),
            *(Assignment(f.target, f.value.xreplace(rename), f.reduce_batch) for f in forward[first:]),
        ]
        backward = [Assignment(b.target, b.value.xreplace(rename), b.reduce_batch) for b in backward]
    return forward, backward


def _forward_atoms(forward: list[Assignment]) -> set:
    """Every symbol the forward reads or writes."""
    return set().union(*(a.value.free_symbols | {a.target} for a in forward))


def _labels(node: Basic):
    """Names for f(X): its record's letter (T for tanh, Z for σ, E for exp), then numbered."""
    base = node.letter
    yield base
    yield from (f"{base}{i}" for i in range(1, 100))
