"""Masks on data in the Triton kernels (issue 52): a block map per call, under Triton's interpreter (16 × 16 tiles).

A mask whose condition reads a table at positions (document ids doc[i, 0] = doc[j, 0], a prefix length per sequence
j < p[0, 0]) has no analytic window. The generated module classes every tile of each batch·head per call, after the
launch plan fixes BLOCK_M × BLOCK_N (``_block_kinds``: the block test of ``optimize.block_tests`` over the tables'
per-block extremes, torch ops, O(n/BLOCK_M · m/BLOCK_N)): empty (never visited), full (the mask not evaluated), partial.
The forward, both parts of the backward and the JVP read it beside the analytic window (the causal part of
causal ∧ documents, the runtime causal flag). Ids per sequence read per head (``sa.entries(…, heads=H)``) have
their heads axis inserted before the kernels read them (``_by_sequence``), as the torch modules read them.

Checked here, on test_positions_block_maps.py's cases (two sequences of 37 tokens, laid out differently, n not a
multiple of the tile): output, every gradient and the JVP against torch autograd of an independent float64 forward
and against the torch module; the map against the dense mask reduced per tile (exact for contiguous documents, sound
for ids in no order); the tiles visited counted through the interpreter's dots and the mask's ``_kept`` flags (the
empty ones never reached, the full ones without the mask); a second derivative (the eager core), torch.func.vmap and
torch.compile; the kernels compile for sm_90 (test_triton.py's compile test).
"""

from __future__ import annotations

import math

import pytest
import test_positions_block_maps as cases  # its specs, layouts and reference (the memory-efficient modules' tests)
from triton_rendered import compare, counted, torch, triton_module  # (skips without torch, triton or the interpreter)

TILE = 16  # the interpreter's BLOCK_M = BLOCK_N
KINDS = [("documents", "contiguous"), ("documents", "unordered"), ("causal-documents", "contiguous")]
KINDS += [("causal-documents", "unordered"), ("prefix", "contiguous")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_block_maps")


def _reference(kind, q, k, v, constant, causal=False):
    """The independent forward (the mask made densely by torch), and the runtime causal flag's j ≤ i with it."""
    if not causal:
        return cases.reference(kind, q, k, v, constant)
    rows = q.shape[-2]
    i, j = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    doc, p = (constant, None) if constant.shape[-2] == rows else (None, constant)
    seen = cases.KINDS[kind][1](i, j, doc, p) & (j <= i)
    return cases._softmax((q @ k.mT / math.sqrt(q.shape[-1])).masked_fill(~seen, -math.inf)) @ v


HEADS = [("heads", "contiguous"), ("heads", "unordered")]  # the ids per sequence read per head (entries(…, heads=H))


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal-flag"])
@pytest.mark.parametrize(("kind", "layout"), KINDS + HEADS)
def test_output_every_gradient_and_the_jvp_match_autograd_and_the_torch_module(kind, layout, causal, folder):
    if causal and kind in ("causal-documents", "heads"):
        pytest.skip("(the condition is causal already; the heads' reference has no causal flag)")
    module = triton_module(cases._spec(kind), folder)
    assert hasattr(module, "_block_kinds")  # (a block map, not every tile masked)
    (q, k, v, constant), cotangent = cases._inputs(kind, layout, seed=11)
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    want = _reference(kind, *exact, constant, causal)
    wanted = torch.autograd.grad(want, exact, cotangent)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    out = module.forward(*leaves, constant.float(), causal=causal)
    grads = torch.autograd.grad(out, leaves, cotangent.float())
    compare(out, want.detach(), f"{kind} {layout} forward", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, wanted):
        compare(got, expected, f"{kind} {layout} d{name}", rtol=1e-4)
    if not causal:  # the torch module (memory-efficient, its own block maps), float64
        theirs = cases._module(kind, "torch").forward(q, k, v, constant, block_size=8)
        compare(out, theirs, f"{kind} {layout} against the torch module", rtol=1e-4)
    g = torch.Generator().manual_seed(12)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (q, k, v)]
    named = {str(cases._spec(kind).constants[0].name): constant.float(), "causal": causal}  # (constants by keyword)
    out_jvp, tangent = module.jvp(
        *(x.float() for x in (q, k, v)), {n: t.float() for n, t in zip("QKV", tangents)}, **named
    )
    _, want_tangent = torch.func.jvp(lambda *x: _reference(kind, *x, constant, causal), (q, k, v), tuple(tangents))
    compare(out_jvp, want.detach(), f"{kind} {layout} jvp output", rtol=1e-4)
    compare(tangent, want_tangent, f"{kind} {layout} jvp tangent", rtol=1e-4)


@pytest.mark.parametrize("kind", ["prefix", "causal-documents"])
def test_a_second_derivative_through_the_eager_core_matches_autograd(kind, folder):
    """create_graph: the eager core differentiated twice, a prefix length per sequence read at p[0, 0] (one value per
    sequence, broadcast over the grids) and ids per sequence; ∇ of ‖∂‖O‖²/∂Q‖² against autograd of the reference."""
    module = triton_module(cases._spec(kind), folder)
    (q, k, v, constant), _ = cases._inputs(kind, "contiguous", seed=14)

    def second(function, inputs):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = function(*leaves)
        (first,) = torch.autograd.grad((out**2).sum(), leaves[0], create_graph=True)
        return torch.autograd.grad((first**2).sum(), leaves)

    wanted = second(lambda *x: cases.reference(kind, *x, constant), (q, k, v))
    got = second(lambda *x: module.forward(*x, constant.float()), [x.float() for x in (q, k, v)])
    for name, a, b in zip("QKV", got, wanted):
        compare(a, b, f"{kind} second derivative {name}", rtol=1e-4)


@pytest.mark.parametrize("how", ["vmap", "compile"])
def test_per_sequence_gradients_under_vmap_and_torch_compile(how, folder):
    """torch.func.vmap of torch.func.grad over the sequences, their ids batched too (the ops' vmap rules: the map of
    the merged batch·heads), and torch.compile(fullgraph=True) of forward and backward (the map made inside the
    launch, which the compiled graph holds as one op), against autograd of the independent forward."""
    module = triton_module(cases._spec("causal-documents"), folder)
    (q, k, v, doc), cotangent = cases._inputs("causal-documents", "contiguous", seed=15)
    if how == "vmap":

        def per_sequence(function, dtype):  # ∂/∂Q of each sequence's loss, one sequence at a time under vmap
            loss = lambda *x: (function(*x) * cotangent[0].to(dtype)).sum()  # noqa: E731
            return torch.func.vmap(torch.func.grad(loss))(*(x.to(dtype) for x in (q, k, v, doc)))

        want = per_sequence(lambda *x: cases.reference("causal-documents", *x), torch.float64)
        compare(per_sequence(module.forward, torch.float32), want, "vmap of grad: dQ per sequence", rtol=1e-4)
        return
    compiled = torch.compile(module.forward, fullgraph=True, backend="aot_eager")
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    out = compiled(*leaves, doc.float())
    grads = torch.autograd.grad(out, leaves, cotangent.float())
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    want = cases.reference("causal-documents", *exact, doc)
    compare(out, want.detach(), "compiled forward", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, torch.autograd.grad(want, exact, cotangent)):
        compare(got, expected, f"compiled d{name}", rtol=1e-4)


def _dense(kind, constant, rows):
    """The visible mask (B, n, n) evaluated densely."""
    i, j = torch.arange(rows)[:, None], torch.arange(rows)[None, :]
    doc, p = (constant, None) if constant.shape[-2] == rows else (None, constant)
    return cases.KINDS[kind][1](i, j, doc, p).expand(constant.shape[0], rows, rows)


def _reduced(visible, rows, cols):
    """Per tile of rows × cols (the last ones cut by n): (some pair visible, every pair visible)."""
    n, m = visible.shape[-2:]
    some = torch.zeros(visible.shape[0], -(-n // rows), -(-m // cols), dtype=torch.bool)
    every = torch.zeros_like(some)
    for a in range(some.shape[1]):
        for b in range(some.shape[2]):
            tile = visible[:, a * rows : (a + 1) * rows, b * cols : (b + 1) * cols]
            some[:, a, b], every[:, a, b] = tile.flatten(1).any(1), tile.flatten(1).all(1)
    return some, every


@pytest.mark.parametrize("shape", [(16, 16), (32, 16), (16, 8)], ids=str)
@pytest.mark.parametrize(("kind", "layout"), KINDS)
def test_the_block_map_is_the_dense_mask_reduced_per_tile(kind, layout, shape, folder):
    """_block_kinds (BH, row blocks, key blocks) against the dense mask reduced per tile, n = 37 (no multiple of a
    tile), each sequence its own map: exact (empty iff no pair visible, full iff every pair) for contiguous
    documents and the prefix, sound (empty only with no pair, full only with every pair) for ids in no order."""
    module = triton_module(cases._spec(kind), folder)
    (_, _, _, constant), _ = cases._inputs(kind, layout, seed=0)
    table = constant.float()[:, None]  # as the kernels take it: (outer, inner, rows, cols)
    kinds, outer, inner, row_stride = module._block_kinds([table], 37, 37, *shape)
    assert kinds.dtype == torch.int8 and kinds.shape == (2, 1, -(-37 // shape[0]), -(-37 // shape[1]))
    assert (outer, inner, row_stride) == (kinds.stride(0), 0, kinds.stride(2))
    some, every = _reduced(_dense(kind, constant, 37), *shape)
    kinds = kinds[:, 0]
    assert not (some & (kinds == 0)).any() and not (~every & (kinds == 2)).any()  # (sound)
    if layout == "contiguous":
        assert torch.equal(kinds == 0, ~some) and torch.equal(kinds == 2, every)
    if layout == "contiguous" and not torch.equal(some[0], some[1]):  # (each sequence its own map, exact)
        assert (kinds[0] != kinds[1]).any()
    assert ((kinds == 0) | (kinds == 2)).any()  # (not every tile partial)


def _tiles(visible, rows, cols, tile=TILE):
    """Over every sequence: (tiles holding a visible pair, tiles every pair of which is visible and whose keys lie
    inside m: the forward's unmasked pass)."""
    some, every = _reduced(visible, tile, tile)
    inside = torch.arange(0, cols, tile) + tile <= cols
    return int(some.sum()), int((every & inside).sum())


@pytest.mark.parametrize("kind", ["documents", "causal-documents", "prefix"])
def test_the_kernels_visit_only_the_tiles_the_map_leaves(kind, folder, monkeypatch):
    """Dots counted in the interpreter: the forward's two a tile, the backward's four (key part) and three (query
    part), the JVP's six; each equals the count of tiles holding a visible pair (the map exact here), fewer than
    all (an empty tile is never read: were the map ignored, the counts would be every tile's). The forward's _kept
    calls with the flag off: the tiles wholly visible, the mask not evaluated there."""
    module = triton_module(cases._spec(kind), folder)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 80, 4, generator=g) for _ in range(3))  # (long documents: tiles wholly visible)
    constant = torch.stack([cases._ids([40, 23, 17]), cases._ids([7, 50, 23])]).float()
    if kind == "prefix":
        constant = torch.tensor([35.0, 3.0]).view(2, 1, 1)
    some, every = _tiles(_dense(kind, constant, 80), 80, 80)
    every_tile = 2 * math.ceil(80 / TILE) ** 2
    dots, flags = counted(module, monkeypatch)
    with torch.no_grad():
        module.forward(q, k, v, constant)
    assert dots[0] == 2 * some < 2 * every_tile
    assert flags[False] == every > 0 and flags[True] == some - every
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = module.forward(*leaves, constant)
    dots[0] = 0
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert dots[0] == 7 * some
    dots[0] = 0
    named = {str(cases._spec(kind).constants[0].name): constant}
    module.jvp(*(x.detach() for x in leaves), {"Q": torch.ones_like(q)}, **named)
    assert dots[0] == 6 * some


def test_a_mask_of_positions_alone_gets_no_block_map(folder):
    """A causal mask (no table read): the analytic window only, no map computed, the kernels as before."""
    from test_triton_skipping import mask_spec

    assert not hasattr(triton_module(mask_spec("window-5"), folder), "_block_kinds")
