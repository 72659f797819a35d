"""The ``transformer_block`` spec: a pre-LN Transformer encoder layer in symattn's language.

    X₁ = LN₁(X) = LN(X) ⊙ 𝟏γ₁ + 𝟏β₁
    Y  = X + MHA(X₁)        (Q = X₁ W_Q + 𝟏b_Q, …, C = Concat_h softmax(Q_h K_hᵀ/√d_k [+ M]) V_h)
    X₂ = LN₂(Y) = LN(Y) ⊙ 𝟏γ₂ + 𝟏β₂
    Z  = Y + FFN(X₂),  FFN(u) = GELU(u W_1 + 𝟏b_1) W_2 + 𝟏b_2

Tokens are rows (X is n × d_model, d_model = H·d_k); W_1 is d_model × d_ff (math
convention, not nn.Linear's transposed weight); biases, γ and β are 1 × d rows
broadcast over the tokens as 𝟏b with 𝟏 the n × 1 column of ones. LN standardises
each row with the biased variance plus eps, as ``torch.nn.LayerNorm``. It matches
``torch.nn.TransformerEncoderLayer(norm_first=True, dropout=0.0, activation="gelu",
batch_first=True)`` with the weights mapped (see tests/test_block.py).
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import HadamardProduct, MatAdd, OneMatrix, Transpose
from sympy.matrices.expressions.hadamard import canonicalize as hadamard_canonical

from symattn.errors import SymattnError
from symattn.lang.algebra import product, total
from symattn.lang.dims import dim
from symattn.lang.ops import gelu, layer_norm, merge_heads, softmax, split_heads
from symattn.specs.spec import Option, Spec, head_count

DEFAULT_EPS = 1e-5
APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's approximate=


def _eps(eps) -> Basic:
    if isinstance(eps, sp.Symbol):
        return eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, sp.Number)) or not eps > 0:
        raise SymattnError(f"eps must be a positive number, got {eps!r}")
    return sp.nsimplify(eps) if isinstance(eps, float) else sp.sympify(eps)


def _affine(x: MatrixExpr, gamma: MatrixSymbol, beta: MatrixSymbol) -> MatrixExpr:
    """x ⊙ 𝟏γ + 𝟏β: the learned scale and shift of a LayerNorm, broadcast over the rows of x."""
    ones = OneMatrix(x.shape[0], 1)
    return total(hadamard_canonical(HadamardProduct(x, product(ones, gamma))), product(ones, beta))


def transformer_block(num_heads=None, eps=DEFAULT_EPS, causal: bool = False, approximate: str = "none") -> Spec:
    """Pre-LN encoder layer: Y = X + MHA(LN₁(X)), Z = Y + FFN(LN₂(Y)), GELU exact or tanh-approximated.

    causal adds the additive mask M (n × n) to every head's scores, A_h = S_h/√d_k + M, as the
    masks of ``mha`` do; M is a constant (−∞ above the diagonal in the generated modules'
    ``causal=True``), never differentiated. num_heads None keeps the head count symbolic (H).
    """
    if approximate not in APPROXIMATIONS:
        raise SymattnError(f"approximate must be one of {', '.join(APPROXIMATIONS)}, got {approximate!r}")
    if not isinstance(causal, bool) and causal not in (0, 1):  # --option causal=1 arrives as an int
        raise SymattnError(f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    heads, epsilon = head_count(num_heads, "num_heads", "H"), _eps(eps)
    n, d_k, d_ff = dim("n"), dim("d_k"), dim("d_ff")
    d_model = heads * d_k
    x = MatrixSymbol("X", n, d_model)
    w = {name: MatrixSymbol(name, d_model, d_model) for name in ("W_Q", "W_K", "W_V", "W_O")}
    b = {name: MatrixSymbol(name, 1, d_model) for name in ("b_Q", "b_K", "b_V", "b_O")}
    norms = {name: MatrixSymbol(name, 1, d_model) for name in ("gamma_1", "beta_1", "gamma_2", "beta_2")}
    w_1, b_1 = MatrixSymbol("W_1", d_model, d_ff), MatrixSymbol("b_1", 1, d_ff)
    w_2, b_2 = MatrixSymbol("W_2", d_ff, d_model), MatrixSymbol("b_2", 1, d_model)
    ones = OneMatrix(n, 1)
    constants: tuple[MatrixSymbol, ...] = (MatrixSymbol("M", n, n),) if causal else ()

    # attention sublayer. Every intermediate is built canonical with shallow constructors: SymPy's operators
    # deep-doit their operands, and a later deep doit must not turn a named value into a different expression.
    n_1 = layer_norm(x, epsilon)
    x_1 = _affine(n_1, norms["gamma_1"], norms["beta_1"])
    q_h, k_h, v_h = (split_heads(total(product(x_1, w[f"W_{p}"]), product(ones, b[f"b_{p}"])), heads) for p in "QKV")
    s_h = product(q_h, Transpose(k_h))
    a_h = product(1 / sp.sqrt(d_k), s_h)
    if causal:
        a_h = total(a_h, constants[0])  # every head gets the same M
    p_h = softmax(a_h)
    o_h = product(p_h, v_h)
    c = merge_heads(o_h, heads)
    y = total(x, product(c, w["W_O"]), product(ones, b["b_O"]))

    # feed-forward sublayer
    n_2 = layer_norm(y, epsilon)
    x_2 = _affine(n_2, norms["gamma_2"], norms["beta_2"])
    u = total(product(x_2, w_1), product(ones, b_1))
    f = gelu(u, approximate)
    z = MatAdd(y, total(product(f, w_2), product(ones, b_2)))  # not flattened: the residual Y stays one node

    named = [
        ("N_1", n_1),
        ("X_1", x_1),
        ("Q_h", q_h),
        ("K_h", k_h),
        ("V_h", v_h),
        ("S_h", s_h),
        ("A_h", a_h),
        ("P_h", p_h),
        ("O_h", o_h),
        ("C", c),
        ("Y", y),
        ("N_2", n_2),
        ("X_2", x_2),
        ("U", u),
        ("F", f),
        ("Z", z),
    ]
    gelu_name = "GELU" if approximate == "none" else "GELU_tanh"
    return Spec(
        "transformer_block",
        f"pre-LN encoder layer: Y = X + MHA(LN₁(X)), Z = Y + {gelu_name}(LN₂(Y) W_1 + b_1) W_2 + b_2",
        # the order the generated forward takes them (CONTRACT's table): the biases, optional there, last
        (x, w["W_Q"], w["W_K"], w["W_V"], w["W_O"], norms["gamma_1"], norms["beta_1"], norms["gamma_2"])
        + (norms["beta_2"], w_1, w_2, b["b_Q"], b["b_K"], b["b_V"], b["b_O"], b_1, b_2),
        z,
        tuple(named),
        {"num_heads": num_heads, "eps": eps, "causal": causal, "approximate": approximate},
        constants=constants,
    )


def block_options(extended: bool = False) -> tuple[dict, tuple[Option, ...]]:
    """The block's options made symbolic for the generated modules: num_heads → H, eps → eps (default 1e-5);
    extended adds the additive mask M (the generated keywords attn_mask, key_padding_mask, causal build it)."""
    epsilon = sp.Symbol("eps", positive=True)
    options = (Option("num_heads", dim("H"), None), Option("eps", epsilon, sp.Float(DEFAULT_EPS)))
    return {"eps": epsilon, **({"causal": True} if extended else {})}, options
