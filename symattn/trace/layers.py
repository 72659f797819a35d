"""Rules for the layers attention code calls: layer_norm, gelu and scaled_dot_product_attention.

LayerNorm is block.py's form, LN(A) ⊙ 𝟏γ + 𝟏β with LN each row standardised by its biased variance plus
eps; GELU is symattn's node in torch's two forms (exact erf, approximate="tanh"); F.scaled_dot_product_attention
is softmax(scale · Q Kᵀ + M) V with scale 1/√d_k unless given and M its mask.
"""

from __future__ import annotations

import sympy as sp
import torch
from sympy.matrices.expressions import OneMatrix, Transpose

from symattn.lang import ops
from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.piecewise import DropoutMask
from symattn.trace.forms.heads import across_heads
from symattn.trace.layout import argument, at_heads, drawn, matrix, same_heads
from symattn.trace.tracer import MaskArgument, Trace
from symattn.trace.values import Refused, Value


def layer_norm(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.layer_norm(x, (d,), γ, β, eps) = LN(x) ⊙ 𝟏γ + 𝟏β over the last axis."""
    x = args[0]
    shape = argument(args, kwargs, 1, "normalized_shape")
    gamma, beta = argument(args, kwargs, 2, "weight"), argument(args, kwargs, 3, "bias")
    eps = argument(args, kwargs, 4, "eps", 1e-5)
    v = matrix(t.value(x))
    if tuple(shape) != (v.shape[-1],):
        raise Refused(f"layer_norm over {tuple(shape)}; read: over the last axis only, normalized_shape=(d,)")
    for p in (gamma, beta):
        if p is not None:
            t.dims.equate(t.value(p).cols, t.value(x).cols)
    v = t.value(x)
    ones = OneMatrix(v.rows, 1)
    expr = ops.layer_norm(v.expr, t.number(eps))
    if gamma is not None:
        expr = hadamard_product(expr, product(ones, t.value(gamma).expr))
    if beta is not None:
        expr = total(expr, product(ones, t.value(beta).expr))
    return Value(expr, tuple(result.shape), v.heads)


def gelu(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.gelu(x, approximate="none" | "tanh"): symattn's GELU node of that form."""
    v = matrix(t.value(args[0]))
    approximate = argument(args, kwargs, 1, "approximate", "none")
    return Value(ops.gelu(v.expr, approximate), tuple(result.shape), v.heads)


def _grouped(t: Trace, qkv: tuple, gqa: bool) -> tuple[Value, Value, Value]:
    """The values of q, k, v; with enable_gqa, key and value heads repeated to the query's (repeat_heads)."""
    qv, kv, vv = (matrix(t.value(z)) for z in qkv)
    if gqa and (kv.heads is None or qv.heads is None) and len(qv.shape) > 2 and qv.shape[-3] != kv.shape[-3]:
        raise Refused("enable_gqa of tensors not split into heads by a view (…, n, H, d) and transpose(1, 2)")
    if not gqa or kv.heads is None or qv.heads is None or kv.heads == qv.heads:
        return qv, kv, vv
    if qv.heads % kv.heads or vv.heads != kv.heads:
        raise Refused(f"enable_gqa with {qv.heads} query heads and {kv.heads} key heads (read: a divisor)")
    kv, vv = (Value(ops.repeat_heads(x.expr, x.heads, qv.heads), x.shape, qv.heads) for x in (kv, vv))
    return qv, kv, vv


def scaled_dot_product_attention(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale) = softmax(s Q Kᵀ + M) V; enable_gqa
    repeats the key and value heads to the query's (``repeat_heads``).

    A bool attn_mask is True where attention is allowed (torch's convention), a float one is added; is_causal
    adds the causal mask (a constant made here, −∞ above the diagonal).
    """
    q, k, v = args[0], argument(args, kwargs, 1, "key"), argument(args, kwargs, 2, "value")
    mask = argument(args, kwargs, 3, "attn_mask")
    dropout, causal = argument(args, kwargs, 4, "dropout_p", 0.0), argument(args, kwargs, 5, "is_causal", False)
    scale = argument(args, kwargs, 6, "scale")
    qv, kv, vv = _grouped(t, (q, k, v), kwargs.get("enable_gqa", False))
    heads = same_heads(qv, kv, vv, broadcast=True)
    t.dims.equate(qv.cols, kv.cols)
    t.dims.equate(t.value(k).rows, t.value(v).rows)
    qv, kv, vv = _grouped(t, (q, k, v), kwargs.get("enable_gqa", False))
    t.dims.contracted.append(qv.cols)
    s = product(at_heads(qv, heads), Transpose(at_heads(kv, heads)))
    factor = 1 / sp.sqrt(qv.cols) if scale is None else t.value(scale, (qv.cols,)).expr
    a = product(factor, s)
    like = Value(a, (*result.shape[:-1], kv.shape[-2]), heads)
    if causal:
        rows, cols = qv.shape[-2], kv.shape[-2]
        built = torch.ones(rows, cols, dtype=torch.bool).triu(1)
        a = total(a, t.constant(built, "additive", like=like).expr)
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.ndim > 2 and id(mask) in t.floats:  # a float argument: M (again)
            raise MaskArgument(t.floats[id(mask)])
        if isinstance(mask, torch.Tensor) and not t.traced(mask):  # bool: True where allowed; float: added
            form = "additive_false" if mask.dtype == torch.bool else "as_is"
            per_head, mask = across_heads(t, mask, form, like)  # (…, H, n, m) varying over the heads: per head
            a = total(a, per_head if per_head is not None else t.constant(mask, form, like=like).expr)
        else:
            m = t.value(mask)
            a = total(a, m.expr if m.rows != 1 else product(OneMatrix(qv.rows, 1), m.expr))
    weights = ops.softmax(a)
    if dropout:  # dropout_p > 0: the weights' dropout (SDPA applies it whatever the module's mode), sa.dropout
        weights = hadamard_product(weights, drawn(t, DropoutMask(weights, float(dropout))))
    return Value(product(weights, at_heads(vv, heads)), tuple(result.shape), heads)
