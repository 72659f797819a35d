"""sa.from_torch of softmax(…, dtype=torch.float32), as ViT, CLIP, OPT and Llama write it: the traced spec is the
exact softmax (right whatever the precision), the call's line is kept on the trace (``Traced.upcast``), a
narrower dtype is refused, and the generated module matches autograd of the original."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rendered import close, load  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.source import trace  # noqa: E402


def upcast_attention(q, k, v):
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def plain_attention(q, k, v):
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return probs @ v


def half_attention(q, k, v):
    return torch.softmax(q @ k.mT, -1, torch.float16).to(q.dtype) @ v


def _examples(n: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, n, 4, dtype=torch.float64, generator=g) for _ in range(3))


def test_softmax_in_float32_is_the_softmax_and_its_line_is_kept():
    traced = trace(upcast_attention, _examples(5, 0))
    assert traced.spec.output == sa.from_torch(plain_attention, *_examples(5, 0)).output
    assert len(traced.upcast) == 1 and "test_from_torch_softmax_dtype.py:" in traced.upcast[0]
    assert "dtype=torch.float32" in traced.upcast[0]
    assert trace(plain_attention, _examples(5, 0)).upcast == ()


def test_the_generated_module_matches_autograd_of_the_float32_softmax_code():
    module = load(sa.from_torch(upcast_attention, *_examples(5, 0)), "torch")
    q, k, v = (t.requires_grad_() for t in _examples(7, 1))
    want = upcast_attention(q, k, v)  # float64 in, float32 softmax: the example's rounding, 1e-7
    got = module.forward(q, k, v)
    exact = plain_attention(q, k, v)
    close(got.detach(), exact.detach(), "output")
    assert (got - want).abs().max() < 1e-6
    g = torch.randn_like(exact)
    for a, b, name in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(exact, (q, k, v), g), "qkv"):
        close(a, b, f"∂f/∂{name}")


def test_a_softmax_rounded_below_float32_is_refused_in_one_line():
    with pytest.raises(sa.SymattnError, match=r"cannot trace softmax: dtype=torch.float16 rounds .*test_from_torch"):
        sa.from_torch(half_attention, *_examples(5, 0))
