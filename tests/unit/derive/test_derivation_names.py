"""Intermediates put back by name (symattn.lang.naming.names): display only, so the forms must be exact."""

from __future__ import annotations

import sympy as sp

import symattn as sa
from symattn.derive.formats.latex import text
from symattn.lang.naming.names import Names

SPEC = sa.spec("self_attention")
SHORT = Names(SPEC.intermediates)
X, W_Q, W_K, W_V = SPEC.inputs
D_K = next(s for s in SPEC.output.free_symbols if getattr(s, "name", "") == "d_k")
G = sp.MatrixSymbol("G", *SPEC.output.shape)


def test_definitions_are_written_with_earlier_names():
    assert [(str(s), text(d)) for s, d in SHORT.definitions] == [
        ("Q", "X W_Q"),
        ("K", "X W_K"),
        ("V", "X W_V"),
        ("S", "Q Kᵀ"),
        ("A", "(1/√d_k) S"),
        ("P", "softmax(A)"),
        ("O", "P V"),
    ]


def test_runs_of_factors_and_their_transposes_are_named():
    # G W_Vᵀ Xᵀ = G (X W_V)ᵀ = G Vᵀ; X W_Q W_Kᵀ Xᵀ / √d_k = A
    assert text(SHORT(G * W_V.T * X.T)) == "G Vᵀ"
    assert text(SHORT(X * W_Q * W_K.T * X.T / sp.sqrt(D_K))) == "A"
    assert text(SHORT(sa.softmax(X * W_Q * W_K.T * X.T / sp.sqrt(D_K)).T * G)) == "Pᵀ G"


def test_a_scale_that_is_not_the_definitions_keeps_the_smaller_name():
    # 2 Q Kᵀ is 2 S, not a multiple of A = S/√d_k
    assert text(SHORT(2 * X * W_Q * W_K.T * X.T)) == "2 S"
    assert text(SHORT(X.T * X)) == "Xᵀ X"  # nothing to name
