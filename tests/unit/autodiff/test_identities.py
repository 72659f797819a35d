"""Matrix-calculus identities: symattn's closed forms against the textbook ones.

Each test opens with the identity it checks. A closed form is compared symbolically
where SymPy's canonical forms make the two comparable (after .doit() and expand),
and always numerically at random sizes; linear cases are also checked against
SymPy's own Trace(...).diff(X), which is right for linear stages (SYMPY_NOTES).
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp
from sympy import Identity, MatrixSymbol, OneMatrix, Trace, hadamard_product

import symattn as sa
from symattn.specs import dim

n, d = dim("n"), dim("d")
X = MatrixSymbol("X", n, n)
Y = MatrixSymbol("Y", n, n)
A = MatrixSymbol("A", n, n)
B = MatrixSymbol("B", n, n)
R = MatrixSymbol("R", n, d)  # rectangular
W = MatrixSymbol("W", d, d)
G = MatrixSymbol("G", n, d)


def same(ours: sp.Basic, expected: sp.Basic, symbolic: bool = True) -> bool:
    """Equal numerically at random sizes (and, if symbolic, structurally after doit/expand)."""
    if symbolic and sp.expand(ours.doit()) != sp.expand(expected.doit()):
        return False
    rng = np.random.default_rng(3)
    symbols = sorted(ours.atoms(MatrixSymbol) | expected.atoms(MatrixSymbol), key=lambda s: s.name)
    for sizes in [{n: 3, d: 2}, {n: 4, d: 5}]:
        values = [rng.standard_normal(tuple(int(k.subs(sizes)) for k in s.shape)) for s in symbols]
        left = sa.lambdify(symbols, ours, dims={"n": sizes[n], "d": sizes[d]})(*values)
        right = sa.lambdify(symbols, expected, dims={"n": sizes[n], "d": sizes[d]})(*values)
        if not np.allclose(left, right, rtol=1e-12, atol=1e-12):
            return False
    return True


def test_trace_of_axb():
    # d tr(A X B) / dX = Aᵀ Bᵀ
    assert same(sa.grad(Trace(A * X * B), X)[X], A.T * B.T)


def test_trace_of_ax():
    # d tr(A X) / dX = Aᵀ
    assert same(sa.grad(Trace(A * X), X)[X], A.T)


def test_trace_of_xa():
    # d tr(X A) / dX = Aᵀ
    assert same(sa.grad(Trace(X * A), X)[X], A.T)


def test_trace_of_a_x_transposed_b():
    # d tr(A Xᵀ B) / dX = B A
    assert same(sa.grad(Trace(A * X.T * B), X)[X], B * A)


def test_trace_of_x():
    # d tr(X) / dX = I
    assert sa.grad(Trace(X), X)[X] == Identity(n)


def test_sum_of_entries():
    # d sum(X) / dX = 𝟏𝟏ᵀ
    assert sa.grad(sa.sum(R), R)[R] == OneMatrix(n, d)


def test_sum_of_row_sums():
    # d sum(rowsum(X)) / dX = 𝟏𝟏ᵀ
    assert same(sa.grad(sa.sum(sa.rowsum(R)), R)[R], OneMatrix(n, d), symbolic=False)


def test_quadratic_form():
    # d tr(Xᵀ B X) / dX = (B + Bᵀ) X
    assert same(sa.grad(Trace(X.T * B * X), X)[X], (B + B.T) * X)


def test_gram_trace():
    # d tr(Xᵀ X) / dX = 2 X   (also for a rectangular X)
    assert same(sa.grad(Trace(X.T * X), X)[X], 2 * X)
    assert same(sa.grad(Trace(R.T * R), R)[R], 2 * R)


def test_two_sided_quadratic():
    # d tr(Xᵀ A X B) / dX = A X B + Aᵀ X Bᵀ
    assert same(sa.grad(Trace(X.T * A * X * B), X)[X], A * X * B + A.T * X * B.T)


def test_matrix_square():
    # d tr(X²) / dX = 2 Xᵀ   (SymPy writes X*X as MatPow(X, 2))
    expr = Trace(X * X)
    assert isinstance(expr.arg, sp.MatPow)
    assert same(sa.grad(expr, X)[X], 2 * X.T)


def test_matrix_cube():
    # d tr(X³) / dX = 3 (X²)ᵀ
    assert same(sa.grad(Trace(X**3), X)[X], 3 * (X * X).T, symbolic=False)


def test_linear_map_with_cotangent():
    # d tr(Gᵀ R W) / dW = Rᵀ G   and   d tr(Gᵀ R W) / dR = G Wᵀ
    grads = sa.grad(R * W, [R, W], cotangent=G)
    assert same(grads[W], R.T * G)
    assert same(grads[R], G * W.T)


def test_symbolic_scale():
    # d tr(Gᵀ R W) / dW with the product scaled by 1/√d = Rᵀ G / √d
    assert same(sa.grad(R * W / sp.sqrt(d), W, cotangent=G)[W], R.T * G / sp.sqrt(d))


def test_product_of_traces():
    # d (tr(X) tr(Y)) / dX = tr(Y) I
    assert same(sa.grad(Trace(X) * Trace(Y), X)[X], Trace(Y) * Identity(n))


def test_hadamard_square():
    # d sum(X ⊙ X) / dX = 2 X   (SymPy writes X ⊙ X as HadamardPower(X, 2))
    expr = sa.sum(hadamard_product(R, R))
    assert isinstance(expr.arg, sp.HadamardPower)
    assert same(sa.grad(expr, R)[R], 2 * R)


def test_hadamard_product():
    # d tr(Gᵀ (X ⊙ Y)) / dX = G ⊙ Y
    assert same(sa.grad(sa.hadamard(X, Y), X, cotangent=A)[X], hadamard_product(A, Y))


def test_exp_log_tanh_sigmoid():
    # d sum(exp X)/dX = exp X;  d sum(log X)/dX = X^{∘−1};
    # d sum(tanh X)/dX = 𝟏𝟏ᵀ − tanh(X)^{∘2};  d sum(σ X)/dX = σ(X) ⊙ (𝟏𝟏ᵀ − σ(X))
    ones = OneMatrix(n, n)
    assert same(sa.grad(sa.sum(sa.exp(X)), X)[X], sa.exp(X))
    assert same(sa.grad(sa.sum(sa.log(sa.exp(X))), X)[X], ones, symbolic=False)
    assert sa.grad(sa.sum(sa.log(X)), X)[X] == sp.HadamardPower(X, -1)
    assert same(sa.grad(sa.sum(sa.tanh(X)), X)[X], ones - sp.HadamardPower(sa.tanh(X), 2), symbolic=False)
    assert same(sa.grad(sa.sum(sa.sigmoid(X)), X)[X], hadamard_product(sa.sigmoid(X), ones - sa.sigmoid(X)), False)


def test_row_softmax():
    # d tr(Gᵀ softmax(A)) / dA = P ⊙ (G − rowsum(G ⊙ P) 𝟏ᵀ),  P = softmax(A)
    p = sa.softmax(R)
    expected = hadamard_product(p, G - sa.rowsum(hadamard_product(G, p)) * OneMatrix(1, d))
    assert same(sa.grad(p, R, cotangent=G)[R], expected)


def test_softmax_rows_sum_to_one():
    # sum(softmax(A)) = n is constant, so d sum(softmax(A)) / dA = 0
    value = sa.lambdify([R], sa.grad(sa.sum(sa.softmax(R)), R)[R])(np.random.default_rng(1).standard_normal((3, 4)))
    assert np.allclose(value, 0, atol=1e-15)


LINEAR = [
    Trace(A * X * B),
    Trace(A * X),
    Trace(A * X.T * B),
    Trace(X + A * X),  # one trace of a sum: SymPy 1.14 differentiates tr(X) + tr(AX) (an Add) to 0
    Trace(G.T * R * W) / sp.sqrt(d),
    Trace(A * X * B / sp.sqrt(n) + 2 * X.T * B),
]


def test_sum_of_traces():
    # d (tr(X) + tr(A X)) / dX = I + Aᵀ   (SymPy 1.14's own diff of this Add gives 0)
    assert same(sa.grad(Trace(X) + Trace(A * X), X)[X], Identity(n) + A.T)


@pytest.mark.parametrize("expr", LINEAR, ids=str)
def test_linear_stages_agree_with_sympy_diff(expr):
    # For linear traces SymPy's matrix derivative is right: symattn must give the same closed form.
    wrt = W if W in expr.atoms(MatrixSymbol) else X
    ours = sa.grad(expr, wrt)[wrt]
    theirs = expr.diff(wrt)
    assert same(ours, theirs, symbolic=False)
    assert sp.expand((ours - theirs).doit()) == sp.ZeroMatrix(*wrt.shape)
