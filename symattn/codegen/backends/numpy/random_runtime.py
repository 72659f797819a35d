"""Runtime helpers of generated NumPy modules that draw: dropout's mask, from the caller's np.random.Generator.

Real code, linted and tested; ``GeneratedNumPyPrinter`` copies the source of the ones a module calls into it.
"""

from __future__ import annotations

import numpy as np


def dropout_mask(a, p, training=True, rng=None):
    """Dropout's mask Z of a's shape and dtype: Bernoulli(1 − p) / (1 − p), drawn from rng (a np.random.Generator,
    required while training: the same generator state gives the same mask); training False or p = 0: ones, no draw
    (A ⊙ Z = A exactly)."""
    if not training or p == 0:
        return np.ones_like(a)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            "dropout while training draws its mask from rng: pass rng=np.random.default_rng(seed), or "
            f"training=False; got rng={rng!r}"
        )
    return (rng.random(np.shape(a)) >= p).astype(a.dtype) / a.dtype.type(1 - p)
