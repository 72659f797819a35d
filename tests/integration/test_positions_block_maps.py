"""Masks on data in the memory-efficient variant (issue 52): a block map per call (``optimize.block_tests``).

A mask whose condition reads a constant at positions (document ids doc[i, 0] = doc[j, 0], a prefix length per
sequence j < p[0, 0]) has no structure until the constant's numbers are read. The memory-efficient NumPy and torch
modules compute, per call and before each loop, the block map from the per-block least and greatest ids
(O(n/b · m/b)): each block of rows reads only the keys from its first to its last key block that is not wholly
masked (for every sequence of the batch) and applies the mask only outside the wholly open key blocks.

Checked here: output and every gradient against torch autograd of an independent forward (the mask built densely by
the test with torch), float64, for document masks (contiguous documents, several per sequence, different per
sequence, causal within documents, per head with heads=H, ids in no order), a row of no key (zeros), and prefix-LM
with a prefix length per sequence; the blocks computed are exactly the ones the map leaves (counted through the
module's key_window and hide_keys), far fewer than all; a condition whose block test cannot be derived computes every
block with the mask.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, d = dim("n"), dim("d")
HEADS, D_K, BLOCK = 2, 3, 8
DOC, PREFIX = sp.MatrixSymbol("doc", n, 1), sp.MatrixSymbol("p", 1, 1)


def _mask(condition):
    return sp.Piecewise((0, condition), (-sp.oo, True))


def _same(i, j):
    return sp.Eq(DOC[i, 0], DOC[j, 0])


# name → (the visible condition of i, j; the same of torch grids i, j (n × 1, 1 × n), ids (B, n, 1), prefixes (B, 1, 1))
KINDS = {
    "documents": (_same, lambda i, j, doc, p: doc == doc.mT),
    "causal-documents": (lambda i, j: (j <= i) & _same(i, j), lambda i, j, doc, p: (j <= i) & (doc == doc.mT)),
    "strict-documents": (lambda i, j: (j < i) & _same(i, j), lambda i, j, doc, p: (j < i) & (doc == doc.mT)),
    "prefix": (lambda i, j: (j <= i) | (j < PREFIX[0, 0]), lambda i, j, doc, p: (j <= i) | (j < p)),
}
ALL = [*KINDS, "heads"]


def _spec(kind: str) -> sa.Spec:
    width = HEADS * d if kind == "heads" else d
    q, k, v = (sp.MatrixSymbol(x, n, width) for x in "QKV")
    constant = PREFIX if kind == "prefix" else DOC
    name = f"block_map_{kind.replace('-', '_')}"
    if kind == "heads":  # the ids of each sequence read per head (entries(…, heads=H))
        qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
        mask = sa.entries(n, n, lambda i, j, h: _mask(_same(i, j)), heads=HEADS)
        output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + mask) @ vh, HEADS)
        return sa.Spec(name, "documents per head", (q, k, v), output, constants=(constant,))
    mask = sa.entries(n, n, lambda i, j: _mask(KINDS[kind][0](i, j))).expr
    output = sa.softmax(q * k.T / sp.sqrt(d) + mask) * v
    return sa.Spec(name, "a mask on data", (q, k, v), output, constants=(constant,))


def _module(kind: str, backend: str) -> types.ModuleType:
    spec = _spec(kind)
    module = types.ModuleType(f"{spec.name}_{backend}")
    source = codegen.render(spec, backend, variant="memeff", second_order=False)
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((size,), float(k)) for k, size in enumerate(lengths)]).double()[:, None]


# two sequences of 37 tokens: several documents each, laid out differently (blocks of 8: edges inside blocks)
LAYOUTS = {
    "contiguous": [_ids([5, 12, 3, 17]), _ids([20, 17])],
    "unordered": [torch.tensor([[3.0], [1.0], [3.0], [2.0]] * 9 + [[1.0]]).double(), _ids([9, 9, 9, 10]).flip(0)],
}


def _softmax(scores):
    """softmax of rows that may be all −∞: zeros there, with zero derivatives (as the modules give)."""
    empty = torch.isinf(scores).all(dim=-1, keepdim=True)
    return torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, scores), dim=-1))


def reference(kind, q, k, v, constant):
    """softmax(Q Kᵀ/√d + where(visible, 0, −∞)) V, the visible mask made densely with torch."""
    rows = q.shape[-2]
    i, j = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    doc, p = (constant, None) if constant.shape[-2] == rows else (None, constant)
    visible = KINDS["documents" if kind == "heads" else kind][1](i, j, doc, p)
    bias = torch.where(visible, 0.0, -math.inf).double()
    if kind == "heads":

        def heads(x):
            return x.unflatten(-1, (HEADS, D_K)).transpose(-3, -2)

        out = _softmax(heads(q) @ heads(k).mT / math.sqrt(D_K) + bias[..., None, :, :]) @ heads(v)
        return out.transpose(-3, -2).flatten(-2)
    return _softmax(q @ k.mT / math.sqrt(q.shape[-1]) + bias) @ v


def _inputs(kind: str, layout: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    width = HEADS * D_K if kind == "heads" else 4
    q, k, v, cotangent = (torch.randn(2, 37, width, generator=g, dtype=torch.float64) for _ in range(4))
    constant = torch.stack(LAYOUTS[layout])
    if kind == "prefix":
        constant = torch.tensor([3.0, 19.0], dtype=torch.float64).view(2, 1, 1)
    return (q, k, v, constant), cotangent


def _wanted(kind, inputs, cotangent):
    leaves = [x.clone().requires_grad_() for x in inputs[:3]]
    out = reference(kind, *leaves, inputs[3])
    return out.detach(), torch.autograd.grad(out, leaves, cotangent)


CASES = [(kind, layout) for kind in ALL for layout in LAYOUTS if kind != "prefix" or layout == "contiguous"]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_the_torch_memeff_module_matches_autograd(kind, layout):
    module = _module(kind, "torch")
    inputs, cotangent = _inputs(kind, layout, seed=1)
    want, grads = _wanted(kind, inputs, cotangent)
    leaves = [x.clone().requires_grad_() for x in inputs[:3]]
    out = module.forward(*leaves, inputs[3], block_size=BLOCK)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for name, got, w in zip("QKV", torch.autograd.grad(out, leaves, cotangent), grads):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12, msg=name)
    if kind == "strict-documents" and layout == "contiguous":  # (each document's first row sees no key: zeros)
        assert not out[0, 0].any() and not out[1, 20].any()


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_the_numpy_memeff_module_matches_autograd(kind, layout):
    module = _module(kind, "numpy")
    inputs, cotangent = _inputs(kind, layout, seed=2)
    want, grads = _wanted(kind, inputs, cotangent)
    out, saved = module.forward(*(x.numpy() for x in inputs), block_size=BLOCK)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = module.backward(saved, cotangent.numpy())
    for name, w in zip("QKV", grads):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def _blocks_seen(visible: np.ndarray, size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Per block of rows, from the dense visible mask: the keys from its first to its last key block with a visible
    pair, and the number of keys among them outside key blocks wholly visible (where the mask is looked at)."""
    rows, keys = visible.shape
    spans, looked = [], []
    for r in range(0, rows, size):
        blocks = [visible[r : r + size, k : k + size] for k in range(0, keys, size)]
        seen = [k for k, b in enumerate(blocks) if b.any()]
        lo, hi = seen[0] * size, min(keys, (seen[-1] + 1) * size)
        spans.append((lo, hi))
        looked.append(sum(b.shape[1] for k, b in enumerate(blocks) if lo <= k * size < hi and not b.all()))
    return spans, looked


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_blocks_computed_are_the_ones_the_map_leaves(backend, monkeypatch):
    """Eight documents of 8 to 24 tokens at n = 128 in blocks of 8: each block of rows reads exactly the keys its
    block map leaves (the hull of its key blocks with a visible pair: for contiguous documents, exactly those), forward
    and backward, and looks the mask up only on the key blocks that are not wholly open; under a fifth of n²."""
    module = _module("causal-documents", backend)
    lengths = [13, 24, 8, 19, 16, 9, 21, 18]
    doc = _ids(lengths)[None].numpy() if backend == "numpy" else _ids(lengths)[None]
    i = np.arange(128)
    visible = (i[None, :] <= i[:, None]) & (np.asarray(doc)[0] == np.asarray(doc)[0].T)
    spans, looked = _blocks_seen(visible, BLOCK)
    read, masked = [], []
    window, hide = module.key_window, module.hide_keys

    def key_window(*args):
        read.append(window(*args))
        return read[-1]

    def hide_keys(scores, hidden, rows, *args, **options):
        masked.append(0)  # (the keys the mask is looked up on, over the parts of the block's keys)

        def counted(i, j):
            masked[-1] += j.shape[-1]
            return hidden(i, j)

        return hide(scores, counted, rows, *args, **options)

    monkeypatch.setattr(module, "key_window", key_window)
    monkeypatch.setattr(module, "hide_keys", hide_keys)
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((1, 128, 4)) for _ in range(4))
    if backend == "numpy":
        module.backward(module.forward(q, k, v, doc, block_size=BLOCK)[1], g)
    else:
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        module.forward(*leaves, doc, block_size=BLOCK).backward(torch.tensor(g))
    assert [(s.start, s.stop) for s in read] == spans * 2  # (the forward's blocks, then the backward's)
    assert masked == looked * 2
    computed = sum(hi - lo for lo, hi in spans)  # (keys per block of rows: 280 of 16 · 128 here)
    assert computed * BLOCK < 128 * 128 / 5 and sum(looked) < computed, (computed, sum(looked))


def test_a_condition_whose_block_test_is_not_derived_computes_every_block():
    """A shifted read doc[max(i − 1, 0), 0] (not at i, j or a constant index) has no block test: no block map, every
    key read and the mask applied (right still)."""
    spec_mask = sa.entries(n, n, lambda i, j: _mask(sp.Eq(DOC[sp.Max(i - 1, 0), 0], DOC[j, 0]))).expr
    q, k, v = (sp.MatrixSymbol(x, n, d) for x in "QKV")
    spec = sa.Spec(
        "shifted", "shifted ids", (q, k, v), sa.softmax(q * k.T / sp.sqrt(d) + spec_mask) * v, constants=(DOC,)
    )
    source = codegen.render(spec, "numpy", variant="memeff", second_order=False)
    assert "block_map(" not in source and "keys = key_window(0, n, K.shape[-2], None)\n" in source
    module = types.ModuleType("shifted")
    exec(compile(source, "shifted", "exec"), module.__dict__)
    doc = _ids([5, 12, 3, 17]).numpy()
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((37, 4)) for _ in range(3))
    shifted = doc[np.maximum(np.arange(37) - 1, 0)]
    scores = np.where(shifted == doc.T, q @ k.T / 2, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = weights / weights.sum(-1, keepdims=True) @ v
    np.testing.assert_allclose(module.forward(q, k, v, doc, block_size=BLOCK)[0], want, rtol=1e-12, atol=1e-12)


def test_the_block_test_is_derived_from_the_condition():
    """Equal ids: wholly masked where the blocks' id ranges are disjoint, wholly open where both hold one equal id;
    a prefix per sequence: open where every key is before the prefix or before the block's first row."""
    from symattn.lang.positions import I, J
    from symattn.optimize.block_tests import block_test

    test = block_test(_mask(sp.Eq(DOC[I, 0], DOC[J, 0])))
    assert [str(r.element) for r in test.reads] == ["doc[i, 0]", "doc[j, 0]"]
    assert str(test.empty) == "(t0_lo - t1_hi > 0) | (t0_hi - t1_lo < 0)"
    assert str(test.full) == "(t0_lo - t1_hi >= 0) & (t0_hi - t1_lo <= 0)"
    prefix = block_test(_mask((J <= I) | (J < PREFIX[0, 0])))
    assert str(prefix.full) == "(i - j_last >= 0) | (j_last - t0_lo < 0)"
    assert block_test(_mask(J <= I)) is None  # (analytic: mask_structure's)


def test_vmap_over_the_sequences_and_their_ids_computes_every_block_and_matches():
    """torch.func.vmap over the batch, the ids batched too: no branch on their values there (an empty map, every
    block computed with the mask), the output as the reference's."""
    module = _module("causal-documents", "torch")
    (q, k, v, doc), _ = _inputs("causal-documents", "contiguous", seed=5)
    got = torch.func.vmap(lambda *x: module.forward(*x, block_size=BLOCK))(q, k, v, doc)
    torch.testing.assert_close(got, reference("causal-documents", q, k, v, doc), rtol=1e-10, atol=1e-12)


def test_off_the_cpu_no_value_is_read_back():
    """On meta tensors (a shape, no data) the module runs forward and backward: off the CPU the block map is empty
    (every block computed with the mask), nothing read back from the device to decide a path."""
    module = _module("causal-documents", "torch")
    q, k, v = (torch.empty(2, 37, 4, device="meta", dtype=torch.float64, requires_grad=True) for _ in range(3))
    doc = torch.empty(2, 37, 1, device="meta", dtype=torch.float64)
    out = module.forward(q, k, v, doc, block_size=BLOCK)
    grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert out.shape == (2, 37, 4) and all(g.shape == (2, 37, 4) and g.device.type == "meta" for g in grads)


@pytest.mark.parametrize("runs", [[], [(8, 16)], [(0, 8), (16, 24)], [(8, 24)], [(16, 21)]], ids=str)
def test_hide_keys_looks_the_mask_up_outside_the_open_runs_only(runs):
    """hide_keys(…, blocks) = where(hidden, −∞, scores) when every key of the map's open runs is visible to the
    block's rows (the map's promise), wherever the runs lie in the block's keys; the runs' keys are not looked at."""
    from symattn.codegen.backends.common_runtime import _parts_looked_at
    from symattn.codegen.backends.numpy.positions_runtime import hide_keys as numpy_hide
    from symattn.codegen.backends.torch.positions_runtime import hide_keys as torch_hide

    rows, keys = slice(8, 16), slice(3, 21)
    blocks = (8, [(0, 21, []), (0, 21, [slice(a, b) for a, b in runs])])  # (the entry of rows 8 … 15: the second)

    def hidden(i, j):  # visible: the runs' keys, and j ≤ i − 2 elsewhere
        inside = sum(((j >= a) & (j < b) for a, b in runs), j < 0)
        return ~(inside | (j <= i - 2))

    scores = np.random.default_rng(6).standard_normal((2, 8, 18))
    i, j = np.arange(8, 16)[:, None], np.arange(3, 21)[None, :]
    want = np.where(hidden(i, j), -np.inf, scores)
    got = numpy_hide(scores.copy(), hidden, rows, keys, 21, slice(0, 0), np.float64, blocks=blocks)
    np.testing.assert_array_equal(got, want)
    got = torch_hide(torch.as_tensor(scores), hidden, rows, keys, 21, slice(0, 0), torch.float64, "cpu", blocks=blocks)
    np.testing.assert_array_equal(got.numpy(), want)
    looked = sum(stop - first for first, stop in _parts_looked_at(keys, slice(0, 0), blocks[1][1][2]))
    assert looked == 18 - sum(min(b, 21) - max(a, 3) for a, b in runs)
