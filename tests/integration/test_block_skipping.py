"""The memory-efficient modules skip the keys no query row of a block may see (issue 27, masked blocks).

Each block of query rows reads only the key range its mask leaves (``key_range``: causal, a key padding, a
boolean attn_mask such as a sliding window), and the causal part is written into each block of scores
(``causal_fill``) instead of an n × m mask. The results must be those of the standard module, which takes the
mask whole: forward, backward and JVP, in NumPy and torch, with several blocks, n ≠ m and rows whose keys
are all masked.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from symattn.generated import attention_numpy, attention_numpy_memeff

torch = pytest.importorskip("torch", reason="the torch modules are compared too")
from symattn.generated import attention_torch, attention_torch_memeff  # noqa: E402

B, N, M, D = 2, 13, 11, 3


def _masks(rng: np.random.Generator) -> dict[str, dict]:
    """Mask keywords: causal; causal with keys padded at both ends (one batch entry's every key padded); a
    sliding window (query i sees keys i−3 … i) as a boolean attn_mask; a random boolean mask with padding."""
    padding = np.zeros((B, M), dtype=bool)
    padding[0, :2], padding[0, -3:], padding[1, :] = True, True, True
    window = _window(N, M)
    random = rng.random((B, N, M)) < 0.4
    return {
        "causal": {"causal": True},
        "causal-padding": {"causal": True, "key_padding_mask": padding},
        "window": {"attn_mask": window},
        "random-padding": {"attn_mask": random, "key_padding_mask": padding},
    }


def _window(n: int, m: int) -> np.ndarray:
    """A sliding window as a boolean mask (True: not allowed): query i sees keys i − 3 … i."""
    behind = np.arange(n)[:, None] - np.arange(m)[None, :]
    return (behind < 0) | (behind > 3)


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((B, N, D)), rng.standard_normal((B, M, D)), rng.standard_normal((B, M, D))
    g = rng.standard_normal((B, N, D))
    tangents = {
        "Q": rng.standard_normal((B, N, D)),
        "K": rng.standard_normal((B, M, D)),
        "V": rng.standard_normal((B, M, D)),
    }
    return rng, (q, k, v), g, tangents


@pytest.mark.parametrize("case", ["causal", "causal-padding", "window", "random-padding"])
def test_numpy_memeff_with_skipped_keys_equals_the_standard_module(case):
    rng, inputs, g, tangents = _data()
    masks = _masks(rng)[case]
    want, saved = attention_numpy.forward(*inputs, **masks)
    want_grads = attention_numpy.backward(saved, g)
    _, want_tangent = attention_numpy.jvp(*inputs, tangents, **masks)
    got, saved = attention_numpy_memeff.forward(*inputs, block_size=4, **masks)
    got_grads = attention_numpy_memeff.backward(saved, g)
    _, got_tangent = attention_numpy_memeff.jvp(*inputs, tangents, block_size=4, **masks)
    assert np.abs(got - want).max() <= 1e-12
    assert np.abs(got_tangent - want_tangent).max() <= 1e-12
    for name in "QKV":
        assert np.abs(got_grads[name] - want_grads[name]).max() <= 1e-12, name


@pytest.mark.parametrize("case", ["causal", "causal-padding", "window", "random-padding"])
def test_torch_memeff_with_skipped_keys_equals_the_standard_module(case):
    rng, inputs, g, tangents = _data(1)
    masks = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in _masks(rng)[case].items()}
    leaves = [torch.tensor(x, requires_grad=True) for x in inputs]
    results = []
    for module, extra in ((attention_torch, {}), (attention_torch_memeff, {"block_size": 4})):
        out = module.forward(*leaves, **extra, **masks)
        grads = torch.autograd.grad(out, leaves, torch.as_tensor(g))
        _, tangent = module.jvp(*leaves, {k: torch.as_tensor(t) for k, t in tangents.items()}, **extra, **masks)
        results.append((out, *grads, tangent))
    for got, want in zip(results[1], results[0]):
        assert float((got - want).detach().abs().max()) <= 1e-12


@pytest.mark.parametrize("module", [attention_numpy_memeff, attention_torch_memeff], ids=["numpy", "torch"])
def test_key_range_is_the_smallest_range_of_seen_keys(module):
    as_array = np.asarray if module is attention_numpy_memeff else torch.as_tensor
    # causal: rows 4 … 7 see keys 0 … 7; rows past the keys (n > m) see them all
    assert module.key_range(None, True, slice(4, 8), 11) == slice(0, 8)
    assert module.key_range(None, True, slice(12, 16), 11) == slice(0, 11)
    # a sliding window: rows 8 … 11 see keys 5 … 11 only
    window = as_array(np.where(_window(16, 16), -np.inf, 0.0))
    assert module.key_range(window, False, slice(8, 12), 16) == slice(5, 12)
    assert module.key_range(window, True, slice(8, 12), 16) == slice(5, 12)
    # every key of the block masked: one key read (its probability is zero), never an empty range
    assert module.key_range(as_array(np.full((4, 6), -np.inf)), False, slice(0, 4), 6) == slice(0, 1)
    # the causal blocks of n = 64 rows read 8 + 16 + … + 64 keys: 288 of 512
    total = sum(module.key_range(None, True, slice(s, s + 8), 64).stop for s in range(0, 64, 8))
    assert total == 288


def test_numpy_memeff_causal_makes_no_n_by_m_array():
    """At n = m = 1024 an n × m float64 array is 8 MiB: the causal mask is never one (it was, whole, before)."""
    rng = np.random.default_rng(2)
    n, d = 1024, 8
    q, k, v, g = (rng.standard_normal((n, d)) for _ in range(4))
    tracemalloc.start()
    try:
        _, saved = attention_numpy_memeff.forward(q, k, v, causal=True, block_size=64)
        attention_numpy_memeff.backward(saved, g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * n * 8 / 2, f"peak {peak / 2**20:.1f} MiB"
