"""torch.compile(dynamic=True) of the generated torch modules (issue 40): the sizes are symbols, so a float option
(scale, whose default 1/√d_k is a symbolic float; eps; even a float the user gives) is one too, and an autograd
Function's forward may return tensors, ints and bools only. The forward saves no float option: the Function's
setup_context keeps it as given and the backward resolves it again. One compiled function runs at two sizes (the
sequence length and the head dimension both changed); output and gradients equal the eager ones."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from symattn.generated import (  # noqa: E402
    attention_torch,
    attention_torch_memeff,
    mha_torch,
    transformer_block_torch,
)

SIZES = ((6, 4), (9, 8))  # (n, d): rows and the head dimension, both changed between the two calls
F64 = torch.float64


def _drawn(*shapes):
    return [torch.randn(*shape, dtype=F64, requires_grad=True) for shape in shapes]


def _attention(n, d):
    return _drawn((2, n, d), (2, n + 1, d), (2, n + 1, d))


def _mha(n, d, heads=2):
    width = heads * d
    return _drawn((2, n, width), *[(width, width)] * 4, *[(1, width)] * 4)


def _block(n, d, heads=2):
    width = heads * d  # d_ff = 7: never the width (equal sizes at the first call would be guarded equal: duck sizing)
    return _drawn((2, n, width), *[(width, width)] * 4, *[(1, width)] * 4, (width, 7), (7, width))


def _block_forward(x, w_q, w_k, w_v, w_o, gamma_1, beta_1, gamma_2, beta_2, w_1, w_2):
    return transformer_block_torch.forward(
        x, w_q, w_k, w_v, w_o, gamma_1, beta_1, gamma_2, beta_2, w_1, w_2, num_heads=2, causal=True
    )


CASES = {
    "attention": (attention_torch.forward, _attention),
    "attention, a scale given": (lambda q, k, v: attention_torch.forward(q, k, v, scale=0.3), _attention),
    "attention causal": (lambda q, k, v: attention_torch.forward(q, k, v, causal=True), _attention),
    "attention float mask": (
        lambda q, k, v, m: attention_torch.forward(q, k, v, attn_mask=m),
        lambda n, d: [*_attention(n, d), *_drawn((n, n + 1))],
    ),
    "attention memeff, blocks of rows": (
        lambda q, k, v: attention_torch_memeff.forward(q, k, v, causal=True, block_size=4),
        _attention,
    ),
    "mha": (lambda x, *w: mha_torch.forward(x, x, x, *w, num_heads=2, causal=True), _mha),
    "transformer_block (eps)": pytest.param((_block_forward, _block), marks=pytest.mark.slow),
    "attention jvp": (lambda q, k, v: attention_torch.jvp(q, k, v, {"K": v})[1], _attention),
}


def _run(function, args):
    """The output and the gradients of ⟨a fixed weighting, output⟩ with respect to every argument."""
    out = function(*args)
    weighted = out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return [out.detach(), *torch.autograd.grad(weighted.sum(), args, allow_unused=True)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_compile_dynamic_runs_at_two_sizes(name):
    """…in one graph where every length fits one block of rows (the standard modules: no recompile per length)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    function, drawn = CASES[name].values[0] if hasattr(CASES[name], "values") else CASES[name]  # (a pytest.param)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(function, backend=counter, fullgraph=True, dynamic=True)
    for n, d in SIZES:
        torch.manual_seed(n)
        args = drawn(n, d)
        want, got = _run(function, args), _run(compiled, args)
        assert want[0].shape == got[0].shape and want[0].shape[-2] == n
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or (a - b).abs().max() < 1e-12
    if "memeff" not in name:
        assert counter.frame_count == 1, counter.frame_count


def test_the_drop_in_compiles_dynamic_at_two_sequence_lengths():
    """The drop-in MultiheadAttention (its scale the default 1/√d_k), one module compiled with dynamic=True, at
    two sequence lengths."""
    torch.manual_seed(0)
    module = mha_torch.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for n in (5, 11):
        (x,) = _drawn((2, n, 8))
        want = _run(lambda t: module(t, t, t, need_weights=False)[0], [x])
        got = _run(lambda t: compiled(t, t, t, need_weights=False)[0], [x])
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max() < 1e-12
