"""Positions in the memory-efficient variant (issue 52): the row-block loop computes a matrix of positions' block
from the block's own rows and keys, and skips the keys its mask's structure hides (``optimize.mask_structure``).

Each spec adds a matrix of positions to the scores: a causal sliding window, causal written as entries, prefix-LM
with a fixed prefix, bottom-right causal when n ≠ m (j ≤ i + m − n), a window that leaves the first rows no key,
the relative bias −|i − j|/2, a learned slope τ with a band (τ's gradient summed over the blocks), and with a window
as a second matrix of positions (the window written into the scores as −∞, not added), ALiBi's slopes
per head with a causal mask, and a window whose width depends on the head. The NumPy and torch memory-efficient
modules (several blocks, n ≠ m both ways) must match torch autograd of an independent forward (the bias built by
the test from torch.arange, a row whose keys are all masked giving zeros), forward, backward and JVP, float64, and
the standard module where it has no such row; with a mask argument too, the standard module's. At n = m = 1024 the
module makes no n × m array.
"""

from __future__ import annotations

import math
import tracemalloc
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, m, d = dim("n"), dim("m"), dim("d")
TAU = sa.scalar("tau")
BLOCK = 4
SIZES = [(13, 11), (11, 13)]
HEADS, D_K = 3, 2


def _mask(condition):
    return sp.Piecewise((0, condition), (-sp.oo, True))


# name → (the formula f(i, j), the same bias of torch grids i, j and the slope tau)
KINDS = {
    "window": (lambda i, j: _mask((j <= i) & (i - j < 3)), lambda i, j, t: _where((j <= i) & (i - j < 3))),
    "causal": (lambda i, j: _mask(j <= i), lambda i, j, t: _where(j <= i)),
    "prefix": (lambda i, j: _mask((j < 3) | (j <= i)), lambda i, j, t: _where((j < 3) | (j <= i))),
    "offset": (lambda i, j: _mask(j <= i + m - n), None),  # (its reference reads the sizes: _bias)
    "empty-rows": (lambda i, j: _mask((j <= i - 4) & (i - j < 7)), lambda i, j, t: _where((j <= i - 4) & (i - j < 7))),
    "relative": (lambda i, j: -sp.Abs(i - j) / 2, lambda i, j, t: -(i - j).abs() / 2),
    "slope": (
        lambda i, j: -TAU * sp.Abs(i - j) + _mask(sp.Abs(i - j) <= 2),
        lambda i, j, t: -t * (i - j).abs() + _where((i - j).abs() <= 2),
    ),
    "two-terms": (
        lambda i, j: _mask((j <= i) & (i - j < 4)),
        lambda i, j, t: -t * (i - j).abs() + _where((j <= i) & (i - j < 4)),
    ),
}


def _where(visible):
    return torch.where(visible, 0.0, -math.inf).double()


def _spec(kind: str) -> sa.Spec:
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    positions = sa.entries(n, m, KINDS[kind][0]).expr
    if kind == "two-terms":  # a learned slope and a window, two matrices of positions added to the scores
        positions = sa.entries(n, m, lambda i, j: -TAU * sp.Abs(i - j)).expr + positions
    inputs = (q, k, v, TAU) if kind in ("slope", "two-terms") else (q, k, v)
    output = sa.softmax(q * k.T / sp.sqrt(d) + positions) * v
    return sa.Spec(name=f"memeff_{kind.replace('-', '_')}", summary="positions", inputs=inputs, output=output)


def _heads_spec(kind: str) -> sa.Spec:
    """ALiBi's slopes per head, 2^(−8(h+1)/H), and a causal mask: f(i, j, h) of the per-head form; heads-window: a
    causal window of h + 2 keys in head h (a mask that reads the head: every key read, the mask applied)."""
    q, k, v = (sp.MatrixSymbol(x, r, HEADS * d) for x, r in (("Q", n), ("K", m), ("V", m)))

    def alibi(i, j, h):
        if kind == "heads-window":
            return _mask((j <= i) & (i - j <= h + 1))
        return -(2 ** (-8 * (h + 1) / sp.Integer(HEADS))) * sp.Abs(i - j) + _mask(j <= i)

    qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
    scores = qh @ kh.T / sp.sqrt(d) + sa.entries(n, m, alibi, heads=HEADS)
    output = sa.merge_heads(sa.softmax(scores) @ vh, HEADS)
    return sa.Spec(name=f"memeff_{kind.replace('-', '_')}", summary="ALiBi", inputs=(q, k, v), output=output)


def _module(spec: sa.Spec, backend: str, variant: str = "memeff") -> types.ModuleType:
    module = types.ModuleType(f"{spec.name}_{backend}_{variant}")
    source = codegen.render(spec, backend, variant=variant, second_order=False)
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


def _bias(kind, rows, cols, tau):
    i = torch.arange(rows, dtype=torch.float64)[:, None]
    j = torch.arange(cols, dtype=torch.float64)[None, :]
    if kind == "offset":
        return _where(j <= i + cols - rows)
    if kind == "heads-window":
        h = torch.arange(HEADS, dtype=torch.float64)[:, None, None]
        return _where((j <= i) & (i - j <= h + 1))
    if kind == "heads":
        slopes = torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], dtype=torch.float64)
        return -slopes[:, None, None] * (i - j).abs() + _where(j <= i)
    return KINDS[kind][1](i, j, tau)


def _softmax(scores):
    """softmax of rows that may be all −∞: zeros there, with zero derivatives (as the modules give)."""
    empty = torch.isinf(scores).all(dim=-1, keepdim=True)
    p = torch.softmax(torch.where(empty, 0.0, scores), dim=-1)
    return torch.where(empty, 0.0, p)


def reference(kind, q, k, v, tau=None):
    if kind.startswith("heads"):

        def heads(x):
            return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)

        scores = heads(q) @ heads(k).mT / math.sqrt(D_K) + _bias(kind, q.shape[-2], k.shape[-2], tau)
        out = _softmax(scores) @ heads(v)
        return out.transpose(-3, -2).reshape(*q.shape[:-1], HEADS * D_K)
    scores = q @ k.mT / math.sqrt(q.shape[-1]) + _bias(kind, q.shape[-2], k.shape[-2], tau)
    return _softmax(scores) @ v


def _inputs(kind, size, seed):
    g = torch.Generator().manual_seed(seed)
    rows, cols = size
    width = HEADS * D_K if kind.startswith("heads") else 3
    tensors = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in tensors]
    cotangent = torch.randn(2, rows, width, generator=g, dtype=torch.float64)
    if kind in ("slope", "two-terms"):
        tensors.append(torch.tensor(0.3, dtype=torch.float64))
        tangents.append(torch.tensor(0.7, dtype=torch.float64))
    return tensors, tangents, cotangent


def _wanted(kind, inputs, tangents, cotangent):
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = reference(kind, *leaves)
    grads = torch.autograd.grad(out, leaves, cotangent)
    _, tangent = torch.func.jvp(lambda *x: reference(kind, *x), tuple(inputs), tuple(tangents))
    return out.detach(), grads, tangent


ALL = [*KINDS, "heads", "heads-window"]
NAMES = ("Q", "K", "V", "tau")


def _spec_of(kind):
    return _heads_spec(kind) if kind.startswith("heads") else _spec(kind)


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("kind", ALL)
def test_the_numpy_memeff_module_matches_autograd(kind, size):
    module = _module(_spec_of(kind), "numpy")
    inputs, tangents, cotangent = _inputs(kind, size, seed=1)
    want, grads, want_tangent = _wanted(kind, inputs, tangents, cotangent)
    arrays = [x.numpy() for x in inputs]
    out, saved = module.forward(*arrays, block_size=BLOCK)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = module.backward(saved, cotangent.numpy())
    for name, w in zip(NAMES, grads):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    named = dict(zip(NAMES, (t.numpy() for t in tangents)))
    _, tangent = module.jvp(*arrays, named, block_size=BLOCK)
    np.testing.assert_allclose(tangent, want_tangent.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("kind", ALL)
def test_the_torch_memeff_module_matches_autograd_and_the_standard_module(kind, size):
    spec = _spec_of(kind)
    inputs, tangents, cotangent = _inputs(kind, size, seed=2)
    want, grads, want_tangent = _wanted(kind, inputs, tangents, cotangent)
    results = []
    for variant, extra in (("memeff", {"block_size": BLOCK}), ("standard", {})):
        module = _module(spec, "torch", variant)
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = module.forward(*leaves, **extra)
        got_grads = torch.autograd.grad(out, leaves, cotangent)
        _, tangent = module.jvp(*inputs, dict(zip(NAMES, tangents)), **extra)
        results.append((out.detach(), *got_grads, tangent))
    for got, wanted in zip(results[0], (want, *grads, want_tangent)):
        torch.testing.assert_close(got, wanted, rtol=1e-10, atol=1e-12)
    bias = _bias(kind, *size, torch.tensor(0.3))
    if not torch.isinf(bias).all(dim=-1).any():  # (a row whose keys are all masked: the standard module's NaN)
        for got, standard in zip(*results):
            torch.testing.assert_close(got, standard, rtol=1e-10, atol=1e-12)


def _source(kind: str, backend: str) -> str:
    return codegen.render(_spec_of(kind), backend, variant="memeff", second_order=False)


def test_the_blocks_read_only_the_keys_the_window_leaves():
    """A causal window of 3 keys: each block of rows reads keys r₀ − 2 … r₁ − 1, computed from the structure."""
    source = _source("window", "numpy")
    assert "keys = key_window(max(0, block.start - 2), min(m, min(block.stop, Q.shape[-2])), K.shape[-2], None)" in (
        source
    )
    # a pure mask (0 or −∞) is −∞ written into the block's scores, looked for only on the keys outside the range
    # every row of the block sees (r₁ − 3 … r₀)
    assert "hide_keys(wide_matmul(scale * Q_b, K_k.mT), lambda i, j: ((i < j) | ((i - j) >= 3)), block, keys" in source
    assert "slice(max(0, min(block.stop, n) - 3), min(m, block.start + 1))" in source
    assert " entries(lambda" not in source and "block_entries" not in source
    # no mask, or one that reads the head: every key (the bias computed on them block by block)
    assert "keys = slice(0, m)" in _source("relative", "torch")
    assert "keys = slice(0, m)" in _source("heads-window", "torch")
    # per head, a causal mask: rows r₀ … r₁ − 1 read keys 0 … r₁ − 1, the block of every head at once
    heads = _source("heads", "numpy")
    assert "keys = key_window(0, min(m, min(block.stop, F1.shape[-2])), F2.shape[-2], None)" in heads
    assert "block_entries(lambda i, j, h:" in heads and "heads=3" in heads


def test_the_memeff_module_makes_no_n_by_m_array_for_the_positions():
    """At n = m = 1024 an n × m float64 array is 8 MiB; forward and backward stay well below it."""
    module = _module(_spec("slope"), "numpy")
    rng = np.random.default_rng(3)
    size, width = 1024, 8
    q, k, v, g = (rng.standard_normal((size, width)) for _ in range(4))
    module.backward(module.forward(q, k, v, np.float64(0.3), block_size=64)[1], g)  # (compiled kernels: first use)
    tracemalloc.start()
    try:
        _, saved = module.forward(q, k, v, np.float64(0.3), block_size=64)
        module.backward(saved, g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size * size * 8 / 4, f"peak {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("open_keys", [(0, 0), (2, 6), (0, 6), (5, 9), (9, 12), (3, 4), (0, 12)], ids=str)
def test_hide_keys_writes_minus_infinity_where_hidden_whatever_the_open_range(open_keys):
    """hide_keys(scores, hidden, rows, keys, …, open) = where(hidden, −∞, scores) when no key of the open range is
    hidden (the structure's promise): the open keys at one end of the block's keys are not looked at, others are."""
    from symattn.codegen.backends.numpy.positions_runtime import hide_keys as numpy_hide
    from symattn.codegen.backends.torch.positions_runtime import hide_keys as torch_hide

    rows, keys, lo, hi = slice(4, 8), slice(3, 12), *open_keys

    def hidden(i, j):  # visible: the open keys, and j ≤ i elsewhere
        return ~(((j >= lo) & (j < hi)) | (j <= i))

    scores = np.random.default_rng(5).standard_normal((2, 4, 9))
    i, j = np.arange(4, 8)[:, None], np.arange(3, 12)[None, :]
    want = np.where(hidden(i, j), -np.inf, scores)
    got = numpy_hide(scores.copy(), hidden, rows, keys, 16, slice(lo, hi), np.float64)
    np.testing.assert_array_equal(got, want)
    copied = torch.as_tensor(scores)
    got = torch_hide(copied, hidden, rows, keys, 16, slice(lo, hi), torch.float64, "cpu", inplace=False)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(copied.numpy(), scores)  # (not in place: the scores as they were)


def _spec_with_a_mask() -> sa.Spec:
    """A window of positions and the additive mask argument M (attn_mask, causal, key_padding_mask) together."""
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    mask = sp.MatrixSymbol("M", n, m)
    window = sa.entries(n, m, KINDS["window"][0]).expr
    output = sa.softmax(q * k.T / sp.sqrt(d) + window + mask) * v
    return sa.Spec(
        name="memeff_window_and_mask",
        summary="window and mask",
        inputs=(q, k, v),
        output=output,
        options={"mask": True, "causal": True, "key_padding_mask": True},
        constants=(mask,),
    )


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_positions_and_a_mask_argument_together_skip_the_keys_of_both(backend):
    """The block reads the keys both leave (key_window within key_range) and matches the standard module, which
    takes both whole; a batch entry whose keys are all padded gives zeros in both."""
    spec = _spec_with_a_mask()
    source = codegen.render(spec, backend, variant="memeff", second_order=False)
    assert "key_window(max(0, block.start - 2)" in source and "key_range(M, causal, block" in source
    memeff, standard = _module(spec, backend), _module(spec, backend, "standard")
    rng = np.random.default_rng(6)
    q, k, v, g = (rng.standard_normal((2, r, 3)) for r in (13, 11, 11, 13))
    padding = np.zeros((2, 11), dtype=bool)
    padding[0, 1::3], padding[1, :] = True, True
    masks = {"attn_mask": rng.random((2, 13, 11)) < 0.3, "causal": True, "key_padding_mask": padding}
    if backend == "numpy":
        got, saved = memeff.forward(q, k, v, block_size=BLOCK, **masks)
        want, want_saved = standard.forward(q, k, v, **masks)
        pairs = [(got, want)] + [(memeff.backward(saved, g)[x], standard.backward(want_saved, g)[x]) for x in "QKV"]
    else:
        masks = {
            key: torch.as_tensor(value) if isinstance(value, np.ndarray) else value for key, value in masks.items()
        }
        pairs = []
        for module, extra in ((memeff, {"block_size": BLOCK}), (standard, {})):
            leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
            out = module.forward(*leaves, **extra, **masks)
            pairs.append([out.detach(), *torch.autograd.grad(out, leaves, torch.as_tensor(g))])
        pairs = [(a.numpy(), b.numpy()) for a, b in zip(*pairs)]
    assert not np.any(pairs[0][0][1])  # (every key of batch entry 1 padded: zeros)
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_mask_whose_keys_cannot_be_narrowed_reads_every_key():
    """(i − j)² ≤ 4 in self-attention: no condition linear in i and j, so each block reads keys 0 … n − 1 (the window
    spans n, a size alone) and applies the mask there; against the formula evaluated with NumPy."""
    q, k, v = (sp.MatrixSymbol(x, n, d) for x in "QKV")
    band = sa.entries(n, n, lambda i, j: _mask((i - j) ** 2 <= 4)).expr
    spec = sa.Spec("memeff_band", "band", (q, k, v), sa.softmax(q * k.T / sp.sqrt(d) + band) * v)
    module = _module(spec, "numpy")
    assert "keys = key_window(0, n, K.shape[-2], None)" in codegen.render(spec, "numpy", "memeff", second_order=False)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 9, 3)) for _ in range(3))
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    scores = np.where((i - j) ** 2 <= 4, q @ k.swapaxes(-1, -2) / np.sqrt(3), -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = weights / weights.sum(-1, keepdims=True) @ v
    np.testing.assert_allclose(module.forward(q, k, v, block_size=BLOCK)[0], want, rtol=1e-12, atol=1e-12)
