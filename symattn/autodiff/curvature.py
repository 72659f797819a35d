"""Second derivatives of the block's entrywise nodes, written with nodes that have rules of their own.

GELU′ and GELU_tanh′ appear in first gradients only; differentiating those gradients again
(double backward, Hessian-vector products) needs GELU″, which is built here from Exp, Tanh
and entrywise powers, so that it is printed, costed and checked like any other expression.
The VJP and JVP rules of GeluGrad and GeluTanhGrad both read it from here.
"""

from __future__ import annotations

import sympy as sp
from sympy import MatrixExpr, OneMatrix
from sympy.matrices.expressions import HadamardPower

from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.ops import GELU_TANH_C, GELU_TANH_K, Exp, Tanh

__all__ = ["gelu_second", "gelu_tanh_second"]


def gelu_second(a: MatrixExpr) -> MatrixExpr:
    """GELU″(A) = φ(A) ⊙ (2·𝟏𝟏ᵀ − A^{∘2}) entrywise, φ(x) = exp(−x²/2)/√(2π) (the derivative of Φ + xφ)."""
    square = HadamardPower(a, 2)
    density = product(1 / sp.sqrt(2 * sp.pi), Exp(product(sp.Rational(-1, 2), square)))
    return hadamard_product(density, total(product(2, OneMatrix(*a.shape)), product(-1, square)))


def gelu_tanh_second(a: MatrixExpr) -> MatrixExpr:
    """The derivative of GELU_tanh′(x) = (1 + t)/2 + x s w/2, entrywise, where t = tanh(k (x + c x³)),
    s = 1 − t², w = k (1 + 3 c x²) (so t′ = s w, w′ = 6 k c x):

        GELU_tanh″(x) = s w/2 + (s w + x (−2 t s w) w + x s 6 k c x)/2 = s ⊙ (w − x t w² + 3 k c x²).
    """
    ones = OneMatrix(*a.shape)
    square = HadamardPower(a, 2)
    t = Tanh(product(GELU_TANH_K, total(a, product(GELU_TANH_C, HadamardPower(a, 3)))))
    s = total(ones, product(-1, HadamardPower(t, 2)))
    w = product(GELU_TANH_K, total(ones, product(3 * GELU_TANH_C, square)))
    bend = product(3 * GELU_TANH_K * GELU_TANH_C, square)
    inner = total(w, product(-1, hadamard_product(a, t, HadamardPower(w, 2))), bend)
    return hadamard_product(s, inner)
