"""The op table: each torch operation ``from_torch`` reads, by the name torch calls it, and its rule.

A rule takes the trace, the call's arguments and its result, and returns the result's ``Value``. An
operation that is not here is refused with its name and the user's line. In-place forms (``add_``) are the
same rules: the tensor keeps its identity and takes the new value.
"""

from __future__ import annotations

from collections.abc import Callable

from symattn.lang.functions import FUNCTIONS, TORCH, Elementwise, Gelu
from symattn.lang.rowwise import LogSoftmax, RowSoftmax
from symattn.trace import algebra, layers, layout
from symattn.trace.forms import blocks, groups, head_parameters, masks, merged, piecewise, rotary, shift, tables

Rule = Callable[..., object]

OPS: dict[str, Rule] = {
    # products: A B over the last two axes
    "matmul": layout.matmul,  # A @ B
    "__matmul__": layout.matmul,
    "__rmatmul__": layout.rmatmul,
    "bmm": layout.matmul,
    "mm": layout.matmul,
    "linear": layout.linear,  # x Wᵀ + 𝟏 b, W (out, in)
    "addmm": blocks.addmm,  # β 𝟏 b + α X W: GPT-2's Conv1D, on flattened rows; β C + α X W
    "baddbmm": merged.baddbmm,  # β C + α A B, batched: BLOOM's, GPT-NeoX's scores
    "einsum": layout.einsum,  # two operands: A B, A Bᵀ, Aᵀ B, … batched
    # layouts
    "transpose": layout.transpose,  # (−2, −1): Aᵀ; (1, 2) of (…, n, H, d): into heads and back
    "swapaxes": layout.transpose,
    "swapdims": layout.transpose,
    "mT": layout.matrix_transpose,  # Aᵀ
    "T": layout.full_transpose,  # Aᵀ of a 2-D tensor
    "t": layout.full_transpose,
    "permute": blocks.permute,  # and a fused projection's (2, 0, 3, 1, 4)
    "view": blocks.reshape,  # (…, n, H·d) ↔ (…, n, H, d); (…, n, c) ↔ (B·n, c); (…, n, k·H·d) → (…, n, k, H, d)
    "reshape": blocks.reshape,
    "flatten": blocks.reshape,
    "unflatten": blocks.reshape,
    "contiguous": layout.same,  # identity
    "clone": layout.same,
    "detach": layout.detach,  # sg(A): the value, differentiated as a constant
    "data": layout.detach,
    "float": layout.same,
    "double": layout.same,
    "to": layout.same,
    "type_as": layout.same,
    "type": layout.same,  # .type(dtype)
    "dropout": layout.dropout,  # identity in eval()
    # entrywise arithmetic, torch's broadcasting
    "add": algebra.binary("add"),  # A + B
    "add_": algebra.binary("add"),
    "__add__": algebra.binary("add"),
    "__radd__": algebra.binary("add", reverse=True),
    "__iadd__": algebra.binary("add"),
    "sub": algebra.binary("sub"),  # A − B
    "sub_": algebra.binary("sub"),
    "__sub__": algebra.binary("sub"),
    "__rsub__": algebra.binary("sub", reverse=True),
    "rsub": algebra.binary("sub", reverse=True),
    "mul": algebra.binary("mul"),  # A ⊙ B, c A
    "mul_": algebra.binary("mul"),
    "__mul__": algebra.binary("mul"),
    "__rmul__": algebra.binary("mul", reverse=True),
    "div": algebra.binary("div"),  # A ⊙ B^∘(−1), A / c
    "div_": algebra.binary("div"),
    "true_divide": algebra.binary("div"),
    "__truediv__": algebra.binary("div"),
    "__rdiv__": algebra.binary("div", reverse=True),
    "__rtruediv__": algebra.binary("div", reverse=True),
    "pow": algebra.binary("pow"),  # A^∘k
    "__pow__": algebra.binary("pow"),
    "neg": algebra.negative,  # −A
    "__neg__": algebra.negative,
    # entrywise functions: the records' own (below); powers
    "sqrt": algebra.power("sqrt"),  # A^∘½
    "rsqrt": algebra.power("rsqrt"),
    "reciprocal": algebra.power("reciprocal"),
    "square": algebra.power("square"),
    **piecewise.OPS,  # clamp, clip, clamp_min/max, hardtanh, leaky_relu (and in place): the records' nodes
    Gelu.function: layers.gelu,  # F.gelu, exact and tanh forms
    # row-wise
    RowSoftmax.function: algebra.row_function(RowSoftmax),  # over dim=-1
    LogSoftmax.function: algebra.row_function(LogSoftmax),
    "max": shift.row_max,  # the row max, read only as a softmax's shift (forms.shift)
    "amax": shift.row_max,
    "sum": algebra.reduction("sum"),  # rowsum(A) (keepdim) or sum(A)
    "mean": algebra.reduction("mean"),
    "norm": algebra.norm,  # (rowsum(A^∘2))^∘½
    "linalg_vector_norm": algebra.norm,
    "normalize": algebra.normalize,  # each row / its norm
    "layer_norm": layers.layer_norm,  # LN(A) ⊙ 𝟏γ + 𝟏β
    # masks: the additive constant M; a mask computed per call from traced values (forms.masks)
    "masked_fill": masks.masked_fill,  # A + M; A + keep(K)
    "masked_fill_": masks.masked_fill,
    "where": masks.where,  # A ⊙ K + B ⊙ (𝟏𝟏ᵀ − K)
    **masks.OPS,  # comparisons, & | ^ ~ of masks, topk, sort, kthvalue
    "scaled_dot_product_attention": layers.scaled_dot_product_attention,  # softmax(Q Kᵀ/√d + M) V
    # blocks of a fused projection: the pieces' column blocks, W[:, a:b] (forms.blocks)
    "split": blocks.split,
    "chunk": blocks.split,
    "unbind": blocks.unbind,
    "__getitem__": blocks.getitem,  # qkv[i], fused[..., i, :]; x[..., a:b] = x S; x[:, :, None]; x[:, h0:h1]
    # rotary embeddings and grouped key/value heads (forms.rotary)
    "cat": rotary.cat,  # Σ A_i E_i; cat((−x₂, x₁), -1) = x R
    "concat": rotary.cat,
    "concatenate": rotary.cat,
    "stack": rotary.stack,  # then flatten(-2): interleaved
    "expand": rotary.expand,  # repeat_kv's; one head to H (forms.groups)
    "expand_as": rotary.expand_as,  # of a constant (a mask to the scores' shape): a constant
    # heads chosen, one head broadcast, key/value heads repeated (forms.groups)
    "narrow": groups.narrow,  # x.narrow(1, h0, k): split_heads(A S, k)
    "unsqueeze": groups.unsqueeze,  # (…, n, d) → (…, 1, n, d): one head
    "repeat_interleave": groups.repeat_interleave,  # repeat_heads(A, H_kv, r·H_kv)
    "repeat": groups.repeat,  # of one head: repeat_heads(A, 1, H)
    # refused with a reason of their own
    **dict.fromkeys(("select", "index_select", "gather"), layout.indexing),
    "embedding": tables.embedding,  # a parameter read at positions (nn.Embedding): sa.entries per head
}


def _per_token(ops: dict) -> dict[str, int]:
    """The operations that act on each token's features alone (the last axis; entrywise), by name: how many of
    their leading arguments are data (the rest weights). On a tensor sequence first, (n, B, c), they compute what
    they compute on (B, n, c), so the reader reads them in either layout (``tracer.Trace.per_token``)."""
    binary = {name for name, rule in ops.items() if getattr(rule, "binary", False)}
    unary = {"neg", "__neg__", "sqrt", "rsqrt", "reciprocal", "square", "dropout", "layer_norm", "linear"}
    unary |= {Gelu.function, RowSoftmax.function, LogSoftmax.function, *piecewise.OPS}
    unary |= {name for name, rule in ops.items() if getattr(rule, "record", None) is not None}
    return {**dict.fromkeys(binary, 2), **dict.fromkeys(unary, 1)}


def _torch_name(record: type) -> str | None:
    """The torch function an entrywise record calls (torch.exp → exp), None for a helper of symattn's."""
    call = record.calls.get(TORCH, "")
    for prefix in ("torch.nn.functional.", "torch."):
        if call.startswith(prefix) and call[len(prefix) :].isidentifier():
            return call[len(prefix) :]
    return None


# every exported entrywise function record, by the torch function it calls: exp, log, tanh, sigmoid, softplus
OPS.update(
    {
        _torch_name(r): algebra.function(r)
        for r in FUNCTIONS.values()
        if issubclass(r, Elementwise) and r.exported and _torch_name(r)
    }
)

# a parameter with a heads axis lined up with the heads, or cut to lengths, by any of these: read per head first
OPS.update({name: head_parameters.first(OPS[name], name) for name in ("view", "reshape", "__getitem__", "unsqueeze")})

PER_TOKEN = _per_token(OPS)
