"""Rules for products and layouts: matmul, linear, transposes, and the view into heads and back.

The multi-head pattern is a small state machine on a value's ``pending``: a view (…, n, H·d) → (…, n, H, d)
is ``split_heads`` waiting for its transpose(1, 2); then the value is per-head (…, H, n, d) and every rule
acts on each head at once; a transpose(1, 2) back waits for the view (…, n, H·d), which is ``merge_heads``.
"""

from __future__ import annotations

from sympy import Basic
from sympy.matrices.expressions import OneMatrix, Transpose

from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.ops import merge_heads, repeat_heads, split_heads
from symattn.lang.piecewise import DropoutMask
from symattn.trace.tracer import MaskArgument, Trace
from symattn.trace.values import GUARDED, Refused, Value, stopped


def argument(args: tuple, kwargs: dict, index: int, name: str, default: object = None) -> object:
    """A call's argument by position or keyword."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def matrix(v: Value, what: str = "operand", flat: bool = False) -> Value:
    """v, which must be a whole matrix (not a 0-d number, nor halfway through the split into heads; flattened rows
    (B·n, c) where ``flat``: a product's left factor)."""
    if v.is_scalar:
        raise Refused(f"the {what} is a 0-d tensor; a matrix was expected")
    if v.pending == "flat" and not flat:
        raise Refused(f"the {what} is a view of the rows of every sequence as one matrix (B·n, c); read: a product")
    if v.pending in ("fused", "fused_view"):
        raise Refused(f"the {what} is a fused projection's view; read: its pieces by unbind(0) or [i]")
    if v.pending == "split":
        raise Refused("right after a view into heads (…, n, H, d) only transpose(1, 2) is in symattn's language")
    if v.pending == "merge":
        raise Refused("after transposing heads back (…, n, H, d) only a view or reshape to (…, n, H·d) is supported")
    if v.pending == "repeat":
        raise Refused("key/value heads with an axis added (repeat_kv): read are expand, then reshape to (B, H, n, d)")
    if v.pending == "stacked":
        raise Refused("a stack along a new last axis: read is flatten(-2) of it (an interleaved rotary embedding)")
    if v.pending in GUARDED:
        raise Refused(GUARDED[v.pending])
    if v.pending not in (None, "flat"):
        raise Refused(f"the {what} is halfway through a reshape ({v.pending})")
    return v


def same_heads(*values: Value, broadcast: bool = False) -> int | None:
    """The head count shared by the operands: a plain operand broadcasts over the heads (size 1 or no axis -3); with
    ``broadcast`` (a product, an entrywise operation) one head meets H heads as torch broadcasts it (multi-query
    keys and values), which ``at_heads`` makes explicit."""
    counts = {v.heads for v in values if v.heads is not None}
    if broadcast and len(counts) == 2 and 1 in counts:
        counts.discard(1)
    if len(counts) > 1:
        raise Refused(f"operands with {' and '.join(map(str, sorted(counts)))} heads")
    if counts:
        for v in values:
            if v.heads is None and len(v.shape) >= 3 and v.shape[-3] != 1:
                raise Refused(
                    f"a tensor of shape {tuple(v.shape)} meets per-head values: a per-head operand must come from "
                    "the view into heads (a tensor shared by the heads has size 1 or no axis there)"
                )
            if v.heads is None and any(size != 1 for size in v.shape[:-3]):
                raise Refused(
                    f"a tensor with batch axes, of shape {tuple(v.shape)}, meets per-head values: symattn shares "
                    "with every head only tensors without batch axes (parameters, buffers; masks through masked_fill)"
                )
    return counts.pop() if counts else None


def at_heads(v: Value, heads: int | None) -> Basic:
    """v's expression at the operation's heads: one head (…, 1, n, d) meeting H is repeat_heads(A, 1, H), every
    query head reading the one block (its cotangent the sum over the H heads); else as it is."""
    if v.heads == 1 and heads is not None and heads > 1:
        return repeat_heads(v.expr, 1, heads)
    return v.expr


def transposed(e):
    """eᵀ: a symbol's Transpose node, (Aᵀ)ᵀ = A, else one Transpose node."""
    if isinstance(e, Transpose):
        return e.arg
    return Transpose(e)


def matmul(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """A @ B (matmul, bmm, mm, @): the matrix product of the last two axes, batched over the rest."""
    x, y = args[0], argument(args, kwargs, 1, "other", kwargs.get("mat2"))
    return _product(t, x, y, result)


def rmatmul(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """other @ self."""
    return _product(t, args[1], args[0], result)


def _product(t: Trace, x: object, y: object, result) -> Value:
    a, b = matrix(t.value(x), "left factor", flat=True), matrix(t.value(y), "right factor")
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise Refused("a product with a 1-D tensor (a vector) is not a matrix product of symattn's language")
    heads = same_heads(a, b, broadcast=True)
    t.dims.equate(a.cols, b.rows)
    a, b = t.value(x), t.value(y)
    t.dims.contracted.append(a.cols)
    expr = product(at_heads(a, heads), at_heads(b, heads))
    return Value(expr, tuple(result.shape), heads, a.pending, inner=a.cols, layout=a.layout)


def _subscripts(text: str) -> list[str]:
    """The axes of one einsum operand: letters, "..." one token for the leading axes."""
    return ["..." if c == "." else c for c in text.replace("...", ".")]


def einsum(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """torch.einsum of two operands that is a batched matrix product, with transposes: "…ij,…kj->…ik" is
    A Bᵀ, "bhid,bhjd->bhij" per head, "…ji,…jk->…ki" Aᵀ B (the leading axes the same in both and the output).
    """
    equation, operands = args[0], args[1:]
    if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
        operands = tuple(operands[0])
    lhs, _, out = equation.replace(" ", "").partition("->")
    parts = lhs.split(",")
    if len(parts) != 2 or len(operands) != 2 or not out:
        raise Refused(f"einsum {equation!r}: read are two operands and an explicit output (…ij,…jk->…ik)")
    a, b, o = _subscripts(parts[0]), _subscripts(parts[1]), _subscripts(out)
    if min(len(a), len(b), len(o)) < 2 or not a[:-2] == b[:-2] == o[:-2]:
        raise Refused(f"einsum {equation!r}: the leading axes must be the same in both operands and the output")
    shared = [c for c in a[-2:] if c in b[-2:] and c not in o]
    if len(shared) != 1:
        raise Refused(f"einsum {equation!r}: one index must be summed over, shared by the last two axes of both")
    c = shared[0]
    free_a, free_b = (x for x in a[-2:] if x != c), (x for x in b[-2:] if x != c)
    free_a, free_b = next(free_a), next(free_b)
    if o[-2:] not in ([free_a, free_b], [free_b, free_a]):
        raise Refused(f"einsum {equation!r}: the output must hold the two free indices")
    x, y = operands
    va, vb = matrix(t.value(x), "first operand"), matrix(t.value(y), "second operand")
    heads = same_heads(va, vb, broadcast=True)
    left = (lambda e: e) if a[-1] == c else transposed
    right = (lambda e: e) if b[-2] == c else transposed
    t.dims.equate(va.cols if a[-1] == c else va.rows, vb.rows if b[-2] == c else vb.cols)
    va, vb = t.value(x), t.value(y)
    inner = va.cols if a[-1] == c else va.rows
    t.dims.contracted.append(inner)
    expr = product(left(at_heads(va, heads)), right(at_heads(vb, heads)))
    if o[-2:] == [free_b, free_a]:
        expr = transposed(expr)
    return Value(expr, tuple(result.shape), heads, inner=inner)


def linear(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.linear(x, W, b) = x Wᵀ + 𝟏 b, W in torch's (out, in) layout (nn.Linear's weight)."""
    x, w, b = args[0], argument(args, kwargs, 1, "weight"), argument(args, kwargs, 2, "bias")
    xv, wv = matrix(t.value(x), "input", flat=True), matrix(t.value(w), "weight")
    if len(wv.shape) != 2:
        raise Refused(f"a weight of shape {tuple(wv.shape)}; linear takes a 2-D (out, in) weight")
    t.dims.equate(xv.cols, wv.cols)
    if b is not None:
        t.dims.equate(t.value(b).cols, t.value(w).rows)
    xv, wv = t.value(x), t.value(w)
    t.dims.contracted.append(xv.cols)
    out = product(xv.expr, transposed(wv.expr))
    if b is not None:
        out = total(out, product(OneMatrix(xv.rows, 1), t.value(b).expr))
    return Value(out, tuple(result.shape), xv.heads, xv.pending, inner=xv.cols, layout=xv.layout)


def _axis(a: int, ndim: int) -> int:
    return a - ndim if a >= 0 else a


def swap(v: Value, pair: tuple[int, int], result) -> Value:
    """The transpose of two axes: the last two (a matrix transpose), or −3 and −2 (into heads and back)."""
    shape = tuple(result.shape)
    if pair == (-2, -1):
        v = matrix(v)
        return Value(transposed(v.expr), shape, v.heads)
    if pair == (-3, -2) and len(shape) == 3 and v.heads is None and v.pending in (None, "seq_first"):
        return Value(v.expr, shape, pending=None if v.pending else "seq_first")  # (B, n, c) ↔ (n, B, c)
    if pair == (-3, -2) and v.pending == "split":
        return Value(v.expr, shape, v.heads)
    if pair == (-3, -2) and v.pending is None and v.heads is not None:
        return Value(v.expr, shape, v.heads, pending="merge")
    raise Refused(
        f"a transpose of axes {pair} of shape {tuple(v.shape)}: symattn transposes the last two axes, and moves "
        "heads only as view(…, n, H, d) then transpose(1, 2), and back"
    )


def transpose(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """transpose(a, b) / swapaxes / swapdims."""
    v = t.value(args[0])
    a, b = argument(args, kwargs, 1, "dim0"), argument(args, kwargs, 2, "dim1")
    pair = sorted((_axis(a, len(v.shape)), _axis(b, len(v.shape))))
    return swap(v, tuple(pair), result)


def matrix_transpose(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """.mT: the transpose of the last two axes."""
    return swap(t.value(args[0]), (-2, -1), result)


def full_transpose(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """.T and t() of a 2-D tensor (of more axes, .T reverses them all: not a matrix transpose)."""
    v = t.value(args[0])
    if len(v.shape) != 2:
        raise Refused(f".T of a tensor of shape {tuple(v.shape)}; use .mT or transpose(-2, -1)")
    return swap(v, (-2, -1), result)


# a permutation of the last three axes as the transposes it is made of (a 2-D tensor's (1, 0) is Aᵀ)
_PERMUTATIONS = {
    (0, 1, 2): (),
    (0, 2, 1): ((-2, -1),),  # Aᵀ
    (1, 0, 2): ((-3, -2),),  # into heads, or back
    (1, 2, 0): ((-3, -2), (-2, -1)),  # into heads, then each head's transpose
    (0, 1): (),
    (1, 0): ((-2, -1),),
}


def permute(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """permute: the transposes above, one or two of them, on the last three axes (the leading ones kept)."""
    v = t.value(args[0])
    dims = argument(args, kwargs, 1, "dims")
    nd = len(v.shape)
    dims = tuple(d % nd for d in (dims if isinstance(dims, (tuple, list)) else args[1:]))
    lead = max(nd - 3, 0)
    swaps = _PERMUTATIONS.get(tuple(d - lead for d in dims[lead:]))
    if dims[:lead] != tuple(range(lead)) or swaps is None:
        raise Refused(f"the permutation {dims} of shape {tuple(v.shape)}")
    for pair in swaps:
        v = swap(v, pair, result)
    return Value(v.expr, tuple(result.shape), v.heads, v.pending)


def reshape(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """view / reshape / flatten / unflatten: the same shape, the split into heads, or the merge back."""
    x = args[0]
    v = t.value(x)
    old, new = tuple(v.shape), tuple(result.shape)
    if old == new:
        return Value(v.expr, new, v.heads, v.pending)
    splits = len(new) == len(old) + 1 and new[:-2] == old[:-1] and new[-2] * new[-1] == old[-1]
    if splits and v.pending is None and v.heads is None and len(old) >= 2:
        heads = new[-2]
        t.dims.divisible(v.cols, heads)
        return Value(split_heads(t.value(x).expr, heads), new, heads, pending="split")
    merges = len(new) == len(old) - 1 and new[:-1] == old[:-2] and new[-1] == old[-2] * old[-1]
    if merges and v.pending == "merge":
        return Value(merge_heads(v.expr, v.heads), new)
    raise Refused(
        f"a reshape from {old} to {new}: symattn's language has the view into heads (…, n, H·d) → (…, n, H, d) "
        "(then transpose(1, 2)) and the view back, no other"
    )


def same(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """contiguous, clone, float, to, type_as: the same values."""
    v = t.value(args[0])
    return Value(v.expr, tuple(result.shape), v.heads, v.pending, layout=v.layout)


def detach(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """detach(), .data: the value as a stop-gradient."""
    return stopped(t.value(args[0]))


def dropout(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.dropout, nn.Dropout: in evaluation (training=False) or with p = 0 the identity; while training
    A ⊙ Z_p(A), Z_p the mask the generated forward draws from torch's generator (``sa.dropout``)."""
    p, training = argument(args, kwargs, 1, "p", 0.5), argument(args, kwargs, 2, "training", True)
    if not training or p == 0:
        return same(t, args, kwargs, result)
    v = t.value(args[0])
    if v.is_scalar or v.pending is not None:
        raise Refused("dropout of a number or of a view halfway into heads (symattn drops out matrices)")
    expr = hadamard_product(v.expr, drawn(t, DropoutMask(v.expr, float(p))))
    return Value(expr, tuple(result.shape), v.heads, inner=v.inner, layout=v.layout)


def drawn(t: Trace, mask: DropoutMask) -> DropoutMask:
    """A dropout's mask, the trace's first of its values and p: the language's one node for both would share one
    draw where the code draws twice (two dropouts of the same values, independent masks), so a second is refused."""
    if mask in t.drawn:
        raise Refused(
            f"a second dropout (p={mask.args[1]}) of values already dropped out: the language draws one mask for both, "
            "the code two independent ones"
        )
    t.drawn.add(mask)
    return mask


def indexing(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """Indexing a traced tensor: a slice of a matrix is not in symattn's language. A float argument with batch
    axes sliced as it is (``attention_mask[:, :, :, :m]`` in eager attention) is traced again as a constant, the
    slice kept in the constant program (``MaskArgument``)."""
    why = "indexing or slicing a traced tensor is not in symattn's language (slice constants only)"
    if id(args[0]) in t.floats:
        raise MaskArgument(t.floats[id(args[0])], why)
    raise Refused(why)
