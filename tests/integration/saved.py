"""What autograd saves for the backward of one call, for the tests that check no n × m array is kept."""

from __future__ import annotations


def saved_sizes(module, tensors, **options) -> list[int]:
    """The number of entries of every tensor autograd saves for the backward of module.forward(*tensors, **options)
    (the floating-point tensors made leaves that require grad)."""
    import torch  # (imported where used: the tests that call this skip without torch)

    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        module.forward(*(x.requires_grad_() if x.is_floating_point() else x for x in tensors), **options)
    return sizes
