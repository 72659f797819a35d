"""Runtime helpers of generated PyTorch modules for memory in transparent huge pages: a fresh n × m tensor
(the scores Q Kᵀ, dP, P) written into memory advised for them (``huge_empty``, ``huge_matmul``), and, compiled,
the custom ops symattn::big_matmul, symattn::placed_rows and symattn::row_softmax_ that let inductor's graphs do
the same.

Real code, linted and tested; ``TorchMatrixPrinter`` copies the source of the ones a module calls into it
(see ``torch_runtime``). Generating code reads this module's source only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a torch module reads this source, it needs no torch
    from types import SimpleNamespace

    torch = SimpleNamespace()


def _assume_constant(function):
    """function marked as torch._dynamo.assume_constant_result marks it: dynamo, tracing a call of it, calls it and
    takes the result for a constant. Marked without importing dynamo, seconds that an eager run never needs."""
    function._dynamo_marked_constant = True
    return function


def huge_matmul(a, b):
    """a @ b written into huge_empty memory: the eager path of big_matmul and the custom op's implementation."""
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    return torch.matmul(a, b, out=huge_empty(shape, a))


@_assume_constant  # run, not traced, by dynamo: it registers ops, which no graph can hold
def _compiled_ops():
    """May a compiled graph call the custom ops symattn::big_matmul (huge_matmul, for factors of one batch shape),
    symattn::placed_rows (_place) and symattn::row_softmax_ (softmax in place)? Not under a torch.func transform
    (vmap, grad, jvp), for which they have no rule; else yes, the ops registered on the first compilation that
    needs them, once per process: every generated module embedding this finds them."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if hasattr(torch.ops.symattn, "row_softmax_"):
        return True

    @torch.library.custom_op("symattn::big_matmul", mutates_args=())
    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return huge_matmul(a, b)

    product.register_fake(lambda a, b: a.new_empty((*a.shape[:-1], b.shape[-1])))

    def save_factors(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def product_backward(ctx, grad):  # d(a b) = da b + a db
        a, b = ctx.saved_tensors
        return grad @ b.mT, a.mT @ grad

    product.register_autograd(product_backward, setup_context=save_factors)

    @torch.library.custom_op("symattn::placed_rows", mutates_args=())
    def placed(parts: list[torch.Tensor], starts: list[int], m: int) -> torch.Tensor:
        return _place(parts, starts, m)

    placed.register_fake(
        lambda parts, starts, m: parts[0].new_empty((*parts[0].shape[:-2], sum(p.shape[-2] for p in parts), m))
    )

    def save_blocks(ctx, inputs, output):
        ctx.blocks = [(part.shape[-2], start, part.shape[-1]) for part, start in zip(inputs[0], inputs[1])]

    def placed_backward(ctx, grad):  # each block's rows and keys of the cotangent
        grads, row = [], 0
        for rows, start, keys in ctx.blocks:
            grads.append(grad[..., row : row + rows, start : start + keys])
            row += rows
        return grads, None, None

    placed.register_autograd(placed_backward, setup_context=save_blocks)

    # softmax along the last axis written over a: functionalized, inductor calls it on the buffer of a (the
    # scores, in huge pages) when nothing reads a after it, where its own softmax would write a fresh buffer.
    # No autograd rule: called only on a tensor that requires no grad (the Function's forward and backward)
    @torch.library.custom_op("symattn::row_softmax_", mutates_args=("a",))
    def softmax_in_place(a: torch.Tensor) -> None:
        torch._softmax(a, -1, False, out=a)

    softmax_in_place.register_fake(lambda a: None)
    return True


def _by_custom_op(like, size):
    """Should a compiled graph make a result of size bytes (of like's device) by a symattn custom op, into huge
    pages as the eager module does? On CPU, compiled and not exported (an exported program must load without
    symattn), from huge_empty's 4 MiB on. Inductor's own buffers are in 4 KiB pages: one of 32 MiB or more is a
    fresh mapping at every call (glibc's malloc maps it anew), whose pages fault at first touch; a smaller one
    comes from malloc's heap and costs TLB misses (mha, B = 1, n = 1024, 16 MiB scores: compiled ÷ eager 1.09 →
    0.92–0.94)."""
    if not torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return like.device.type == "cpu" and size >= 4 << 20 and _compiled_ops()


def huge_empty(shape, like):
    """An uninitialised tensor of like's dtype and device; on Linux, one of 4 MiB or more has its whole 2 MiB
    pages advised for transparent huge pages (madvise MADV_HUGEPAGE, before anything touches them: NumPy's own
    rule for its arrays). Where the advice is not available, a plain torch.empty."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.device.type != "cpu" or out.numel() * out.element_size() < 4 << 20:
        return out
    madvise = _madvise()
    start = -(-out.data_ptr() // (2 << 20)) * (2 << 20)  # the 2 MiB pages inside the tensor
    stop = (out.data_ptr() + out.numel() * out.element_size()) // (2 << 20) * (2 << 20)
    if madvise is not None and stop > start:
        madvise(start, stop - start, 14)  # MADV_HUGEPAGE
    return out


def _madvise():
    """libc's madvise (ctypes, loaded once), or None off Linux or where libc cannot be loaded."""
    found = getattr(_madvise, "found", False)
    if found is False:
        found = None
        import sys

        if sys.platform.startswith("linux"):
            import ctypes

            try:
                found = ctypes.CDLL(None, use_errno=True).madvise
                found.argtypes, found.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
                found = None
        _madvise.found = found
    return found


def _place(parts, starts, m):
    """The blocks of rows parts (..., b_i, k_i) stacked into one (..., Σ b_i, m) tensor in huge_empty memory, each
    at its first key starts[i], zero on the other keys: the custom op symattn::placed_rows."""
    first = parts[0]
    out = huge_empty((*first.shape[:-2], sum(part.shape[-2] for part in parts), m), first)
    row = 0
    for part, start in zip(parts, starts):
        rows = slice(row, row + part.shape[-2])
        write_rows(out, rows, start, part)
        row = rows.stop
    return out


def write_rows(whole, rows, start, part):
    """part (..., b, k) written into whole's rows at keys start … start + k, zeros on whole's other keys there."""
    stop = start + part.shape[-1]
    whole[..., rows, :start] = 0.0
    whole[..., rows, start:stop] = part
    whole[..., rows, stop:] = 0.0
