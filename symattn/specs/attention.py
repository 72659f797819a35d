"""The attention family of built-in specs: attention, self_attention and mha (with biases,
grouped-query heads and masks), as expressions of symattn's language.

Each names its inputs in the generated forward's order, its output, and the intermediates a
derivation names (S = QKᵀ, A = S/√d_k, P = softmax(A), O = PV).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.dims import dim
from symattn.lang.naming.parse import parse
from symattn.lang.naming.safe import expression
from symattn.lang.ops import dropout, merge_heads, repeat_heads, softmax, split_heads
from symattn.lang.piecewise import DropoutMask, parameter
from symattn.specs.spec import Option, Spec, flag, head_count


def _attention_core(
    q: MatrixExpr,
    k: MatrixExpr,
    v: MatrixExpr,
    scale: Basic,
    suffix: str = "",
    mask: MatrixSymbol | None = None,
    drop: Basic = sp.S.Zero,
):
    """S = Q Kᵀ, A = scale·S (+ M), P = softmax(A), O = P V, with the intermediates named; with dropout p > 0 on
    the weights, Z = Z_p(P) its mask, D = P ⊙ Z and O = D V."""
    s = q * k.T
    a = scale * s if scale != 1 else s
    if mask is not None:
        a = a + mask
    p = softmax(a)
    weights = dropout(p, drop) if drop else p
    o = weights * v
    scaled = scale != 1 or mask is not None
    named = [("S" + suffix, s)] + ([("A" + suffix, a)] if scaled else []) + [("P" + suffix, p)]
    if drop:  # the mask and the weights it keeps: Z_h and D_h, the names the drop-in's need_weights reads
        named += [("Z" + suffix, DropoutMask(p, drop)), ("D" + suffix, weights)]
    return o, [*named, ("O" + suffix, o)]


def dropout_probability(option) -> Basic:
    """A dropout option as the exact p of ``sa.dropout`` (0 ≤ p < 1; 0.1 → 1/10), 0 for none."""
    if isinstance(option, (bool, np.bool_)):
        raise SymattnError(f"dropout must be a probability, 0 ≤ p < 1, got {option!r}")
    return parameter(option or 0, "dropout")


def _scale(option, d_k: sp.Symbol, dims: Sequence[sp.Symbol] = ()) -> Basic:
    """The score scale: 1/√d_k by default, else a number, a SymPy scalar, or a formula read by ``parse``.

    Text (``--option scale=1/sqrt(d_k)``) is parsed by the whitelist parser, never evaluated;
    it may use the spec's dimensions. The scale must be a nonzero real scalar.
    """
    if option is None:
        return 1 / sp.sqrt(d_k)
    if isinstance(option, sp.Symbol):  # a symbolic scale (a generated module's keyword)
        return option
    if isinstance(option, str):
        try:
            value = parse(option, {str(d): d for d in (d_k, *dims)})
        except SymattnError as err:
            raise SymattnError(f"option scale={option}: {err}") from None
    else:
        value = expression(option, "scale")
    if not isinstance(value, sp.Expr) or value.is_real is False or value.free_symbols - {d_k, *dims}:
        raise SymattnError(f"scale must be a real number or an expression of the dimensions, got {option!r}")
    if value.is_zero:
        raise SymattnError("scale must be nonzero (scale = 0 makes every attention row uniform)")
    return sp.nsimplify(value) if isinstance(value, sp.Float) else value


def _mask(n: Basic, m: Basic, **flags) -> MatrixSymbol | None:
    """The additive mask M (n × m): 0 where a key is allowed, −∞ where not, or any float.

    Every mask option (mask: an additive float or boolean attn_mask; causal; key_padding_mask)
    enters the derivation the same way, A = scale·Q Kᵀ + M with M not differentiated.
    """
    on = [name for name, value in flags.items() if flag(name, value)]
    return MatrixSymbol("M", n, m) if on else None


def attention(scale=None, mask=False, causal=False, key_padding_mask=False) -> Spec:
    """softmax(scale · Q Kᵀ) V (default scale 1/√d_k); with a mask option, softmax(scale · Q Kᵀ + M) V."""
    n, m, d_k, d_v = dim("n"), dim("m"), dim("d_k"), dim("d_v")
    q, k, v = MatrixSymbol("Q", n, d_k), MatrixSymbol("K", m, d_k), MatrixSymbol("V", m, d_v)
    masks = {"mask": mask, "causal": causal, "key_padding_mask": key_padding_mask}
    m_add = _mask(n, m, **masks)
    out, named = _attention_core(q, k, v, _scale(scale, d_k, (n, m, d_v)), mask=m_add)
    options = {"scale": scale} | {key: True for key, value in masks.items() if value}
    summary = "softmax(scale · Q Kᵀ) V" if m_add is None else "softmax(scale · Q Kᵀ + M) V, M the additive mask"
    constants = () if m_add is None else (m_add,)
    return Spec("attention", summary, (q, k, v), out, tuple(named), options, constants=constants)


def self_attention() -> Spec:
    """softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V: single-head self-attention with its embedding input X."""
    n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
    x = MatrixSymbol("X", n, d_model)
    w_q, w_k = MatrixSymbol("W_Q", d_model, d_k), MatrixSymbol("W_K", d_model, d_k)
    w_v = MatrixSymbol("W_V", d_model, d_v)
    q, k, v = x * w_q, x * w_k, x * w_v
    out, named = _attention_core(q, k, v, 1 / sp.sqrt(d_k))
    named = [("Q", q), ("K", k), ("V", v)] + named
    return Spec("self_attention", "softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V", (x, w_q, w_k, w_v), out, tuple(named))


def mha(
    num_heads=None,
    num_kv_heads=None,
    bias=False,
    mask=False,
    causal=False,
    key_padding_mask=False,
    dropout=0,
) -> Spec:
    """Concat(head_1 … head_H) W_O, head_h = attention(Q W_Q[:,h], K W_K[:,h], V W_V[:,h]).

    Options: bias adds b_Q, b_K, b_V, b_O (1 × columns, broadcast over tokens: Q W_Q + 𝟏 b_Q);
    num_kv_heads = H_kv (dividing H) gives grouped-query attention, W_K and W_V d_model × H_kv·d_k,
    query head h reading kv head ⌊h / (H / H_kv)⌋; a mask option adds M (n × m) to every head's scores;
    dropout = p > 0 drops out the weights, D_h = P_h ⊙ Z_p(P_h), head_h = D_h V_h (``nn.MultiheadAttention``'s
    dropout while training).
    """
    drop = dropout_probability(dropout)
    heads = head_count(num_heads, "num_heads", "H")
    kv_heads = heads if num_kv_heads is None else head_count(num_kv_heads, "num_kv_heads", "H_kv")
    if heads.is_Integer and kv_heads.is_Integer and heads % kv_heads:
        raise SymattnError(f"num_kv_heads = {kv_heads} does not divide num_heads = {heads}")
    grouped = kv_heads != heads
    n, m, d_k = dim("n"), dim("m"), dim("d_k")
    d_model = heads * d_k
    d_kv = kv_heads * d_k
    q, k, v = MatrixSymbol("Q", n, d_model), MatrixSymbol("K", m, d_model), MatrixSymbol("V", m, d_model)
    w = {name: MatrixSymbol(name, d_model, d_kv if name in ("W_K", "W_V") else d_model) for name in WEIGHTS}
    b = {name: MatrixSymbol(name, 1, d_kv if name in ("b_K", "b_V") else d_model) for name in BIASES}
    use_bias = flag("bias", bias)

    def project(x: MatrixSymbol, which: str, rows: Basic) -> MatrixExpr:
        y = x * w["W_" + which]
        return y + sp.OneMatrix(rows, 1) * b["b_" + which] if use_bias else y

    q_h = split_heads(project(q, "Q", n), heads)
    k_h = split_heads(project(k, "K", m), kv_heads)
    v_h = split_heads(project(v, "V", m), kv_heads)
    if grouped:
        k_h, v_h = repeat_heads(k_h, kv_heads, heads), repeat_heads(v_h, kv_heads, heads)
    masks = {"mask": mask, "causal": causal, "key_padding_mask": key_padding_mask}
    m_add = _mask(n, m, **masks)
    o_h, named = _attention_core(q_h, k_h, v_h, 1 / sp.sqrt(d_k), suffix="_h", mask=m_add, drop=drop)
    concat = merge_heads(o_h, heads)
    out = concat * w["W_O"] + sp.OneMatrix(n, 1) * b["b_O"] if use_bias else concat * w["W_O"]
    named = [("Q_h", q_h), ("K_h", k_h), ("V_h", v_h)] + named + [("C", concat)]
    options = {"num_heads": num_heads} | {
        key: value
        for key, value in (("num_kv_heads", num_kv_heads), ("bias", use_bias), *masks.items(), ("dropout", dropout))
        if value
    }
    summary = "Concat(head_1, …, head_H) W_O, head_h = attention(Q W_Q_h, K W_K_h, V W_V_h)"
    if use_bias:
        summary = "Concat(head_1, …, head_H) W_O + 𝟏 b_O, head_h = attention((Q W_Q + 𝟏 b_Q)_h, …)"
    if grouped:
        summary += f"; {kv_heads} K, V heads"
    if m_add is not None:
        summary += "; scores + M"
    if drop:
        summary += f"; dropout {dropout} on the weights"
    inputs = (q, k, v, *w.values()) + (tuple(b.values()) if use_bias else ())
    return Spec("mha", summary, inputs, out, tuple(named), options, constants=(m_add,) if m_add is not None else ())


WEIGHTS = ("W_Q", "W_K", "W_V", "W_O")
BIASES = ("b_Q", "b_K", "b_V", "b_O")


def attention_options(extended: bool) -> tuple[dict, tuple[Option, ...]]:
    """attention's generated keywords: scale (default 1/√d_k); extended adds the additive mask M."""
    scale = sp.Symbol("scale", real=True)
    more = {"mask": True} if extended else {}
    return {"scale": scale, **more}, (Option("scale", scale, 1 / sp.sqrt(dim("d_k"))),)


def mha_options(extended: bool) -> tuple[dict, tuple[Option, ...]]:
    """mha's generated keywords: num_heads → H; extended adds biases, M and num_kv_heads → H_kv (default H)."""
    heads = Option("num_heads", dim("H"), None)
    if not extended:
        return {}, (heads,)
    kv_heads = Option("num_kv_heads", dim("H_kv"), dim("H"), divides="num_heads")
    return {"num_kv_heads": kv_heads.symbol, "bias": True, "mask": True}, (heads, kv_heads)
