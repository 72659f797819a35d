"""The ``transformer_block`` spec: a Transformer encoder layer in symattn's language, pre-LN or post-LN.

Pre-LN (``norm_first=True``, the default):

    X₁ = LN₁(X) = LN(X) ⊙ 𝟏γ₁ + 𝟏β₁
    Y  = X + MHA(X₁)        (Q = X₁ W_Q + 𝟏b_Q, …, C = Concat_h softmax(Q_h K_hᵀ/√d_k [+ M]) V_h)
    X₂ = LN₂(Y) = LN(Y) ⊙ 𝟏γ₂ + 𝟏β₂
    Z  = Y + FFN(X₂),  FFN(u) = act(u W_1 + 𝟏b_1) W_2 + 𝟏b_2

Post-LN (``norm_first=False``, torch's default):

    Y  = X + MHA(X)         (Q = X W_Q + 𝟏b_Q, …)
    X₁ = LN₁(Y) = LN(Y) ⊙ 𝟏γ₁ + 𝟏β₁
    Y₂ = X₁ + FFN(X₁)
    Z  = LN₂(Y₂) = LN(Y₂) ⊙ 𝟏γ₂ + 𝟏β₂

The activation ``act`` is GELU (default; exact, or ``approximate="tanh"``), ReLU or SiLU (``ACTIVATIONS``).
Tokens are rows (X is n × d_model, d_model = H·d_k); W_1 is d_model × d_ff (math
convention, not nn.Linear's transposed weight); biases, γ and β are 1 × d rows
broadcast over the tokens as 𝟏b with 𝟏 the n × 1 column of ones. LN standardises
each row with the biased variance plus eps, as ``torch.nn.LayerNorm``. It matches
``torch.nn.TransformerEncoderLayer(norm_first=…, dropout=0.0, activation=…, batch_first=True)``
with the weights mapped (see tests/integration/test_block.py and test_dropin_configurations.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, MatAdd, OneMatrix, Transpose
from sympy.matrices.expressions.hadamard import canonicalize as hadamard_canonical

from symattn.errors import SymattnError
from symattn.lang.algebra import product, total
from symattn.lang.dims import dim
from symattn.lang.functions import Gelu, GeluTanh, Relu, Silu
from symattn.lang.ops import dropout, layer_norm, merge_heads, softmax, split_heads
from symattn.specs.attention import dropout_probability
from symattn.specs.spec import Option, Spec, flag, head_count

DEFAULT_EPS = 1e-5
APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's approximate=
# the feed-forward activation by its record's name (the activation option): its record for each approximate= it takes
ACTIVATIONS: dict[str, dict[str, type]] = {
    Gelu.function: {"none": Gelu, "tanh": GeluTanh},  # GELU(u) = u Φ(u), or its tanh approximation
    Relu.function: {"none": Relu},  # ReLU(u) = max(u, 0)
    Silu.function: {"none": Silu},  # SiLU(u) = u σ(u)
}


def _eps(eps) -> Basic:
    if isinstance(eps, sp.Symbol):
        return eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, sp.Number)) or not eps > 0:
        raise SymattnError(f"eps must be a positive number, got {eps!r}")
    return sp.nsimplify(eps) if isinstance(eps, float) else sp.sympify(eps)


def _activation(activation: str, approximate: str) -> type:
    """The record of act: the activation option's, in GELU's approximate= form."""
    if approximate not in APPROXIMATIONS:
        raise SymattnError(f"approximate must be one of {', '.join(APPROXIMATIONS)}, got {approximate!r}")
    if activation not in ACTIVATIONS:
        raise SymattnError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    forms = ACTIVATIONS[activation]
    if approximate not in forms:
        raise SymattnError(f"approximate={approximate!r} applies to GELU only, not to activation {activation!r}")
    return forms[approximate]


def _affine(x: MatrixExpr, gamma: MatrixSymbol, beta: MatrixSymbol) -> MatrixExpr:
    """x ⊙ 𝟏γ + 𝟏β: the learned scale and shift of a LayerNorm, broadcast over the rows of x."""
    ones = OneMatrix(x.shape[0], 1)
    return total(hadamard_canonical(HadamardProduct(x, product(ones, gamma))), product(ones, beta))


@dataclass(frozen=True)
class _Symbols:
    """The block's inputs and sizes: X (n × d_model), weights w, biases b and norms by name, the mask M if causal."""

    x: MatrixSymbol
    w: dict[str, MatrixSymbol]
    b: dict[str, MatrixSymbol]
    norms: dict[str, MatrixSymbol]
    heads: Basic
    d_k: Basic
    epsilon: Basic
    act: type
    constants: tuple[MatrixSymbol, ...]
    drop: Basic = sp.S.Zero  # the dropout p of the four places torch's layer drops out (0: none)

    def dropped(self, x: MatrixExpr) -> MatrixExpr:
        """x ⊙ Z_p(x), dropout p while training (x itself without dropout)."""
        return dropout(x, self.drop) if self.drop else x

    @property
    def ones(self) -> OneMatrix:
        return OneMatrix(self.x.shape[0], 1)

    def inputs(self) -> tuple[MatrixSymbol, ...]:
        """The order the generated forward takes them (CONTRACT's table): the biases, optional there, last."""
        w, b, norms = self.w, self.b, self.norms
        weights = (w["W_Q"], w["W_K"], w["W_V"], w["W_O"], norms["gamma_1"], norms["beta_1"], norms["gamma_2"])
        return (
            self.x,
            *weights,
            norms["beta_2"],
            w["W_1"],
            w["W_2"],
            *(b[f"b_{p}"] for p in ("Q", "K", "V", "O", 1, 2)),
        )


def _symbols(num_heads, eps, causal: bool, act: type, drop: Basic) -> _Symbols:
    heads, epsilon = head_count(num_heads, "num_heads", "H"), _eps(eps)
    n, d_k, d_ff = dim("n"), dim("d_k"), dim("d_ff")
    d_model = heads * d_k
    w = {name: MatrixSymbol(name, d_model, d_model) for name in ("W_Q", "W_K", "W_V", "W_O")}
    w |= {"W_1": MatrixSymbol("W_1", d_model, d_ff), "W_2": MatrixSymbol("W_2", d_ff, d_model)}
    b = {name: MatrixSymbol(name, 1, d_model) for name in ("b_Q", "b_K", "b_V", "b_O", "b_2")}
    b["b_1"] = MatrixSymbol("b_1", 1, d_ff)
    norms = {name: MatrixSymbol(name, 1, d_model) for name in ("gamma_1", "beta_1", "gamma_2", "beta_2")}
    constants = (MatrixSymbol("M", n, n),) if causal else ()
    return _Symbols(MatrixSymbol("X", n, d_model), w, b, norms, heads, d_k, epsilon, act, constants, drop)


# Every intermediate is built canonical with shallow constructors: SymPy's operators deep-doit their
# operands, and a later deep doit must not turn a named value into a different expression.


def _attention(s: _Symbols, source: MatrixExpr) -> list[tuple[str, MatrixExpr]]:
    """Q_h … C of multi-head self-attention reading source's rows (A_h = S_h/√d_k [+ M], every head the same M)."""
    ones = s.ones
    q_h, k_h, v_h = (
        split_heads(total(product(source, s.w[f"W_{p}"]), product(ones, s.b[f"b_{p}"])), s.heads) for p in "QKV"
    )
    s_h = product(q_h, Transpose(k_h))
    a_h = product(1 / sp.sqrt(s.d_k), s_h)
    if s.constants:
        a_h = total(a_h, s.constants[0])
    p_h = softmax(a_h)
    d_h = s.dropped(p_h)
    o_h = product(d_h, v_h)
    steps = [("Q_h", q_h), ("K_h", k_h), ("V_h", v_h), ("S_h", s_h), ("A_h", a_h), ("P_h", p_h)]
    steps += [("D_h", d_h)] if s.drop else []
    return [*steps, ("O_h", o_h), ("C", merge_heads(o_h, s.heads))]


def _residual(s: _Symbols, source: MatrixExpr, c: MatrixExpr) -> MatrixExpr:
    """source + C W_O + 𝟏b_O: the attention sublayer's residual sum (its second term dropped out with dropout)."""
    terms = (product(c, s.w["W_O"]), product(s.ones, s.b["b_O"]))
    return total(source, s.dropped(total(*terms))) if s.drop else total(source, *terms)


def _feed_forward(s: _Symbols, source: MatrixExpr) -> list[tuple[str, MatrixExpr]]:
    """U = source W_1 + 𝟏b_1 and F = act(U) (dropped out with dropout)."""
    u = total(product(source, s.w["W_1"]), product(s.ones, s.b["b_1"]))
    return [("U", u), ("F", s.dropped(s.act(u)))]


def _second_residual(s: _Symbols, source: MatrixExpr, f: MatrixExpr) -> MatrixExpr:
    """source + F W_2 + 𝟏b_2 (its second term dropped out with dropout), source kept one node."""
    fed = total(product(f, s.w["W_2"]), product(s.ones, s.b["b_2"]))
    return MatAdd(source, s.dropped(fed))


def _normed(s: _Symbols, source: MatrixExpr, k: int) -> list[tuple[str, MatrixExpr]]:
    """N_k = LN(source) and X_k = N_k ⊙ 𝟏γ_k + 𝟏β_k."""
    n_k = layer_norm(source, s.epsilon)
    return [(f"N_{k}", n_k), (f"X_{k}", _affine(n_k, s.norms[f"gamma_{k}"], s.norms[f"beta_{k}"]))]


def _pre_ln(s: _Symbols) -> tuple[list[tuple[str, MatrixExpr]], MatrixExpr, str]:
    """Y = X + MHA(X₁), X₁ = LN₁(X); Z = Y + F W_2 + 𝟏b_2, F = act(X₂ W_1 + 𝟏b_1), X₂ = LN₂(Y)."""
    named = _normed(s, s.x, 1)
    named += _attention(s, named[-1][1])
    y = _residual(s, s.x, named[-1][1])
    named += [("Y", y), *_normed(s, y, 2)]
    named += _feed_forward(s, named[-1][1])
    z = _second_residual(s, y, named[-1][1])
    summary = f"pre-LN encoder layer: Y = X + MHA(LN₁(X)), Z = Y + {s.act.text}(LN₂(Y) W_1 + b_1) W_2 + b_2"
    return named, z, summary


def _post_ln(s: _Symbols) -> tuple[list[tuple[str, MatrixExpr]], MatrixExpr, str]:
    """Y = X + MHA(X), X₁ = LN₁(Y); Y_2 = X₁ + F W_2 + 𝟏b_2, F = act(X₁ W_1 + 𝟏b_1); Z = LN₂(Y_2) ⊙ 𝟏γ₂ + 𝟏β₂."""
    named = _attention(s, s.x)
    y = _residual(s, s.x, named[-1][1])
    named += [("Y", y), *_normed(s, y, 1)]
    x_1 = named[-1][1]
    named += _feed_forward(s, x_1)
    y_2 = _second_residual(s, x_1, named[-1][1])
    named += [("Y_2", y_2), *_normed(s, y_2, 2)]
    summary = f"post-LN encoder layer: X₁ = LN₁(X + MHA(X)), Z = LN₂(X₁ + {s.act.text}(X₁ W_1 + b_1) W_2 + b_2)"
    return named[:-1], named[-1][1], summary


def transformer_block(
    num_heads=None,
    eps=DEFAULT_EPS,
    causal: bool = False,
    approximate: str = "none",
    norm_first: bool = True,
    activation: str = Gelu.function,
    dropout=0,
) -> Spec:
    """Encoder layer: pre-LN Y = X + MHA(LN₁(X)), Z = Y + FFN(LN₂(Y)) (norm_first), or post-LN
    X₁ = LN₁(X + MHA(X)), Z = LN₂(X₁ + FFN(X₁)); FFN's activation GELU (exact or tanh-approximated), ReLU or SiLU.

    causal adds the additive mask M (n × n) to every head's scores, A_h = S_h/√d_k + M, as the
    masks of ``mha`` do; M is a constant (−∞ above the diagonal in the generated modules'
    ``causal=True``), never differentiated. num_heads None keeps the head count symbolic (H). dropout = p > 0
    drops out where torch's layer does while training: the attention weights (D_h = P_h ⊙ Z_p(P_h)), the
    attention sublayer's output before its residual sum, the activation's output and the feed-forward output
    before its residual sum, each with its own mask.
    """
    act = _activation(activation, approximate)
    causal, norm_first = flag("causal", causal), flag("norm_first", norm_first)
    s = _symbols(num_heads, eps, causal, act, dropout_probability(dropout))
    named, z, summary = (_pre_ln if norm_first else _post_ln)(s)
    options = {"num_heads": num_heads, "eps": eps, "causal": causal, "approximate": approximate}
    options |= {"norm_first": norm_first, "activation": activation} | ({"dropout": dropout} if s.drop else {})
    if s.drop:
        summary += f"; dropout {dropout}"
    return Spec("transformer_block", summary, s.inputs(), z, (*named, ("Z", z)), options, constants=s.constants)


def block_options(extended: bool = False) -> tuple[dict, tuple[Option, ...]]:
    """The block's options made symbolic for the generated modules: num_heads → H, eps → eps (default 1e-5);
    extended adds the additive mask M (the generated keywords attn_mask, key_padding_mask, causal build it)."""
    epsilon = sp.Symbol("eps", positive=True)
    options = (Option("num_heads", dim("H"), None), Option("eps", epsilon, sp.Float(DEFAULT_EPS)))
    return {"eps": epsilon, **({"causal": True} if extended else {})}, options
