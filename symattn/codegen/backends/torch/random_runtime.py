"""Runtime helpers of generated PyTorch modules that draw: dropout's mask, from torch's own generator.

Real code, linted and tested; ``TorchMatrixPrinter`` copies the source of the ones a module calls into it.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a torch module reads this source, it needs no torch
    torch = None


def dropout_mask(a, p, training=True, rng=None):
    """Dropout's mask Z of a's shape: Bernoulli(1 − p) / (1 − p), drawn from rng (a torch.Generator; None: torch's
    default one, as F.dropout draws, so torch.manual_seed reproduces it); training False or p = 0: ones, no draw
    (A ⊙ Z = A exactly)."""
    if not training or p == 0:
        return torch.ones_like(a)
    return torch.empty_like(a).bernoulli_(1 - p, generator=rng).div_(1 - p)


def dropout_seed(training=True, rng=None):
    """The seed of a call's blocks of dropout masks (the memory-efficient variant), drawn from rng (a
    torch.Generator; None: torch's default one, so torch.manual_seed reproduces the call): an int in [0, 2⁶²), saved
    for the backward, which draws the same blocks again; None when training is False (no draw)."""
    if not training:
        return None
    device = "cpu" if rng is None else rng.device
    return int(torch.randint(0, 2**62, (), generator=rng, device=device))


def dropout_block(like, p, seed, stream, block, keys, cols):
    """The block of rows ``block`` of dropout's mask Z (its keys ``keys`` of cols), like's dtype: (u ≥ p) / (1 − p),
    u uniform on [0, 1) in float32 (torch.rand: cheaper than bernoulli_, and unbiased for 16-bit dtypes), drawn over
    every key of the block's rows from a generator seeded by (seed, stream, block.start) alone, so the backward's
    block is the forward's whatever keys each reads; stream tells a spec's masks apart. seed None
    (training=False): ones, no draw."""
    if seed is None:
        return torch.ones_like(like)
    mixed = (seed ^ (stream * 0x9E3779B97F4A7C15) ^ (block.start * 0xBF58476D1CE4E5B9)) % 2**64
    generator = torch.Generator(like.device).manual_seed(mixed)
    drawn = torch.rand((*like.shape[:-1], cols), generator=generator, device=like.device)
    return drawn[..., keys].ge_(p).to(like.dtype).div_(1 - p)
