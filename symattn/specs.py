"""Built-in specs: the forward passes of the seeds, as expressions of symattn's language.

A spec names its inputs (in the order of CONTRACT.md's table), its output, and the
intermediates a derivation names (S = QKᵀ, A = S/√d_k, P = softmax(A), O = PV).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.errors import SymattnError, UnknownSpecError
from symattn.ops import merge_heads, softmax, split_heads


def dim(name: str) -> sp.Symbol:
    """A dimension: a positive integer symbol."""
    return sp.Symbol(name, positive=True, integer=True)


@dataclass(frozen=True)
class Spec:
    """A forward expression with named inputs, options and intermediates."""

    name: str
    summary: str
    inputs: tuple[MatrixSymbol, ...]
    output: MatrixExpr
    intermediates: tuple[tuple[str, MatrixExpr], ...] = ()
    options: Mapping[str, object] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(str(s.name) for s in self.inputs)

    def input(self, name: str) -> MatrixSymbol:
        """The input symbol called name (SymattnError listing the names otherwise)."""
        for s in self.inputs:
            if s.name == name:
                return s
        raise SymattnError(f"spec {self.name!r} has no input {name!r}; inputs: {', '.join(self.input_names)}")


def _attention_core(q: MatrixExpr, k: MatrixExpr, v: MatrixExpr, scale: Basic, suffix: str = ""):
    """S = Q Kᵀ, A = scale·S, P = softmax(A), O = P V, with the intermediates named."""
    s = q * k.T
    a = scale * s if scale != 1 else s
    p = softmax(a)
    o = p * v
    named = [("S" + suffix, s)] + ([("A" + suffix, a)] if scale != 1 else []) + [("P" + suffix, p), ("O" + suffix, o)]
    return o, named


def _scale(option, d_k: sp.Symbol) -> Basic:
    if option is None:
        return 1 / sp.sqrt(d_k)
    value = sp.sympify(option)
    if not (isinstance(value, sp.Expr) and value.is_real is not False):
        raise SymattnError(f"scale must be a real number or expression, got {option!r}")
    return sp.nsimplify(value) if isinstance(value, sp.Float) else value


def attention(scale=None) -> Spec:
    """softmax(scale · Q Kᵀ) V (seed 004 has scale = 1)."""
    n, m, d_k, d_v = dim("n"), dim("m"), dim("d_k"), dim("d_v")
    q, k, v = MatrixSymbol("Q", n, d_k), MatrixSymbol("K", m, d_k), MatrixSymbol("V", m, d_v)
    out, named = _attention_core(q, k, v, _scale(scale, d_k))
    return Spec("attention", "softmax(scale · Q Kᵀ) V", (q, k, v), out, tuple(named), {"scale": scale})


def self_attention() -> Spec:
    """softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V (seeds 001 and 003)."""
    n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
    x = MatrixSymbol("X", n, d_model)
    w_q, w_k = MatrixSymbol("W_Q", d_model, d_k), MatrixSymbol("W_K", d_model, d_k)
    w_v = MatrixSymbol("W_V", d_model, d_v)
    q, k, v = x * w_q, x * w_k, x * w_v
    out, named = _attention_core(q, k, v, 1 / sp.sqrt(d_k))
    named = [("Q", q), ("K", k), ("V", v)] + named
    return Spec("self_attention", "softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V", (x, w_q, w_k, w_v), out, tuple(named))


def mha(num_heads=None) -> Spec:
    """Concat(head_1 … head_H) W_O, head_h = attention(Q W_Q[:,h], K W_K[:,h], V W_V[:,h]) (seeds 000, 002)."""
    if num_heads is None:
        heads: Basic = dim("H")
    else:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise SymattnError(f"num_heads must be a positive integer, got {num_heads!r}")
        heads = sp.Integer(num_heads)
    n, m, d_k = dim("n"), dim("m"), dim("d_k")
    d_model = heads * d_k
    q, k, v = MatrixSymbol("Q", n, d_model), MatrixSymbol("K", m, d_model), MatrixSymbol("V", m, d_model)
    w = {name: MatrixSymbol(name, d_model, d_model) for name in ("W_Q", "W_K", "W_V", "W_O")}
    q_h = split_heads(q * w["W_Q"], heads)
    k_h = split_heads(k * w["W_K"], heads)
    v_h = split_heads(v * w["W_V"], heads)
    o_h, named = _attention_core(q_h, k_h, v_h, 1 / sp.sqrt(d_k), suffix="_h")
    concat = merge_heads(o_h, heads)
    named = [("Q_h", q_h), ("K_h", k_h), ("V_h", v_h)] + named + [("C", concat)]
    return Spec(
        "mha",
        "Concat(head_1, …, head_H) W_O, head_h = attention(Q W_Q_h, K W_K_h, V W_V_h)",
        (q, k, v, w["W_Q"], w["W_K"], w["W_V"], w["W_O"]),
        concat * w["W_O"],
        tuple(named),
        {"num_heads": num_heads},
    )


BUILTIN: dict[str, Callable[..., Spec]] = {
    "attention": attention,
    "self_attention": self_attention,
    "mha": mha,
}


def specs() -> list[str]:
    """Names of the built-in specs."""
    return list(BUILTIN)


def spec(name: str, **options) -> Spec:
    """The built-in spec called name, built with the given options."""
    if name not in BUILTIN:
        raise UnknownSpecError(f"unknown spec {name!r}; built-in specs: {', '.join(BUILTIN)}")
    try:
        return BUILTIN[name](**options)
    except TypeError as err:
        raise SymattnError(f"bad option for spec {name!r}: {err}") from None
