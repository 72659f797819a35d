"""torch's own multi-head attention, ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, and so
``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``, ``nn.Transformer``), read as the language's.

torch's function works in the (n, B, E) layout, sequence first, with batch and heads merged; its Python is not
written in the forms the reader knows. It is read by running, under the trace, the same computation written in
those forms (``DECOMPOSED``): the inputs transposed to (B, n, E), the projections x Wᵀ + 𝟏 b (the packed
``in_proj_weight``'s three row blocks read as inputs of their own, ``forms.blocks``), the split into heads,
``scaled_dot_product_attention`` with the masks torch merges (``key_padding_mask`` added to ``attn_mask``, each
made additive as torch makes it), the merge of the heads, the output projection, and the transpose back to (n, B, E).
The result is torch's to rounding: softmax(Q Kᵀ/√d + M) V per head, what torch computes.

Options the language has no word for are refused in one line: ``bias_k``/``bias_v``, ``add_zero_attn``, static keys
and values. Dropout while training is SDPA's ``dropout_p``, read as ``sa.dropout`` (drawn as torch draws it). The
attention weights (``need_weights=True``) come back as torch's own values, held as a tensor the reader refuses to
read: returned or used, they stop the trace with a line saying so.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from symattn.trace.values import Refused


def _refuse_options(bias_k, bias_v, add_zero_attn, static_k, static_v) -> None:
    if bias_k is not None or bias_v is not None:
        raise Refused("nn.MultiheadAttention with add_bias_kv=True (a learned key and value appended)")
    if add_zero_attn:
        raise Refused("nn.MultiheadAttention with add_zero_attn=True (a zero key and value appended)")
    if static_k is not None or static_v is not None:
        raise Refused("multi_head_attention_forward with static_k or static_v")


def _projections(query, key, value, in_proj_weight, in_proj_bias, separate: tuple | None):
    """Q, K, V = x Wᵀ + 𝟏 b for each input: the packed weight's and bias's three blocks, or the separate weights
    with the packed bias's blocks."""
    if separate is None:
        return tuple(
            F.linear(x, in_proj_weight, in_proj_bias).chunk(3, dim=-1)[k] for k, x in enumerate((query, key, value))
        )
    biases = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3, dim=-1)
    return tuple(
        F.linear(x, w) if b is None else F.linear(x, w) + b for x, w, b in zip((query, key, value), separate, biases)
    )


def _additive(mask, dtype):
    """torch's merge of a mask: a bool one (True: not attended) as −∞ there and 0 elsewhere, a float one as is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def _mask(key_padding_mask, attn_mask, batch: int, heads: int, dtype):
    """The additive mask SDPA adds to each head's scores (B, H or 1, n, m), as torch merges the two: attn_mask
    (n, m) or (B·H, n, m) plus key_padding_mask (B, m) on every row."""
    attn_mask, key_padding_mask = _additive(attn_mask, dtype), _additive(key_padding_mask, dtype)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.view(batch, heads, *attn_mask.shape[-2:])
    if key_padding_mask is None:
        return attn_mask
    padding = key_padding_mask.view(batch, 1, 1, key_padding_mask.shape[-1])
    return padding if attn_mask is None else attn_mask + padding


def multi_head_attention_forward(
    query,
    key,
    value,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight,
    in_proj_bias,
    bias_k,
    bias_v,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight,
    out_proj_bias,
    training: bool = True,
    key_padding_mask=None,
    need_weights: bool = True,
    attn_mask=None,
    use_separate_proj_weight: bool = False,
    q_proj_weight=None,
    k_proj_weight=None,
    v_proj_weight=None,
    static_k=None,
    static_v=None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
):
    """F.multi_head_attention_forward in the reader's forms (see the module docstring); is_causal is torch's
    hint that attn_mask is causal, and attn_mask is what is applied (torch requires it with the hint)."""
    _refuse_options(bias_k, bias_v, add_zero_attn, static_k, static_v)
    if query.dim() != 3:
        raise Refused(f"multi_head_attention_forward of an unbatched query of shape {tuple(query.shape)}")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")  # torch's own error
    length, batch, width = query.shape
    head = width // num_heads
    separate = (q_proj_weight, k_proj_weight, v_proj_weight) if use_separate_proj_weight else None
    q, k, v = (x.transpose(0, 1) for x in (query, key, value))
    q, k, v = _projections(q, k, v, in_proj_weight, in_proj_bias, separate)
    q, k, v = (x.view(batch, x.shape[1], num_heads, head).transpose(1, 2) for x in (q, k, v))
    mask = _mask(key_padding_mask, attn_mask, batch, num_heads, query.dtype)
    dropout = dropout_p if training else 0.0  # (SDPA's dropout_p: read as sa.dropout, drawn as torch draws it)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=1 / math.sqrt(head))
    out = F.linear(out.transpose(1, 2).reshape(batch, length, width), out_proj_weight, out_proj_bias)
    weights = _weights(q, k, mask, head, average_attn_weights) if need_weights else None
    return out.transpose(0, 1), weights


def _weights(q, k, mask, head: int, average: bool):
    """torch's attention weights, computed off the trace (their values, for the caller; ``Trace.unread`` marks
    them so that reading them stops the trace, ``values.GUARDED``)."""
    with torch._C.DisableTorchFunction():
        scores = q @ k.transpose(-2, -1) / math.sqrt(head)
        weights = (scores if mask is None else scores + mask).softmax(-1)
        return weights.mean(dim=1) if average else weights


# torch function → its computation in the reader's forms, run under the trace in its place
DECOMPOSED: dict[object, Callable] = {F.multi_head_attention_forward: multi_head_attention_forward}

# torch function → the positions of its arguments in the (n, B, c) layout: each must be a traced (B, n, c) tensor's
# transpose(0, 1) (a 3-D input is read as (B, n, c): its own layout cannot be told from its shape)
SEQUENCE_FIRST: dict[object, tuple[int, ...]] = {F.multi_head_attention_forward: (0, 1, 2)}
UNREAD_LAYOUT = (
    "its inputs are in neither layout the reader takes: (B, n, E) transposed by batch_first=True, or the 3-D float "
    "arguments (n, B, E) of a batch_first=False model"
)
