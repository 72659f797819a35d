"""The Triton kernels skip the tiles a mask of positions leaves empty and leave the mask out of the tiles every row
sees whole (``optimize.mask_structure``: a program's keys [lo, hi) and open keys [open_lo, open_hi); the backward's
key part, the query rows of its keys, from the transposed formula), under Triton's interpreter (16 × 16 tiles).

Causal sliding windows narrower and wider than a tile, a prefix-LM, a band, a bottom-right causal mask (n ≠ m in the
bounds), a window with ALiBi's slope per head, grouped query heads sharing key/value heads, and masks the analysis
cannot read (a floor, a window that depends on the head: every tile, the mask applied, the kernels as before):
forward, gradients and the JVP against torch autograd of an independent float64 forward (rows with no key give
zeros), sizes not multiples of the tile, n ≠ m both ways.
The tiles visited are counted (the interpreter's dots; the mask's ``_kept`` by its flag) against a brute-force count
of the tiles holding a visible entry and of those wholly visible.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sympy as sp
from triton_rendered import compare, counted, torch, triton_module

import symattn as sa
from symattn.lang.ops import repeat_heads
from symattn.specs import dim

n, m, d = dim("n"), dim("m"), dim("d")
HEADS, D_K, TILE = 4, 4, 16


def _mask(condition):
    return sp.Piecewise((0, condition), (-sp.oo, True))


# name → (f(i, j), the same in torch on float64 grids i, j (and n, m), whether the analysis reads it)
MASKS = {
    "window-5": (lambda i, j: _mask((j <= i) & (i - j < 5)), lambda i, j, r, c: (j <= i) & (i - j < 5), True),
    "window-24": (lambda i, j: _mask((j <= i) & (i - j < 24)), lambda i, j, r, c: (j <= i) & (i - j < 24), True),
    "prefix": (lambda i, j: _mask((j < 20) | (j <= i)), lambda i, j, r, c: (j < 20) | (j <= i), True),
    "band": (lambda i, j: _mask((j >= i - 3) & (j <= i + 18)), lambda i, j, r, c: (j >= i - 3) & (j <= i + 18), True),
    "bottom-right": (lambda i, j: _mask(j <= i + m - n), lambda i, j, r, c: j <= i + c - r, True),
    "floor": (lambda i, j: _mask(sp.floor(i / 8) >= sp.floor(j / 8)), lambda i, j, r, c: (i // 8) >= (j // 8), False),
}
SIZES = [(37, 45), (45, 29)]  # n ≠ m both ways, neither a multiple of 16; (45, 29): windows leave late rows no key


def mask_spec(name: str) -> sa.Spec:
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    scores = q * k.T / sp.sqrt(d) - sa.entries(n, m, lambda i, j: sp.Abs(i - j) / 8) + sa.entries(n, m, MASKS[name][0])
    return sa.Spec(f"triton_skip_{name.replace('-', '_')}", "a mask of positions", (q, k, v), sa.softmax(scores) * v)


def _softmax(a):
    seen = a.amax(-1, keepdim=True) > -math.inf
    return torch.softmax(torch.where(seen, a, 0.0), -1) * seen


def visible(name: str, rows: int, cols: int):
    i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    return MASKS[name][1](i, j, rows, cols)


def reference(name: str, q, k, v, causal=False):
    """softmax(Q Kᵀ/√d − |i − j|/8 + mask) V, written from the mask's condition (a row with no key: zeros)."""
    rows, cols = q.shape[-2], k.shape[-2]
    i, j = torch.arange(rows, dtype=q.dtype)[:, None], torch.arange(cols, dtype=q.dtype)[None, :]
    seen = visible(name, rows, cols) & ((j <= i) if causal else True)
    a = q @ k.mT / math.sqrt(q.shape[-1]) - (i - j).abs() / 8
    return _softmax(a.masked_fill(~seen, -math.inf)) @ v


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_skipping")


def _inputs(rows, cols, seed, width=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]


def _check(module, function, inputs, what, causal=False, seed=0):
    """Forward, gradients (float32 kernels) against float64 autograd of function; the JVP against torch.func.jvp."""
    g = torch.Generator().manual_seed(seed)
    leaves = [x.float().requires_grad_() for x in inputs]
    out = module.forward(*leaves, causal=causal)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, cotangent.float())
    exact = [x.clone().requires_grad_() for x in inputs]
    want = function(*exact, causal=causal)
    wanted = torch.autograd.grad(want, exact, cotangent)
    compare(out, want, f"{what} forward", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, wanted):
        compare(got, expected, f"{what} d{name}", rtol=1e-4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    out, tangent = module.jvp(
        *(x.float() for x in inputs), {k: t.float() for k, t in zip("QKV", tangents)}, causal=causal
    )
    _, want_tangent = torch.func.jvp(lambda *x: function(*x, causal=causal), tuple(inputs), tuple(tangents))
    compare(tangent, want_tangent, f"{what} jvp tangent", rtol=1e-4)
    return out


@pytest.mark.parametrize("size", SIZES, ids=str)
@pytest.mark.parametrize("name", MASKS)
def test_forward_gradients_and_jvp_match_autograd(name, size, folder):
    inputs = _inputs(*size, seed=1)
    module = triton_module(mask_spec(name), folder)
    out = _check(module, lambda *x, causal: reference(name, *x, causal=causal), inputs, f"{name} {size}", seed=2)
    empty = ~visible(name, *size).any(-1)
    assert not out[:, empty].any()  # a row with no key: zeros


@pytest.mark.parametrize("name", ["band", "prefix"])
def test_the_causal_mask_narrows_the_window_further(name, folder):
    inputs = _inputs(37, 45, seed=3)
    module = triton_module(mask_spec(name), folder)
    _check(module, lambda *x, causal: reference(name, *x, causal=causal), inputs, f"{name} causal", True, seed=4)


def test_a_mask_the_analysis_cannot_read_visits_every_tile_as_before(folder):
    """A floor: no window; the kernels' loops are the ones without positions' (every tile, the mask applied)."""
    text = Path(triton_module(mask_spec("floor"), folder).__file__).read_text(encoding="utf-8")
    assert "open_lo" not in text and "full = (m // BLOCK_N) * BLOCK_N" in text
    assert "open_lo" in Path(triton_module(mask_spec("window-5"), folder).__file__).read_text(encoding="utf-8")


def heads_spec(per_head_width: bool) -> sa.Spec:
    """ALiBi's slope per head with a causal window of 20 keys (or, per_head_width, of 8(h + 1): the mask reads h; a
    power of two, so that SymPy's rewriting of the relation into multiples of 1/8 stays exact in float32)."""
    q, k, v = (sa.matrix(x, r, HEADS * d) for x, r in (("Q", n), ("K", m), ("V", m)))

    def formula(i, j, h):
        width = 8 * (h + 1) if per_head_width else 20
        return -(2 ** (-8 * (h + 1) / sp.Integer(HEADS))) * sp.Abs(i - j) + _mask((j <= i) & (i - j < width))

    positions = sa.entries(n, m, formula, heads=HEADS)
    qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + positions) @ vh, HEADS)
    return sa.Spec(f"triton_skip_heads_{int(per_head_width)}", "ALiBi and a window", (q, k, v), output)


def heads_reference(per_head_width: bool):
    def function(q, k, v, causal=False):
        def heads(x):
            return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)

        rows, cols = q.shape[-2], k.shape[-2]
        i, j = torch.arange(rows, dtype=q.dtype)[:, None], torch.arange(cols, dtype=q.dtype)[None, :]
        h = torch.arange(HEADS, dtype=q.dtype)[:, None, None]
        slopes = 2 ** (-8 * (h + 1) / HEADS)
        width = 8 * (h + 1) if per_head_width else 20
        seen = (j <= i) & (i - j < width)
        a = heads(q) @ heads(k).mT / math.sqrt(D_K) - slopes * (i - j).abs()
        out = _softmax(a.masked_fill(~seen, -math.inf)) @ heads(v)
        return out.transpose(-3, -2).reshape(*q.shape[:-1], HEADS * D_K)

    return function


@pytest.mark.parametrize("per_head_width", [False, True], ids=["window", "window-per-head"])
def test_alibi_per_head_with_a_window(per_head_width, folder):
    """A head-independent mask in the heads form: the same bounds for every head; one that reads the head: every
    tile, masked (the kernels as before)."""
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (45, 37, 37)]
    module = triton_module(heads_spec(per_head_width), folder)
    text = Path(module.__file__).read_text(encoding="utf-8")
    assert ("open_lo" in text) != per_head_width
    _check(module, heads_reference(per_head_width), inputs, f"alibi per_head_width={per_head_width}", seed=6)


def _tiles(seen: torch.Tensor, rows: int, cols: int, transposed=False):
    """(tiles holding a visible entry, tiles wholly visible and inside n × m) over the programs' blocks: rows of 16 ×
    keys of 16 (transposed: keys × rows)."""
    some = every = 0
    outer, inner = (cols, rows) if transposed else (rows, cols)
    for a in range(0, outer, TILE):
        for b in range(0, inner, TILE):
            block = seen[b : b + TILE, a : a + TILE] if transposed else seen[a : a + TILE, b : b + TILE]
            some += bool(block.any())
            every += bool(block.all()) and b + TILE <= inner
    return some, every


@pytest.mark.parametrize(
    "name, size", [("window-5", (45, 29)), ("window-24", (37, 45)), ("band", (45, 29)), ("bottom-right", (50, 67))]
)
def test_the_kernels_visit_only_the_tiles_with_a_visible_entry(name, size, folder, monkeypatch):
    """Dots counted in the interpreter: the forward's two a tile, the backward's four (key part) and three (query
    part); each equals the brute-force count of the tiles holding a visible entry (a window: exact), fewer than all.
    The forward's _kept calls with the flag off: the tiles wholly visible, the mask left out there."""
    rows, cols = size
    module = triton_module(mask_spec(name), folder)
    seen = visible(name, rows, cols)
    some, every = _tiles(seen, rows, cols)
    key_some, _ = _tiles(seen, rows, cols, transposed=True)
    dots, flags = counted(module, monkeypatch)
    inputs = [x.float() for x in _inputs(rows, cols, seed=7, width=8)]
    batch = inputs[0].shape[0]
    with torch.no_grad():
        module.forward(*inputs)
    assert dots[0] == 2 * batch * some < 2 * batch * math.ceil(rows / TILE) * math.ceil(cols / TILE)
    assert flags[False] == batch * every and flags[True] == batch * (some - every)
    dots[0] = 0
    leaves = [x.requires_grad_() for x in inputs]
    out = module.forward(*leaves)
    dots[0] = 0
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert dots[0] == batch * (4 * key_some + 3 * some)


def test_grouped_query_heads_share_the_key_parts_window(folder):
    """4 query heads sharing 2 key/value heads (the kernels' key part steps through its group's query heads): a
    window of 20 keys in the heads form, forward, gradients and JVP against the heads repeated in float64."""
    q = sa.matrix("Q", n, HEADS * d)
    k, v = sa.matrix("K", m, 2 * d), sa.matrix("V", m, 2 * d)
    positions = sa.entries(n, m, lambda i, j, h: _mask((j <= i) & (i - j < 20)), heads=HEADS)
    qh = sa.split_heads(q, HEADS)
    kh, vh = (repeat_heads(sa.split_heads(x, 2), 2, HEADS) for x in (k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + positions) @ vh, HEADS)
    module = triton_module(sa.Spec("triton_skip_grouped", "grouped heads and a window", (q, k, v), output), folder)
    assert "open_lo" in Path(module.__file__).read_text(encoding="utf-8")

    def function(q, k, v, causal=False):
        def heads(x, count):
            return x.view(*x.shape[:-1], count, D_K).transpose(-3, -2)

        rows, cols = q.shape[-2], k.shape[-2]
        i, j = torch.arange(rows, dtype=q.dtype)[:, None], torch.arange(cols, dtype=q.dtype)[None, :]
        kh, vh = (heads(x, 2).repeat_interleave(HEADS // 2, -3) for x in (k, v))
        a = heads(q, HEADS) @ kh.mT / math.sqrt(D_K)
        out = _softmax(a.masked_fill(~((j <= i) & (i - j < 20)), -math.inf)) @ vh
        return out.transpose(-3, -2).reshape(*q.shape[:-1], HEADS * D_K)

    g = torch.Generator().manual_seed(8)
    inputs = [torch.randn(2, r, w * D_K, generator=g, dtype=torch.float64) for r, w in ((45, HEADS), (37, 2), (37, 2))]
    _check(module, function, inputs, "grouped heads", seed=9)


def test_an_n_by_m_input_beside_the_window_gets_zero_gradient_on_the_skipped_tiles(folder):
    """softmax(Q Kᵀ/√d + B + window) V with B an n × m input: dB (written tile by tile where the kernels visit) is
    G ⊙ P-shaped, zero on every key the window hides, the skipped tiles' included."""
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    b = sa.matrix("B", n, m)
    window = sa.entries(n, m, MASKS["window-5"][0])
    spec = sa.Spec(
        "triton_skip_bias", "a bias and a window", (q, k, v, b), sa.softmax(q * k.T / sp.sqrt(d) + b + window) * v
    )
    module = triton_module(spec, folder)
    g = torch.Generator().manual_seed(10)
    inputs = [*_inputs(37, 45, seed=11), torch.randn(2, 37, 45, generator=g, dtype=torch.float64)]
    cotangent = torch.randn(2, 37, 8, generator=g, dtype=torch.float64)

    def function(q, k, v, bias):
        seen = visible("window-5", 37, 45)
        a = (q @ k.mT / math.sqrt(q.shape[-1]) + bias).masked_fill(~seen, -math.inf)
        return _softmax(a) @ v

    leaves = [x.float().requires_grad_() for x in inputs]
    grads = torch.autograd.grad(module.forward(*leaves), leaves, cotangent.float())
    exact = [x.clone().requires_grad_() for x in inputs]
    wanted = torch.autograd.grad(function(*exact), exact, cotangent)
    for name, got, expected in zip(("Q", "K", "V", "B"), grads, wanted):
        compare(got, expected, f"bias and window d{name}", rtol=1e-4)
    assert not grads[3][:, ~visible("window-5", 37, 45)].any()
