"""The n × m core a Triton kernel computes: O = N(A) V with A = E(S), S = Q Kᵀ, found in a spec's expression.

Q (n × d), K (m × d) and V (m × d_v) are thin factors, themselves any expressions of the inputs (X W_Q); E is
a chain of entrywise steps on the raw scores S (a scalar times S, n × m inputs and constants added or multiplied
in, trainable scalars, the language's entrywise functions, matrices of positions ``sa.entries``, whole or per head,
computed in the tiles from their positions, reading tables (inputs or constants: ``Core.tables``) at positions by
a gather); N is a row normaliser of ``NORMALISERS``: the row softmax, the division of each row by its sum
(A ⊘ rowsum(A) 𝟏ᵀ, as softplus attention's), or none (P = A, as sigmoid attention's σ(c·S)); P may be dropped
out (P ⊙ Z_p(P), ``sa.dropout`` of the weights: O = (N(A) ⊙ Z_p) V, the mask drawn in the kernels' registers from
a seed); or the core is a map with no V, O = log-softmax(A) (n × m: pointer attention's output, also spelled
log(softmax(A)); no table read).
A scalar c multiplying the scores product goes into E (A = E(c·S)), also where A reads the one product under
several scalars (where(S > 0, S, 0.1 S)); one multiplying the product with V stays outside (c · O). A per-head
constant split_heads(C, H) and a matrix of positions broadcast by ones (𝟏 E 𝟏ᵀ: a constant one per sequence) are
read at positions (``_at_positions``); K of grouped heads may be written RepeatHeads(Kᵀ). What lies outside the
core (the factors' expressions, what the spec makes of O) stays torch: ``Cores.rest`` is the spec's output with
each core's value replaced by its symbol ``output``. A spec may have several cores (differential attention's two),
each computed by its own kernels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import (
    Determinant,
    HadamardPower,
    HadamardProduct,
    Identity,
    Inverse,
    MatAdd,
    MatMul,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)

from symattn.errors import SymattnError
from symattn.lang.functions import Elementwise, Log
from symattn.lang.graph import children, matrix_symbols, postorder
from symattn.lang.indices.bounds import I, J
from symattn.lang.ops import LogSoftmax, RepeatHeads, RowSoftmax, RowSum, SplitHeads, SumEntries
from symattn.lang.ops_block import LayerNorm, RowInvStd
from symattn.lang.piecewise import DropoutMask
from symattn.lang.positions import Entries
from symattn.lang.rowwise import KthLargest, RowWise
from symattn.specs import Spec

WHAT = "no n × m core the Triton kernels cover"
# N of a core: P = softmax(A), A ⊘ rowsum(A) 𝟏ᵀ, A; or O = log-softmax(A), a map with no V
NORMALISERS = ("row softmax", "row sum", "none", "log-softmax")


@dataclass(frozen=True)
class Core:
    """O = N(E(S)) V of a spec; S (the raw scores Q Kᵀ) and O are fresh symbols of the kernels' tiles."""

    query: MatrixExpr  # Q, n × d
    key: MatrixExpr  # K, m × d
    value: MatrixExpr | None  # V, m × d_v (a scalar multiplying P V stays outside, in ``Cores.rest``); None: O = N(A)
    scores: MatrixSymbol  # S = Q Kᵀ, n × m
    logits: MatrixExpr  # A = E(S, tiles, scalars), entrywise
    normaliser: str  # N, one of NORMALISERS
    output: MatrixSymbol  # O = N(A) V, n × d_v
    tiles: tuple[MatrixSymbol, ...]  # the n × m inputs and constants A reads, loaded tile by tile
    scalars: tuple[sp.Symbol, ...]  # the trainable scalars A reads
    grouped: bool = False  # K and V have H_kv heads shared by H query heads (their RepeatHeads left to the kernels)
    dropout: Basic | None = None  # p of O = (N(A) ⊙ Z_p) V, the weights dropped out; None: not dropped
    tables: tuple[MatrixSymbol, ...] = ()  # the inputs and constants A's matrices of positions read at positions


@dataclass(frozen=True)
class Cores:
    """The cores of a spec, each its own kernels, and what the spec's output makes of their outputs."""

    cores: tuple[Core, ...]
    rest: MatrixExpr  # the spec's output, each core's value written as its ``output`` symbol


def find_cores(spec: Spec) -> Cores:
    """The spec's cores O = N(E(Q Kᵀ)) V, a product of a sum of normalised maps with V taken as the sum of the
    products ((P₁ − λ P₂) V = P₁ V − λ P₂ V, differential attention's); a SymattnError of one line naming what is
    missing where there is none, or where the output reads a core's P or scores besides P V."""
    output = _distributed(spec.output)
    nodes = list(dict.fromkeys(x for x in postorder(output) if _core_at(spec, x, MatrixSymbol("O", 1, 1))))
    nodes = [x for x in nodes if not any(x in postorder(y) and x != y for y in nodes)]  # the outermost
    nodes.sort(key=lambda x: str(_factors(x)[1]))  # as the spec names them (P₁ V before P₂ V)
    taken = {str(x.name) for x in (*spec.inputs, *spec.constants)}
    names = ["O"] if len(nodes) == 1 else [f"O{i}" for i in range(1, len(nodes) + 1)]
    names = [name if name not in taken else f"core_{name.lower()}" for name in names]
    cores = tuple(_core_at(spec, x, MatrixSymbol(name, *x.shape)) for x, name in zip(nodes, names))
    rest = output.xreplace({x: _factors(x)[0] * c.output for x, c in zip(nodes, cores)})
    read = set(postorder(rest))
    if not cores or any(x in read for c, node in zip(cores, nodes) for x in _inside(node)):
        raise SymattnError(f"{spec.name}: {WHAT} ({_why_not(spec, output, cores)})")
    mapped = next((c for c in cores if c.tables and c.value is None), None)
    if mapped is not None:
        raise SymattnError(
            f"{spec.name}: a table read at positions ({', '.join(str(t.name) for t in mapped.tables)}) in a "
            "log-softmax map is not in the Triton kernels; use the torch backend"
        )
    inner = next((x for node in nodes for x in _inner_draws(node)), None)
    if inner is not None:
        raise SymattnError(
            f"{spec.name}: dropout inside the scores' steps ({inner.arg}) is not in the Triton kernels, which drop out "
            "the attention weights N(A) only; use the torch backend"
        )
    return Cores(cores, rest)


def _why_not(spec: Spec, output: Basic, cores: tuple[Core, ...]) -> str:
    """Why no core was found, or why the cores found cannot be kernels."""
    if cores:
        return "the output reads P or the scores besides P V: they are never made whole"
    if not _products(output):
        return "no n × m scores product Q Kᵀ of thin factors"
    nodes = list(postorder(output))
    statistic = next((x for x in nodes if isinstance(x, (KthLargest, RowSum)) and _products(x.args[0])), None)
    if statistic is not None:  # (a mask computed per call from the row: top-k, above the row's mean)
        what = "k-th largest" if isinstance(statistic, KthLargest) else "sum"
        return f"A reads a row's {what} of the scores, which the kernels never hold whole"
    if any(isinstance(x, HadamardProduct) and any(isinstance(a, RowSoftmax) for a in x.args) for x in nodes):
        return "the weights multiplied by a matrix after the softmax, (P ⊙ C) V"
    return (
        "no product N(A) V with A entrywise in one scores product Q Kᵀ and N a row softmax, a division by the "
        "row sums or none"
    )


def _log_softmax(node: Basic) -> MatrixExpr | None:
    """A of a map log-softmax(A), also spelled log(softmax(A)) (the kernels' log-softmax equals it, and stays finite
    where softmax underflows to 0); else None."""
    if isinstance(node, LogSoftmax):
        return node.arg
    if isinstance(node, Log) and isinstance(node.args[0], RowSoftmax):
        return node.args[0].arg
    return None


def _inside(node: MatrixExpr) -> tuple[Basic, ...]:
    """What a core's kernels never make whole: its P (a core with V) and its scores product."""
    if _log_softmax(node) is not None:
        return tuple(_products(node.args[0]))
    first = node.as_coeff_matrices()[1][0]
    weights = _dropped(first)[0]  # P, and P ⊙ Z where dropped out
    _, logits = _normalised(weights)
    return (first, weights, *_products(logits))


def _inner_draws(node: MatrixExpr) -> list[DropoutMask]:
    """The dropout masks inside a core's scores' steps A = E(Q Kᵀ): not the weights' own (Z_p(P) of P ⊙ Z_p(P)), nor
    one inside the thin factors Q, K (torch code, drawing as torch does)."""
    logits = _log_softmax(node)
    if logits is None:
        logits = _normalised(_dropped(node.as_coeff_matrices()[1][0])[0])[1]
    thin = {x for product in _products(logits) for x in postorder(product)}
    return [x for x in postorder(logits) if isinstance(x, DropoutMask) and x not in thin]


def _factors(node: MatrixExpr) -> tuple[Basic, list[MatrixExpr]]:
    """(c, [N(A), V₁, …]) of a core's node c · N(A) V₁ …; (1, [L]) of a log-softmax map L."""
    return node.as_coeff_matrices() if isinstance(node, MatMul) else (sp.Integer(1), [node])


def _distributed(output: MatrixExpr) -> MatrixExpr:
    """output with each product (Σ cᵢ Nᵢ) V of a sum of normalised maps Nᵢ (n × m, a row softmax or a division by
    the row sums, each maybe dropped out) written Σ cᵢ (Nᵢ V)."""
    replaced = {}
    for node in postorder(output):
        if not isinstance(node, MatMul):
            continue
        coeff, mats = node.as_coeff_matrices()
        if len(mats) < 2 or not isinstance(mats[0], MatAdd):
            continue
        terms = [_scaled(t) for t in mats[0].args]
        if all(m is not None and _normalised(_dropped(m)[0])[0] != "none" for _, m in terms):
            replaced[node] = MatAdd(*(coeff * c * MatMul(m, *mats[1:]) for c, m in terms))
    return output.xreplace(replaced) if replaced else output


def _scaled(term: MatrixExpr) -> tuple[Basic, MatrixExpr | None]:
    """(c, M) with term = c · M for one matrix M; (1, None) for a product of several."""
    if not isinstance(term, MatMul):
        return sp.Integer(1), term
    coeff, mats = term.as_coeff_matrices()
    return (coeff, mats[0]) if len(mats) == 1 else (sp.Integer(1), None)


def _core_at(spec: Spec, node: Basic, output: MatrixSymbol) -> Core | None:
    """The core whose O is node (a product N(A) V₁ … V_k, or a map log-softmax(A) with no V), its output symbol
    ``output``, or None."""
    if _log_softmax(node) is not None:
        normaliser, logits, thin, dropout = "log-softmax", _log_softmax(node), [], None
    elif isinstance(node, MatMul):
        _, mats = node.as_coeff_matrices()
        if len(mats) < 2 or not isinstance(mats[0], MatrixExpr):
            return None
        weights, dropout = _dropped(mats[0])
        (normaliser, logits), thin = _normalised(weights), mats[1:]
    else:
        return None
    logits = _at_positions(logits, {*spec.inputs, *spec.constants})
    products = list(dict.fromkeys(_products(logits)))
    splits = [_split(p) for p in products]  # each c_k · Q Kᵀ: one Q Kᵀ however scaled (where(s > 0, s, 0.1 s))
    if not products or None in splits or len({(q, k) for _, q, k in splits}) != 1:
        return None
    if not _entrywise(logits, frozenset(products)):
        return None
    if normaliser == "none" and not any(isinstance(x, Elementwise) for x in postorder(logits)):
        return None  # P = c·Q Kᵀ + B with no function: a product of products, not a kernel's core
    _, query, key = splits[0]
    n, m = logits.shape
    scores = MatrixSymbol("S", n, m)
    a = logits.xreplace({p: c * scores if c != 1 else scores for p, (c, _, _) in zip(products, splits)})
    value = None if not thin else MatMul(*thin).doit() if len(thin) > 1 else thin[0]
    read = {t for x in postorder(a) if isinstance(x, Entries) for t in x.tables}  # an index's constants too
    tables = tuple(sorted(read, key=str))
    tiles = tuple(sorted((x for x in matrix_symbols(a) if x != scores and x not in read), key=str))
    allowed = {*spec.inputs, *spec.constants}
    if any(t not in allowed or t.shape != (n, m) for t in tiles) or any(t not in allowed for t in tables):
        return None
    scalars = tuple(x for x in spec.inputs if isinstance(x, sp.Symbol) and x in a.free_symbols)
    grouped = all(isinstance(x, RepeatHeads) for x in (key, value)) and key.args[1:] == value.args[1:]
    if grouped:  # RepeatHeads(A, H_kv, H): H_kv heads read by H query heads, in place by the kernels
        key, value = key.arg, value.arg
    return Core(query, key, value, scores, a, normaliser, output, tiles, scalars, grouped, dropout, tables)


def _dropped(p: MatrixExpr) -> tuple[MatrixExpr, Basic | None]:
    """(P, p) where p = P ⊙ Z_p(P) (``sa.dropout(P, p)``, its product flattened or not: P's own factors beside Z, or
    P); else (p, None)."""
    if not isinstance(p, HadamardProduct):
        return p, None
    masks = [x for x in p.args if isinstance(x, DropoutMask)]
    if len(masks) != 1:
        return p, None
    rest = [x for x in p.args if x is not masks[0]]
    dropped = masks[0].arg
    kept = dropped.args if isinstance(dropped, HadamardProduct) else (dropped,)
    if rest != [dropped] and Counter(kept) != Counter(rest):
        return p, None
    return dropped, masks[0].args[1]


def _normalised(p: MatrixExpr) -> tuple[str, MatrixExpr]:
    """(N, A) with p = N(A): softmax(A); A ⊙ (rowsum(A) 𝟏ᵀ)^∘−1, the row sums' division; else ("none", p)."""
    if isinstance(p, RowSoftmax):
        return "row softmax", p.arg
    if isinstance(p, HadamardProduct) and len(p.args) == 2:
        for a, inverse in (p.args, p.args[::-1]):
            if isinstance(inverse, HadamardPower) and inverse.exp == -1 and _row_sums(inverse.base) == a:
                return "row sum", a
    return "none", p


def _row_sums(x: Basic) -> Basic | None:
    """A where x = rowsum(A) 𝟏ᵀ (the row sums broadcast along the rows), else None."""
    if not isinstance(x, MatMul):
        return None
    coeff, mats = x.as_coeff_matrices()
    if coeff != 1 or len(mats) != 2 or not isinstance(mats[0], RowSum) or not isinstance(mats[1], OneMatrix):
        return None
    return mats[0].arg


def _products(e: Basic) -> list[MatMul]:
    """The scores products Q Kᵀ of thin factors in e, the outermost: a product inside another's factors is that
    factor's own work (x W_Qᵀ inside (x W_Qᵀ)(x W_Kᵀ)ᵀ, a projection in torch's layout)."""
    found = [x for x in postorder(e) if isinstance(x, MatMul) and _scores_product(x)]
    inner = {y for x in found for y in postorder(*x.args) if y is not x}
    return [x for x in found if x not in inner]


def _scores_product(node: MatMul) -> bool:
    """Is node a product of two or more matrices whose result is wider than some factor inside it (n × m from
    thin factors)?"""
    _, mats = node.as_coeff_matrices()
    return len(mats) >= 2 and _split(node) is not None


def _split(product: MatMul) -> tuple[Basic, MatrixExpr, MatrixExpr] | None:
    """(c, Q, K) with product = c · Q Kᵀ: the cut of its factors whose right part is all transposes (X W_Q ·
    W_Kᵀ Xᵀ), else the first whose right part starts with one, else a last factor that is a sum (a sum's transpose
    as SymPy distributes it: (X W_Kᵀ + 𝟏 b_K)ᵀ = W_K Xᵀ + b_Kᵀ 𝟏ᵀ); the inner dimension is neither of the
    result's."""
    coeff, mats = product.as_coeff_matrices()
    n, m = product.shape
    cuts = [i for i in range(1, len(mats)) if mats[i].shape[0] not in (n, m)]
    transposed = [i for i in cuts if all(_is_transpose(f) for f in mats[i:])]
    transposed += [i for i in cuts if _is_transpose(mats[i])]
    transposed += [i for i in cuts if i == len(mats) - 1 and isinstance(mats[i], MatAdd)]
    if not transposed:
        return None
    i = transposed[0]
    left = MatMul(*mats[:i]).doit() if i > 1 else mats[0]
    right = MatMul(*mats[i:]).doit() if len(mats) - i > 1 else mats[i]
    return coeff, left, _transposed(right)


def _is_transpose(x: MatrixExpr) -> bool:
    """Is x a transpose Yᵀ, or the heads of one repeated (RepeatHeads(Yᵀ) = RepeatHeads(Y)ᵀ: each head's block
    transposed)?"""
    return isinstance(x.arg if isinstance(x, RepeatHeads) else x, Transpose)


def _transposed(x: MatrixExpr) -> MatrixExpr:
    """xᵀ, the transpose taken inside a repetition of heads (K of RepeatHeads(Kᵀ), grouped heads however spelt)."""
    if isinstance(x, RepeatHeads):
        return RepeatHeads(_transposed(x.arg), *x.args[1:])
    return Transpose(x).doit()


def _at_positions(logits: MatrixExpr, allowed: set) -> MatrixExpr:
    """logits with each per-head constant split_heads(C, H) (C an input or constant, n × H·m) written as the
    matrix of positions [C_ij] split into the heads, and each matrix of positions r × c broadcast along the rows or
    the columns by ones (𝟏 E, E 𝟏ᵀ, 𝟏 E 𝟏ᵀ, a 1 × 1 or per-key constant one per sequence) as the n × m matrix of
    positions reading E at row 0 or column 0: the same entries, which the kernels read at positions."""
    replaced: dict[Basic, Basic] = {}
    thin = {y for product in _products(logits) for y in postorder(product)}  # Q and K's own: left as they are
    for x in postorder(logits):
        if x in thin:
            continue
        new = x.xreplace(replaced)  # (its arguments rewritten)
        if isinstance(new, SplitHeads) and new.arg in allowed:
            new = SplitHeads(_read(new.arg), new.heads)
        elif isinstance(new, MatMul):
            new = _broadcast(new) or new
        if new != x:
            replaced[x] = new
    return logits.xreplace(replaced) if replaced else logits


def _read(table: MatrixSymbol) -> Entries:
    """The matrix of positions [T_ij] of a table T."""
    return Entries(*table.shape, sp.Lambda((I, J), table[I, J]))


def _broadcast(node: MatMul) -> MatrixExpr | None:
    """𝟏_{n×1} E 𝟏_{1×m} (either ones may be absent) of a matrix of positions E (whole, or per head: H 1-column heads
    side by side), as the n × m matrix of positions (per head); else None."""
    coeff, mats = node.as_coeff_matrices()
    left = len(mats) > 1 and isinstance(mats[0], OneMatrix) and mats[0].shape[1] == 1
    right = len(mats) > 1 and isinstance(mats[-1], OneMatrix) and mats[-1].shape[0] == 1
    inner = mats[int(left) : len(mats) - int(right)]
    if coeff != 1 or not (left or right) or len(inner) != 1:
        return None
    (e,) = inner
    heads = e.heads if isinstance(e, SplitHeads) else None
    table = e.arg if heads is not None else e
    if not isinstance(table, Entries) or (right and e.shape[1] != 1):
        return None
    n, m = node.shape
    formula = table.formula.xreplace({I: sp.S.Zero} if left else {})
    if right:  # column J of the heads side by side: head ⌊J/m⌋, column 0 of E's head (E's column ⌊J/m⌋)
        formula = formula.xreplace({J: sp.floor(J / m) if heads is not None else sp.S.Zero})
    whole = Entries(n, m * heads if heads is not None else m, sp.Lambda((I, J), formula))
    return SplitHeads(whole, heads) if heads is not None else whole


def _entrywise(value: Basic, scores: frozenset[MatMul]) -> bool:
    """Is value made entry by entry from the scores products' entries (sums, ⊙, powers, scalar multiples, the
    language's entrywise functions, n × m symbols and ones, matrices of positions, whole or per head)? scores: the
    spellings c_k · Q Kᵀ of the one product, each n × m."""
    if value in scores or not isinstance(value, MatrixExpr):
        return True
    if isinstance(value, MatMul):
        if sum(isinstance(f, MatrixExpr) for f in value.args) > 1:
            return False
    elif isinstance(value, (OneMatrix, MatrixSymbol, Entries)):
        return value.shape == next(iter(scores)).shape
    elif isinstance(value, SplitHeads):  # a matrix of positions per head: the kernels read the program's head
        return isinstance(value.arg, Entries) and value.shape == next(iter(scores)).shape
    elif not isinstance(value, (MatAdd, HadamardProduct, HadamardPower, Elementwise)):
        return False
    return all(_entrywise(a, scores) for a in value.args)


SHAPED = (OneMatrix, ZeroMatrix, Identity)  # nodes whose arguments are their sizes, not scalars of the math
ALONG_ROWS = (RowSum, RowWise, LayerNorm, RowInvStd, KthLargest)  # each row of the output from its argument's row
WHOLE = (SumEntries, Trace, Inverse, Determinant)  # every entry of the output from every entry of the argument


def mixed_rows(cores: Cores) -> str | None:
    """Why the work outside the spec's cores mixes rows of the sequence, or None where it is row-local: each row of
    the output (and of every core's Q, K and V) reads only the same row of the inputs, what a ring of ranks that
    each hold a block of the rows needs (``symattn.distributed``). The sequence's axes are the cores' query and key
    lengths; a product summing over one, a row-wise step along one, a whole-matrix function of one, the output
    with a column per position, or a length read as a number (the rank's, not the sequence's) mixes rows."""
    sequence = {x for core in cores.cores for x in (core.query.shape[0], core.key.shape[0]) if isinstance(x, sp.Symbol)}
    if cores.rest.shape[1] in sequence:
        return f"the output {cores.rest} has a column per position ({cores.rest.shape[1]})"
    outside = [cores.rest, *(x for c in cores.cores for x in (c.query, c.key, c.value) if x is not None)]
    for node in postorder(*outside):
        why = _mixes(node, sequence)
        if why:
            return f"{node} {why}"
    return None


def _mixes(node: Basic, sequence: set[sp.Symbol]) -> str | None:
    """How node mixes rows of the sequence (its axes: sequence), or None."""
    if isinstance(node, MatMul):
        factors = node.as_coeff_matrices()[1]
        summed = [a.shape[1] for a in factors[:-1] if a.shape[1] in sequence]
        if summed:
            return f"sums over the sequence ({summed[0]})"
    if isinstance(node, ALONG_ROWS) and node.args[0].shape[1] in sequence:
        return f"works along the sequence ({node.args[0].shape[1]})"
    if isinstance(node, WHOLE) and set(node.args[0].shape) & sequence:
        return "reads the whole sequence"
    if isinstance(node, (MatrixSymbol, *SHAPED)):
        return None
    read = {x for a in children(node) if not isinstance(a, MatrixExpr) for x in a.free_symbols & sequence}
    return f"reads the sequence's length {sorted(read, key=str)[0]} as a number" if read else None
