"""The generated JAX module: jax.grad, jax.jit, jax.vmap, forward mode and second order through mha_jax (docs/jax.md).

``mha_jax.forward`` is a ``jax.custom_vjp`` whose backward is the generated closed form: ``jax.jit(jax.grad)``
through it agrees with the NumPy module's ``backward``; ``jax.vmap`` maps it over a stack of weights;
``forward_jvp`` (a ``jax.custom_jvp`` computed by the generated JVP) is what ``jax.jvp`` and ``jax.jacfwd``
apply to; ``jax.grad`` of ``jax.grad`` is exact (JAX differentiates the backward's own code).

    pip install -e ".[jax]" && python examples/jax_module.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from symattn.generated import mha_jax, mha_numpy

jax.config.update("jax_enable_x64", True)  # float64 arrays stay float64 (JAX's default is float32)
rng = np.random.default_rng(0)
X = rng.standard_normal((2, 5, 8))
W_Q, W_K, W_V, W_O = (rng.standard_normal((8, 8)) for _ in range(4))


def loss(W_O):
    return mha_jax.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=2, causal=True).sum()


grad = jax.jit(jax.grad(loss))(W_O)
out, saved = mha_numpy.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=2, causal=True)
expected = mha_numpy.backward(saved, np.ones_like(out))["W_O"]
print(f"jax.grad vs the NumPy module's backward: {np.abs(grad - expected).max():.1e}")

stacked = jnp.stack([W_O, 2 * W_O, -W_O])
print("jax.vmap over three W_O:", jax.vmap(jax.grad(loss))(stacked).shape)

direction = rng.standard_normal(W_Q.shape)
_, tangent = jax.jvp(
    lambda w: mha_jax.forward_jvp(X, X, X, w, W_K, W_V, W_O, num_heads=2, causal=True), (W_Q,), (direction,)
)
_, expected_tangent = mha_numpy.jvp(X, X, X, W_Q, W_K, W_V, W_O, {"W_Q": direction}, num_heads=2, causal=True)
print(f"jax.jvp through forward_jvp vs the NumPy module's jvp: {np.abs(tangent - expected_tangent).max():.1e}")


def energy(W_O):
    return jnp.sum(mha_jax.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=2) ** 2)


hvp = jax.grad(lambda w: jnp.vdot(jax.grad(energy)(w), direction))(W_O)  # second order: grad of grad
eps = 1e-6
numeric = (jax.grad(energy)(W_O + eps * direction) - jax.grad(energy)(W_O - eps * direction)) / (2 * eps)
print(f"Hessian-vector product vs difference of gradients: {np.abs(hvp - numeric).max():.1e}")
assert np.allclose(grad, expected) and np.allclose(tangent, expected_tangent) and np.allclose(hvp, numeric, atol=1e-5)
