"""Runtime helpers of generated JAX modules that draw: dropout's mask, from the caller's JAX key.

Real code, linted and tested; ``JaxMatrixPrinter`` copies the source of the ones a module calls into it.
"""

from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover - generating a JAX module reads this source, it needs no JAX
    jax = jnp = None


def dropout_mask(a, p, training=True, rng=None):
    """Dropout's mask Z of a's shape and dtype: Bernoulli(1 − p) / (1 − p), drawn with the JAX key rng (required
    while training: the same key gives the same mask); training False or p = 0: ones, no draw (A ⊙ Z = A exactly)."""
    if not training or p == 0:
        return jnp.ones_like(a)
    if rng is None:
        raise TypeError("dropout while training draws its mask with a JAX key: pass rng=jax.random.key(seed)")
    return jax.random.bernoulli(rng, 1 - p, jnp.shape(a)).astype(a.dtype) / (1 - p)
