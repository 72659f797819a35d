"""The forward-mode spec of a spec: the Jacobian-vector product of its output along input tangents.

For Y = F(x_1, …, x_k) and tangents ẋ_i (one per input, of its shape; a trainable scalar's is a scalar),

    Ẏ = Σ_i ∂F/∂x_i [ẋ_i] = dF  with dx_i = ẋ_i,

the forward differential of F (``autodiff.differentials``): the product rule, f′(A) ⊙ dA for an entrywise f,
P ⊙ (dA − rowsum(dA ⊙ P) 𝟏ᵀ) for the row softmax. Ẏ is linear in the tangents and has Y's shape. Its spec has
the spec's inputs, then their tangents (named ``<x>_t``); the spec's constants, then theirs (Ṁ of the additive
mask, which a float attn_mask under jax.jvp carries; a constant, like M: not checked, None is zero); and Ẏ as
its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy import MatrixSymbol

from symattn.autodiff.differentials import differential
from symattn.errors import SymattnError
from symattn.lang.naming.names import fresh_name
from symattn.specs.second_order import nested
from symattn.specs.spec import Spec

__all__ = ["ForwardMode", "forward_mode_spec"]

TANGENT = "{}_t"  # the tangent ẋ of input x: W_Q_t (a weight's tangent is a weight: no batch axes)


@dataclass(frozen=True)
class ForwardMode:
    """The JVP's spec and how its inputs relate to the first spec's: ``tangents``, input name → tangent name."""

    spec: Spec
    first: Spec
    tangents: tuple[tuple[str, str], ...]


def forward_mode_spec(s: Spec) -> ForwardMode:
    """The spec of Ẏ = Σ_i ∂F/∂x_i [ẋ_i] + ∂F/∂M [Ṁ] over every input x_i and constant M."""
    taken = {str(x.name) for x in (*s.inputs, *s.constants)} | {label for label, _ in s.intermediates}
    tangents: dict = {}
    for x in (*s.inputs, *s.constants):
        name = fresh_name(TANGENT.format(x.name), taken, bare=True, first=2)
        taken.add(name)
        tangents[x] = MatrixSymbol(name, *x.shape) if isinstance(x, MatrixSymbol) else sp.Symbol(name, real=True)
    _, output = nested(s)  # the output as one DAG, each intermediate a node
    jvp = differential(output, tangents)
    if jvp is None:
        raise SymattnError(f"spec {s.name!r}: the output depends on none of its inputs")
    spec = Spec(
        f"{s.name}_jvp",
        f"Σ_i ∂F/∂x_i [ẋ_i], F = {s.summary}",
        (*s.inputs, *(tangents[x] for x in s.inputs)),
        jvp,
        (),
        s.options,
        s.dims,
        (*s.constants, *(tangents[c] for c in s.constants)),
        _tangent_parameters(s, tangents),
    )
    return ForwardMode(spec, s, tuple((str(x.name), str(t.name)) for x, t in tangents.items()))


def _tangent_parameters(s: Spec, tangents: dict) -> tuple[str, ...] | None:
    """A spec's own parameters list, with each parameter's tangent (unbatched like it); None: by prefix."""
    if s.parameters is None:
        return None
    return (*s.parameters, *(str(tangents[x].name) for x in s.inputs if str(x.name) in s.parameters))
