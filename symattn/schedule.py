"""Schedules: a spec's forward and backward pass as named assignments in order.

``schedule(name)`` derives the spec's gradients and hash-conses forward values,
cotangents and gradients into one DAG in which every shared subexpression has a
name and is computed once:

- forward values are the spec's intermediates (S, A, P, O, …), each written with
  the earlier names (products are matched as contiguous runs of factors, so
  Q Kᵀ is found inside scale·X W_Q W_Kᵀ Xᵀ), plus the output;
- backward values are the cotangents of those intermediates (dP, dA, …), named
  "d" + the intermediate, then any other subexpression used twice, then the
  gradient of every input (dQ, dW_Q, …);
- the forward values the backward reads are saved once.

A transposed use of a named value is found too (dAᵀ inside the gradient of K).
Printers turn each assignment into code; templates only lay the lines out.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import BlockMatrix, MatMul, OneMatrix, Transpose

from symattn.grad import backward
from symattn.ops import RowSum
from symattn.specs import Spec, dim, spec


def simplifier(given: list[Basic]) -> Callable[[Basic], Basic]:
    """symattn.simplify.simplify with the forward values free (when present), products flattened.

    Flattening undoes the simplifier's placement of scalars inside products, so that
    the forward names still match; the printers place scalars on the smallest factor.
    """
    try:
        from symattn.simplify import simplify
    except ImportError:  # pragma: no cover - the simplifier is optional
        return lambda expr: expr
    return lambda expr: expand(simplify(expr, given=given), {})


SEED = "grad_out"
# Typical sizes of the dimensions, for choosing between equal forms (cost) and where a scalar goes.
TYPICAL_SIZES = {"n": 1024, "m": 1024, "H": 8, "b": 128}
TYPICAL_OTHER = 64  # name of the output's cotangent in generated code


@dataclass(frozen=True)
class Option:
    """A keyword option of a generated forward: a scalar symbol and its default (None: required)."""

    name: str
    symbol: sp.Symbol
    default: Basic | None


@dataclass(frozen=True)
class Binding:
    """A dimension read off an input's shape: symbol = input.shape[axis] // divisor."""

    symbol: sp.Symbol
    input: str
    axis: int
    divisor: Basic | None = None


@dataclass(frozen=True)
class Assignment:
    """target = value; a weight's gradient is summed over leading batch dimensions."""

    target: MatrixSymbol
    value: Basic
    reduce_batch: bool = False
    comment: str = ""


@dataclass(frozen=True)
class Schedule:
    """A spec's generated forward and backward passes."""

    spec: Spec
    options: tuple[Option, ...]
    bindings: tuple[Binding, ...]
    weights: frozenset[str]
    forward: tuple[Assignment, ...]
    output: MatrixSymbol
    saved: tuple[Basic, ...]
    seed: MatrixSymbol
    backward: tuple[Assignment, ...]
    gradients: tuple[tuple[str, MatrixSymbol], ...]
    constants: tuple[tuple[sp.Symbol, Basic], ...] = ()

    @property
    def inputs(self) -> tuple[MatrixSymbol, ...]:
        return self.spec.inputs

    def is_batched(self, expr: Basic) -> bool:
        """Does expr carry the leading batch dimensions (depends on a non-weight input or the seed)?"""
        return any(s.name not in self.weights for s in expr.atoms(MatrixSymbol))


def _options(name: str) -> tuple[dict, tuple[Option, ...]]:
    """Spec options made symbolic, so that one generated module serves every value."""
    if name == "attention":
        scale = sp.Symbol("scale", real=True)
        return {"scale": scale}, (Option("scale", scale, 1 / sp.sqrt(dim("d_k"))),)
    if name == "mha":
        return {}, (Option("num_heads", dim("H"), None),)
    return {}, ()


def is_weight(symbol: MatrixSymbol) -> bool:
    """Weights are the inputs named W_… (CONTRACT.md); they carry no batch dimensions."""
    return str(symbol.name).startswith("W_")


def _bindings(inputs: Iterable[MatrixSymbol], known: set) -> tuple[Binding, ...]:
    """Read every dimension off the first input axis that determines it."""
    known = set(known)
    found: list[Binding] = []
    progress = True
    while progress:
        progress = False
        for x in inputs:
            for axis, size in zip((-2, -1), x.shape):
                size = sp.sympify(size)
                unknown = size.free_symbols - known
                if len(unknown) != 1:
                    continue
                (s,) = unknown
                divisor = sp.simplify(size / s)
                if divisor.free_symbols - known or s in divisor.free_symbols:
                    continue
                found.append(Binding(s, str(x.name), axis, None if divisor == 1 else divisor))
                known.add(s)
                progress = True
    return tuple(found)


# Hash-consing: original subexpression -> name, products matched as runs of factors.


def _factors(expr: Basic) -> tuple[Basic, list[Basic]]:
    scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
    return sp.Mul(*scalars), [a for a in expr.args if isinstance(a, MatrixExpr)]


def product(coeff: Basic, factors: list[Basic]) -> Basic:
    """coeff · F₁ ⋯ F_k as one flat MatMul (a single factor stays itself)."""
    flat: list[Basic] = []
    for f in factors:
        if isinstance(f, MatMul):
            c, inner = _factors(f)
            coeff, flat = coeff * c, [*flat, *inner]
        else:
            flat.append(f)
    if coeff == 1 and len(flat) == 1:
        return flat[0]
    return MatMul(*([coeff] if coeff != 1 else []), *flat)


class Names:
    """A table from subexpressions (as derived) to the symbols that name them."""

    def __init__(self) -> None:
        self.table: dict[Basic, Basic] = {}

    def add(self, expr: Basic, symbol: MatrixSymbol) -> None:
        self.table[expr] = symbol
        self.table.setdefault(expr.T, symbol.T)

    def substitute(self, expr: Basic, skip: Basic | None = None) -> Basic:
        """expr with every named subexpression (but skip) replaced by its name."""
        if expr in self.table and expr != skip:
            return self.table[expr]
        if not expr.args or isinstance(expr, MatrixSymbol):
            return expr
        if isinstance(expr, MatMul):
            return self._substitute_product(expr, skip)
        return expr.func(*(self.substitute(a, skip) for a in expr.args))

    def _substitute_product(self, expr: MatMul, skip: Basic | None) -> Basic:
        coeff, mats = _factors(expr)
        runs = sorted(
            ((k, v) for k, v in self.table.items() if isinstance(k, MatMul) and k != skip),
            key=lambda kv: -len(kv[0].args),
        )
        out: list[Basic] = []
        i = 0
        while i < len(mats):
            for key, name in runs:
                c, run = _factors(key)
                if len(run) > 1 and tuple(mats[i : i + len(run)]) == tuple(run):
                    coeff = coeff / c
                    out.append(name)
                    i += len(run)
                    break
            else:
                out.append(self.substitute(mats[i], skip))
                i += 1
        return product(coeff, out)


def typical_size(size: Basic) -> int:
    """A dimension at typical sizes: sequence lengths n, m long, heads few, features short."""
    size = sp.sympify(size)
    return int(size.xreplace({s: TYPICAL_SIZES.get(s.name, TYPICAL_OTHER) for s in size.free_symbols}))


def _is_trivial(expr: Basic) -> bool:
    if isinstance(expr, Transpose):
        expr = expr.arg
    return isinstance(expr, (MatrixSymbol, OneMatrix)) or not isinstance(expr, MatrixExpr)


def _uses(values: Iterable[Basic]) -> Counter:
    """How often each subexpression occurs across the values (every occurrence counted)."""
    counts: Counter = Counter()
    for v in values:
        for node in sp.preorder_traversal(v):
            counts[node] += 1
    return counts


def _shared(values: list[Basic]) -> Basic | None:
    """The largest non-trivial subexpression used at least twice, if any."""
    counts = _uses(values)
    shared = [e for e, c in counts.items() if c > 1 and not _is_trivial(e) and isinstance(e, MatrixExpr)]
    if not shared:
        return None
    return max(shared, key=lambda e: (sp.count_ops(e), str(e)))


def _product_name(expr: Basic) -> str:
    """An identifier for the cotangent of an unnamed product such as Q W_Q: dQW_Q."""
    _, mats = _factors(expr) if isinstance(expr, MatMul) else (1, [expr])
    if all(isinstance(m, MatrixSymbol) for m in mats):
        return "d" + "".join(str(m.name) for m in mats)
    return ""


def _order(assignments: list[Assignment]) -> list[Assignment]:
    """Stable topological order: each assignment after those whose targets it reads."""
    placed: list[Assignment] = []
    done: set[Basic] = set()
    pending = list(assignments)
    targets = {a.target for a in assignments}
    while pending:
        for a in pending:
            needs = (a.value.atoms(MatrixSymbol) & targets) - done - {a.target}
            if not needs:
                placed.append(a)
                done.add(a.target)
                pending.remove(a)
                break
        else:  # pragma: no cover - names are introduced acyclically
            raise RuntimeError("cyclic schedule")
    return placed


def _fold_scalar_multiples(forward: list[Assignment], keep: set) -> list[Assignment]:
    """Fold S into A when A = c·S and S is used nowhere else: one n × m pass fewer.

    (The printer then puts c on the smaller factor: A = (c·Q) Kᵀ.)
    """
    while True:
        counts = _uses([a.value for a in forward])
        for a in forward:
            if a.target in keep or counts[a.target] != 1:
                continue
            user = next((b for b in forward if isinstance(b.value, MatMul) and a.target in b.value.args), None)
            if user is None:
                continue
            coeff, mats = _factors(user.value)
            if mats != [a.target]:
                continue
            merged = product(coeff, [a.value])
            forward = [Assignment(b.target, merged) if b is user else b for b in forward if b is not a]
            break
        else:
            return forward


def cost(expr: Basic) -> int:
    """Multiply-adds and entrywise operations of expr at typical sizes, each distinct node once."""
    total = 0
    for node in set(sp.preorder_traversal(expr)):
        if not isinstance(node, MatrixExpr) or _is_trivial(node):
            continue
        if isinstance(node, MatMul):
            _, mats = _factors(node)
            rows = typical_size(mats[0].shape[0])
            for left, right in itertools.pairwise(mats):
                total += rows * typical_size(left.shape[1]) * typical_size(right.shape[1])
            total += rows * typical_size(mats[-1].shape[1])  # the scalar factor, if any
        else:
            total += typical_size(node.shape[0]) * typical_size(node.shape[1])
    return total


def _sweep(forward: list[Assignment], inputs: tuple, seed: MatrixSymbol) -> tuple[list, dict, dict]:
    """Reverse mode over the named forward assignments, one VJP per assignment.

    Returns the backward assignments (cotangent d<name> of each intermediate that
    receives one, and the gradient of each input), the cotangent symbol of every
    forward target, and names for the cotangents of unnamed interior products.
    """
    named = Names()
    for a in forward:
        named.add(a.value, a.target)
    contributions: dict[Basic, list[Basic]] = {forward[-1].target: [seed]}
    cotangent_of: dict[Basic, Basic] = {}
    interior: dict[Basic, str] = {}
    assignments: list[Assignment] = []

    def collect(target: MatrixSymbol) -> Basic | None:
        terms = contributions.pop(target, [])
        if not terms:
            return None
        total = terms[0] if len(terms) == 1 else sp.MatAdd(*terms).doit(deep=False)
        if _is_trivial(total):
            return total
        symbol = MatrixSymbol("d" + str(target.name), *target.shape)
        assignments.append(Assignment(symbol, total, reduce_batch=is_weight(target)))
        return symbol

    for a in reversed(forward):
        g = collect(a.target)
        if g is None:
            continue
        cotangent_of[a.target] = g
        wrt = [x for x in a.value.atoms(MatrixSymbol) if x in inputs or x in cotangent_of or _is_target(x, forward)]
        tape = backward(a.value, wrt, g)
        for node, cot in tape.cotangents.items():
            if isinstance(node, MatMul) and node not in wrt and _product_name(node):
                interior[named.substitute(cot)] = _product_name(node)
        for x in wrt:
            if x in tape.cotangents:
                contributions.setdefault(x, []).append(named.substitute(tape.gradients[x]))
    for x in inputs:
        if contributions.get(x):
            cotangent_of[x] = collect(x)
        else:
            assignments.append(Assignment(MatrixSymbol("d" + str(x.name), *x.shape), sp.ZeroMatrix(*x.shape)))
    return assignments, cotangent_of, interior


def _is_target(x: Basic, forward: list[Assignment]) -> bool:
    return any(a.target == x for a in forward)


def _simplified(backward_values: list[Assignment], forward: list[Assignment]) -> list[Assignment]:
    """Each value with the cotangents it reads written out, simplified, renamed: kept if cheaper.

    This is where rowsum(dP ⊙ P) becomes rowsum(dO ⊙ O): the simplifier sees
    dP = dO Vᵀ and that O = P V is at hand.
    """
    simplify = simplifier([a.value for a in forward])
    names = Names()
    for a in forward:
        names.add(a.value, a.target)
    definitions = {}
    for b in backward_values:
        names.add(b.value, b.target)
        definitions[b.target] = b.value
        definitions[b.target.T] = b.value.T
    out = []
    for b in backward_values:
        candidate = names.substitute(simplify(expand(b.value, definitions)), skip=b.value)
        if candidate != b.value and cost(candidate) < cost(b.value):
            b = Assignment(b.target, candidate, b.reduce_batch, b.comment)
        out.append(b)
    return out


@functools.cache
def schedule(name: str) -> Schedule:
    """The forward and backward schedule of the built-in spec called name."""
    spec_options, options = _options(name)
    s = spec(name, **spec_options)
    seed = MatrixSymbol(SEED, *s.output.shape)

    # Forward: the spec's intermediates in order, then the output.
    names = Names()
    forward: list[Assignment] = []
    intermediates = list(s.intermediates)
    if all(e != s.output for _, e in intermediates):
        intermediates.append(("Y", s.output))
    for label, expr in intermediates:
        target = MatrixSymbol(label, *expr.shape)
        forward.append(Assignment(target, names.substitute(expr)))
        names.add(expr, target)
    output = names.table[s.output]
    forward = _needed_forward(_fold_scalar_multiples(forward, {output}), output)

    # Backward: one VJP per forward assignment, then the simplifier's cheaper forms.
    backward_values, _, interior = _sweep(forward, s.inputs, seed)
    backward_values = _simplified(backward_values, forward)
    gradients = [(str(x.name), MatrixSymbol("d" + str(x.name), *x.shape)) for x in s.inputs]

    # Any other subexpression used twice gets a name and is computed once.
    serial = 0
    while (shared := _shared([a.value for a in backward_values])) is not None:
        label = interior.get(shared, "")
        if not label or any(str(a.target.name) == label for a in backward_values):
            serial += 1
            label = f"t{serial}"
        target = MatrixSymbol(label, *shared.shape)
        local = Names()
        local.add(shared, target)
        backward_values = [
            Assignment(a.target, local.substitute(a.value), a.reduce_batch, a.comment) for a in backward_values
        ]
        backward_values.append(Assignment(target, shared))
    backward_values = _order(_name_row_sums(backward_values))

    # Keep what the gradients read; save what the backward reads.
    needed = _needed(backward_values, {t for _, t in gradients})
    backward_values = [a for a in backward_values if a.target in needed]
    constants, forward, backward_values = _name_constants(forward, backward_values, {o.symbol for o in options})
    forward, backward_values = fuse_projections(forward, backward_values)
    forward_targets = {a.target for a in forward}
    read_back = set().union(*(a.value.free_symbols for a in backward_values)) - {a.target for a in backward_values}
    saved_inputs = [x for x in s.inputs if x in read_back]
    saved_values = [a.target for a in forward if a.target in read_back and a.target in forward_targets]
    scalars = sorted((x for x in read_back if isinstance(x, sp.Symbol)), key=str)
    return Schedule(
        spec=s,
        options=options,
        bindings=_bindings(s.inputs, {o.symbol for o in options}),
        weights=frozenset(str(x.name) for x in s.inputs if is_weight(x)),
        forward=tuple(forward),
        output=output,
        saved=(*saved_inputs, *saved_values, *scalars),
        seed=seed,
        backward=tuple(backward_values),
        gradients=tuple(gradients),
        constants=constants,
    )


def fuse_projections(forward: list[Assignment], backward: list[Assignment]) -> tuple[list, list]:
    """One product of X with [W_Q | W_K | W_V] instead of three, forward and backward.

    Forward: QKV = X W_QKV, W_QKV = [W_Q | W_K | W_V], and Q, K, V its column blocks.
    Backward: dX = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ = [dQ | dK | dV] W_QKVᵀ, and
    dW_QKV = Xᵀ [dQ | dK | dV] holds dW_Q, dW_K, dW_V as column blocks.
    """
    groups: dict[Basic, list[Assignment]] = {}
    for a in forward:
        coeff, mats = _factors(a.value) if isinstance(a.value, MatMul) else (0, [])
        if coeff == 1 and len(mats) == 2 and not is_weight(mats[0]) and is_weight(mats[1]):
            groups.setdefault(mats[0], []).append(a)
    for x, group in groups.items():
        if len(group) < 2:
            continue
        label = "".join(str(a.target.name) for a in group)
        weights = [_factors(a.value)[1][1] for a in group]
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
                coeff, mats = _factors(term) if isinstance(term, MatMul) else (0, [])
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
        coeff, mats = _factors(a.value) if isinstance(a.value, MatMul) else (0, [])
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
            g = mats_block(a.value)
            c0, c1 = columns[blocks.index(g)]
            out.append(Assignment(a.target, MatrixSymbol("d" + str(w_all.name), *w_all.shape)[:, c0:c1]))
        else:
            out.append(a)
    return out


def mats_block(value: Basic) -> Basic:
    """G in Xᵀ G."""
    return _factors(value)[1][1]


def _name_row_sums(backward: list[Assignment]) -> list[Assignment]:
    """Name each row sum inside a larger value: D = rowsum(dO ⊙ O), an n × 1 column (FlashAttention's D)."""
    sums: list[Basic] = []
    for a in backward:
        for node in sp.preorder_traversal(a.value):
            if isinstance(node, RowSum) and node != a.value and node not in sums:
                sums.append(node)
    labels = ["D"] if len(sums) == 1 else [f"D{i}" for i in range(1, len(sums) + 1)]
    table = {node: MatrixSymbol(label, *node.shape) for node, label in zip(sums, labels)}
    renamed = [Assignment(a.target, a.value.xreplace(table), a.reduce_batch, a.comment) for a in backward]
    return [Assignment(symbol, node) for node, symbol in table.items()] + renamed


def _needed_forward(forward: list[Assignment], output: MatrixSymbol) -> list[Assignment]:
    """The forward assignments the output depends on (S disappears once folded into A)."""
    keep = _needed(forward, {output})
    return [a for a in forward if a.target in keep]


def _name_constants(forward: list[Assignment], backward: list[Assignment], taken: set) -> tuple:
    """Name each compound scalar factor (1/√d_k → scale) once, so it is computed once."""
    found: list[Basic] = []
    for a in forward + backward:
        for node in sp.preorder_traversal(a.value):
            if isinstance(node, MatMul):
                coeff, _ = _factors(node)
                if coeff.free_symbols and not coeff.is_Symbol and coeff not in found:
                    found.append(coeff)
    labels = iter(["scale", *(f"c{i}" for i in range(1, len(found) + 1))])
    constants = []
    for c in found:
        label = next(label for label in labels if sp.Symbol(label) not in {t.name for t in taken})
        constants.append((sp.Symbol(label, real=True), c))
    table = {c: s for s, c in constants}

    def rename(a: Assignment) -> Assignment:
        return Assignment(a.target, a.value.xreplace(table), a.reduce_batch, a.comment)

    return tuple(constants), [rename(a) for a in forward], [rename(a) for a in backward]


def expand(expr: Basic, definitions: dict[Basic, Basic]) -> Basic:
    """expr with each symbol in definitions replaced by its definition, products flattened."""
    if expr in definitions:
        return definitions[expr]
    if not expr.args or isinstance(expr, MatrixSymbol):
        return expr
    args = [expand(a, definitions) for a in expr.args]
    if isinstance(expr, MatMul):
        coeff, mats = _factors(MatMul(*args))
        return product(coeff, mats)
    return expr.func(*args)


def _needed(assignments: list[Assignment], roots: set) -> set:
    """Targets the roots depend on, the roots included."""
    by_target = {a.target: a for a in assignments}
    needed: set = set()
    stack = list(roots)
    while stack:
        t = stack.pop()
        if t in needed:
            continue
        needed.add(t)
        stack.extend(x for x in by_target[t].value.atoms(MatrixSymbol) if x in by_target)
    return needed
