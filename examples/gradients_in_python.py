"""Gradients of a matrix expression in Python: sa.grad, sa.lambdify and the language's errors (docs/language.md).

Y = softmax(X W Xᵀ / √d) X, its gradient with respect to X and W for the cotangent G (the gradient of
tr(Gᵀ Y)) in closed form, evaluated with NumPy and compared with a central finite difference of
tr(Gᵀ Y) in a random direction. Last, a product of mismatched shapes: ``ShapeMismatchError`` names both.

    python examples/gradients_in_python.py
"""

from __future__ import annotations

import numpy as np
import sympy as sp

import symattn as sa

n, d = sp.symbols("n d", positive=True, integer=True)
X = sp.MatrixSymbol("X", n, d)
W = sp.MatrixSymbol("W", d, d)
G = sp.MatrixSymbol("G", n, d)

Y = sa.softmax(X * W * X.T / sp.sqrt(d)) * X  # row-wise softmax
grads = sa.grad(Y, [X, W], cotangent=G)  # {X: MatrixExpr, W: MatrixExpr}
print("∂f/∂W =", grads[W])

forward = sa.lambdify([X, W], Y)
grad_x, grad_w = (sa.lambdify([X, W, G], grads[s]) for s in (X, W))

rng = np.random.default_rng(0)
x, w, g = rng.standard_normal((5, 4)), rng.standard_normal((4, 4)), rng.standard_normal((5, 4))
dx, dw = rng.standard_normal(x.shape), rng.standard_normal(w.shape)


def f(x, w):
    return np.sum(g * forward(x, w))  # tr(Gᵀ Y)


eps = 1e-6
numeric = (f(x + eps * dx, w + eps * dw) - f(x - eps * dx, w - eps * dw)) / (2 * eps)
closed = np.sum(grad_x(x, w, g) * dx) + np.sum(grad_w(x, w, g) * dw)
print(f"directional derivative: closed form {closed:.8f}, finite difference {numeric:.8f}")
assert abs(closed - numeric) < 1e-6 * max(1.0, abs(closed))

# batch dimensions broadcast: three examples at once
print("batched ∂f/∂W:", grad_w(np.stack([x] * 3), w, np.stack([g] * 3)).shape)

try:
    sa.grad(X * X, [X])  # (n × d)(n × d): d columns against n rows
except sa.ShapeMismatchError as error:
    print("refused:", error)
else:
    raise SystemExit("X * X was not refused")
