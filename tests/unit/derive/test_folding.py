"""Scalar folding (symattn.derive.folding): each rule an identity, checked on random matrices."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatMul, Transpose

import symattn as sa
from symattn.derive.folding import RULES, fold_scalars
from symattn.numeric.lambdify import lambdify

n, d = sp.symbols("n d", positive=True, integer=True)
A, B = sp.MatrixSymbol("A", n, n), sp.MatrixSymbol("B", n, n)
c = 1 / sp.sqrt(d)

CASES = {  # node type → an expression its rule folds
    MatMul: MatMul(50, MatMul(sp.Rational(1, 50), A), B),  # 50 ((1/50) A) B = A B
    Transpose: Transpose(MatMul(c, A, B)),  # (c A B)ᵀ = c (A B)ᵀ
    HadamardProduct: HadamardProduct(MatMul(50, A), MatMul(c, B)),  # (50 A) ⊙ (c B) = 50c (A ⊙ B)
    HadamardPower: HadamardPower(MatMul(c, A), 2),  # (c A)^∘2 = c² A^∘2
    sa.rowsum(A).func: sa.rowsum(MatMul(c, A)),  # rowsum(c A) = c rowsum(A)
    sa.sum(A).func: sa.sum(MatMul(c, A)),  # sum(c A) = c sum(A)
}


def test_every_rule_has_a_case():
    assert set(RULES) == set(CASES)


@pytest.mark.parametrize("node_type", list(CASES), ids=lambda t: t.__name__)
def test_each_rule_is_an_identity(node_type, rng):
    expr = CASES[node_type]
    folded = RULES[node_type](expr)
    assert folded is not None and folded != expr
    dims = {"n": 3, "d": 5}
    a, b = rng.standard_normal((3, 3)), rng.standard_normal((3, 3))
    left = lambdify([A, B], expr, dims=dims)(a, b)
    right = lambdify([A, B], folded, dims=dims)(a, b)
    np.testing.assert_allclose(np.asarray(left, float), np.asarray(right, float), rtol=1e-13, atol=1e-13)


def test_a_constant_and_its_inverse_cancel():
    assert fold_scalars(MatMul(50, MatMul(sp.Rational(1, 50), A))) == A
    # (1/√d) A (1/√d) B = (1/d) A B
    assert fold_scalars(MatMul(MatMul(c, A), MatMul(c, B))) == MatMul(1 / d, A, B)
    # (1/(50√d)) ((50 A) ⊙ B) = (1/√d) (A ⊙ B)
    folded = fold_scalars(MatMul(c / 50, HadamardProduct(MatMul(50, A), B)))
    assert folded == MatMul(c, HadamardProduct(A, B))


def test_kept_values_are_not_entered():
    inner = MatMul(c, MatMul(2, A))
    assert fold_scalars(MatMul(3, inner), keep={inner}) == MatMul(3, inner)
