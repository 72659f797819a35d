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


def dropout_seed(training=True, rng=None):
    """The seed of a call's blocks of dropout masks (the memory-efficient variant), drawn from rng (a
    np.random.Generator, required while training): an int in [0, 2⁶³), saved for the backward, which draws the
    same blocks again; None when training is False (no draw)."""
    if not training:
        return None
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            "dropout while training draws its mask from rng: pass rng=np.random.default_rng(seed), or "
            f"training=False; got rng={rng!r}"
        )
    return int(rng.integers(2**63))


def dropout_block(like, p, seed, stream, block, keys, cols):
    """The block of rows ``block`` of dropout's mask Z (its keys ``keys`` of cols), like's dtype: (u ≥ p) / (1 − p)
    for u uniform on [0, 1) in float32, drawn over every key of the block's rows by Philox keyed by (seed, stream)
    from the counter block.start · 2¹⁹² (disjoint streams for every block), so the backward's block is the
    forward's whatever keys each reads. seed None (training=False): ones, no draw."""
    if seed is None:
        return np.ones_like(like)
    generator = np.random.Generator(np.random.Philox(key=seed + (stream << 64), counter=block.start << 192))
    kept = generator.random((*np.shape(like)[:-1], cols), dtype=np.float32)[..., keys] >= p
    return kept.astype(like.dtype) / like.dtype.type(1 - p)
