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
