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
from symattn.trace.layout import argument, matrix, same_heads
from symattn.trace.tracer import Trace
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


def scaled_dot_product_attention(t: Trace, args: tuple, kwargs: dict, result) -> Value:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale) = softmax(s Q Kᵀ + M) V.

    A bool attn_mask is True where attention is allowed (torch's convention), a float one is added; is_causal
    adds the causal mask (a constant made here, −∞ above the diagonal).
    """
    q, k, v = args[0], argument(args, kwargs, 1, "key"), argument(args, kwargs, 2, "value")
    mask = argument(args, kwargs, 3, "attn_mask")
    dropout, causal = argument(args, kwargs, 4, "dropout_p", 0.0), argument(args, kwargs, 5, "is_causal", False)
    scale = argument(args, kwargs, 6, "scale")
    if dropout:
        raise Refused(f"dropout_p = {dropout} is random; trace with dropout_p=0")
    if kwargs.get("enable_gqa"):
        raise Refused("enable_gqa (grouped-query heads)")
    qv, kv, vv = (matrix(t.value(z)) for z in (q, k, v))
    heads = same_heads(qv, kv, vv)
    t.dims.equate(qv.cols, kv.cols)
    t.dims.equate(t.value(k).rows, t.value(v).rows)
    qv, kv, vv = (t.value(z) for z in (q, k, v))
    t.dims.contracted.append(qv.cols)
    s = product(qv.expr, Transpose(kv.expr))
    factor = 1 / sp.sqrt(qv.cols) if scale is None else t.value(scale, (qv.cols,)).expr
    a = product(factor, s)
    like = Value(a, (*result.shape[:-1], kv.shape[-2]), heads)
    if causal:
        rows, cols = qv.shape[-2], kv.shape[-2]
        built = torch.ones(rows, cols, dtype=torch.bool).triu(1)
        a = total(a, t.constant(built, "additive", like=like).expr)
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            a = total(a, t.constant(mask, "additive_false", like=like).expr)
        else:
            m = t.value(mask)
            a = total(a, m.expr if m.rows != 1 else product(OneMatrix(qv.rows, 1), m.expr))
    return Value(product(ops.softmax(a), vv.expr), tuple(result.shape), heads)
