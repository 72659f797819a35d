"""An independent forward with a mask: any torch forward run under ``MaskedSoftmax(mask)`` adds the additive mask
to the scores of each of its softmaxes (what ``sa.with_mask`` does to a spec). Shared by
tests/integration/test_masked_gallery.py and benchmarks/gallery.py (a real module: torch.compile traces the mode)."""

from __future__ import annotations

import torch

from symattn.errors import SymattnError
from symattn.specs.masking import with_mask


class MaskedSoftmax(torch.overrides.TorchFunctionMode):
    """torch.softmax / log_softmax along the last axis with the additive mask added to their scores first."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.mask = mask

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.nn.functional.softmax):
            scores, *rest = args
            return func(scores + self.mask, *rest, **kwargs)
        return func(*args, **kwargs)


def causal_forward(forward, n: int):
    """forward with the causal mask (n × n: −inf where key j comes after query i) added to its softmaxes' scores."""
    future = torch.ones(n, n, dtype=torch.bool).triu(1)

    def masked(*xs):
        with MaskedSoftmax(torch.zeros(n, n, dtype=xs[0].dtype).masked_fill(future, float("-inf"))):
            return forward(*xs)

    return masked


def maskable(spec) -> bool:
    """Has the spec a softmax for with_mask to add the mask to (not sigmoid, softplus or linear attention)?"""
    try:
        with_mask(spec)
    except SymattnError:
        return False
    return True
