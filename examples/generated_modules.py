"""The generated modules of the built-in mha spec: NumPy, PyTorch, forward mode, second order, memeff (docs/modules.md).

NumPy: ``forward`` returns (out, saved) and ``backward(saved, grad_out)`` every gradient by input name.
PyTorch: ``loss.backward()`` runs the same closed form; both agree. ``jvp`` is the forward-mode closed
form (checked against a finite difference), ``hvp`` the Hessian-vector product (checked against a
difference of two backwards), and the ``_memeff`` module gives the same numbers keeping O(n·d) memory.

    python examples/generated_modules.py
"""

from __future__ import annotations

import numpy as np
import torch
from symattn.generated import mha_numpy, mha_numpy_memeff, mha_torch

rng = np.random.default_rng(0)
X = rng.standard_normal((2, 5, 8))  # (batch, tokens, d_model)
W_Q, W_K, W_V, W_O = (rng.standard_normal((8, 8)) for _ in range(4))
G = rng.standard_normal((2, 5, 8))  # the cotangent ∂f/∂Y, f = tr(Gᵀ Y)

out, saved = mha_numpy.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=2, causal=True)
grads = mha_numpy.backward(saved, G)  # {"Q": ..., "K": ..., "V": ..., "W_Q": ..., "W_O": ...}
print("NumPy gradients:", {name: g.shape for name, g in grads.items()})

weights = [torch.tensor(w, requires_grad=True) for w in (W_Q, W_K, W_V, W_O)]
x = torch.tensor(X)
y = mha_torch.forward(x, x, x, *weights, num_heads=2, causal=True)
(y * torch.tensor(G)).sum().backward()  # the generated closed-form backward
gap = max(abs(w.grad.numpy() - grads[name]).max() for w, name in zip(weights, ["W_Q", "W_K", "W_V", "W_O"]))
print(f"torch and NumPy weight gradients differ by {gap:.1e}")


def f(w_q):
    return np.sum(G * mha_numpy.forward(X, X, X, w_q, W_K, W_V, W_O, num_heads=2, causal=True)[0])


direction, eps = rng.standard_normal(W_Q.shape), 1e-6
_, tangent = mha_numpy.jvp(X, X, X, W_Q, W_K, W_V, W_O, {"W_Q": direction}, num_heads=2, causal=True)
numeric = (f(W_Q + eps * direction) - f(W_Q - eps * direction)) / (2 * eps)
print(f"JVP ⟨G, Ẏ⟩ {np.sum(G * tangent):.8f}, finite difference {numeric:.8f}")

hvp = mha_numpy.hvp(X, X, X, W_Q, W_K, W_V, W_O, G, {"W_Q": direction}, num_heads=2, causal=True)


def grad_w_q(w_q):
    return mha_numpy.backward(mha_numpy.forward(X, X, X, w_q, W_K, W_V, W_O, num_heads=2, causal=True)[1], G)["W_Q"]


h_numeric = (grad_w_q(W_Q + eps * direction) - grad_w_q(W_Q - eps * direction)) / (2 * eps)
print(f"Hessian-vector product vs difference of gradients: {abs(hvp['W_Q'] - h_numeric).max():.1e}")

out_m, saved_m = mha_numpy_memeff.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=2, causal=True, block_size=2)
grads_m = mha_numpy_memeff.backward(saved_m, G)
print(f"memeff vs standard: {max(abs(grads_m[k] - grads[k]).max() for k in grads):.1e}")

assert gap < 1e-10 and abs(np.sum(G * tangent) - numeric) < 1e-6 and abs(hvp["W_Q"] - h_numeric).max() < 1e-5
assert np.allclose(out_m, out) and all(np.allclose(grads_m[k], grads[k]) for k in grads)
