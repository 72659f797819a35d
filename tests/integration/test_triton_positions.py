"""Positions (sa.entries) in the Triton kernels under Triton's interpreter (CPU float32, n ≠ m, neither a multiple of
the 16 × 16 tile): a relative bias −|i − j|/2, ALiBi's slope per head, a causal sliding window (rows whose keys are
all masked among them), a function of |i − j| under a soft cap, a learned slope τ with a window, T5's bucketed
log-distance (floor, Min), a signed root with a squared Max, and a distance decay multiplied into the scores.
Forward, every gradient (τ's summed per program, then in a fixed order) and the JVP match the torch backend's
module and torch autograd of an independent float64 forward (the positional term built by the test with
torch.arange); no n × m tensor is made. (Tables read at positions: test_triton_tables.py.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sympy as sp
from rendered import load
from triton_rendered import compare, torch, triton_module

import symattn as sa
from symattn.specs import dim

n, m, d = dim("n"), dim("m"), dim("d")
TAU = sa.scalar("tau")
WINDOW, CAP, HEADS, D_K = 5, 4, 4, 4
SIZES = {"long": (37, 45, 8), "short_keys": (37, 29, 8)}  # (n, m, d): short_keys leaves rows 33 … 36 no key


def _window(i, j):
    return sp.Piecewise((0, (j <= i) & (i - j < WINDOW)), (-sp.oo, True))


FORMULAS = {  # kind → f(i, j), the positional term of the spec
    "relative": lambda i, j: -sp.Abs(i - j) / 2,
    "window": _window,
    "softcap": lambda i, j: -sp.log(1 + sp.Abs(i - j)),
    "slope": lambda i, j: -TAU * sp.Abs(i - j) + sp.Piecewise((0, j <= i + 2), (-sp.oo, True)),
    "bucket": lambda i, j: -sp.Min(sp.floor(2 * sp.log(1 + sp.Abs(i - j))), 3) / 2,  # T5's log-spaced buckets
    "signed": lambda i, j: sp.sign(i - j) * sp.sqrt(sp.Abs(i - j)) / 4 - sp.Max(i - j - 8, 0) ** 2 / 64,
    "decay": lambda i, j: sp.exp(-sp.Abs(i - j) / 8),  # multiplied into the scores
}


def positional_spec(kind: str) -> sa.Spec:
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    if kind == "decay":
        scores = sa.hadamard(q * k.T / sp.sqrt(d), sa.entries(n, m, FORMULAS[kind]))
    else:
        scores = q * k.T / sp.sqrt(d) + sa.entries(n, m, FORMULAS[kind])
    if kind == "softcap":  # CAP · tanh((S/√d − log(1 + |i − j|)) / CAP)
        scores = CAP * sa.tanh(scores / CAP)
    inputs = (q, k, v, TAU) if kind == "slope" else (q, k, v)
    return sa.Spec(f"triton_positions_{kind}", "attention with positions", inputs, sa.softmax(scores) * v)


def _grid(rows: int, cols: int):
    return torch.arange(rows, dtype=torch.float64)[:, None], torch.arange(cols, dtype=torch.float64)[None, :]


def _term(kind: str, i, j, tau):
    """The positional term of kind, written in torch (float64)."""
    visible = torch.where((j <= i) & (i - j < WINDOW), 0.0, -math.inf)
    return {
        "relative": lambda: -(i - j).abs() / 2,
        "window": lambda: visible,
        "softcap": lambda: -torch.log(1 + (i - j).abs()),
        "slope": lambda: -tau * (i - j).abs() + torch.where(j <= i + 2, 0.0, -math.inf),
        "bucket": lambda: -torch.clamp(torch.floor(2 * torch.log(1 + (i - j).abs())), max=3) / 2,
        "signed": lambda: torch.sign(i - j) * (i - j).abs().sqrt() / 4 - torch.clamp(i - j - 8, min=0) ** 2 / 64,
        "decay": lambda: torch.exp(-(i - j).abs() / 8),
    }[kind]()


def _softmax(a):
    """Row softmax with a row of −inf a row of zeros (the language's masked rows: docs/language.md)."""
    seen = a.amax(-1, keepdim=True) > -math.inf
    return torch.softmax(torch.where(seen, a, 0.0), -1) * seen


def reference(kind: str, q, k, v, tau=None, causal=False):
    """softmax(A) V, A = Q Kᵀ/√d + f(i, j) (under the soft cap for softcap), written from the formula."""
    i, j = _grid(q.shape[-2], k.shape[-2])
    scores, term = q @ k.mT / math.sqrt(q.shape[-1]), _term(kind, i, j, tau)
    a = scores * term if kind == "decay" else scores + term
    if kind == "softcap":
        a = CAP * torch.tanh(a / CAP)
    if causal:
        a = a.masked_fill(j > i, -math.inf)
    return _softmax(a) @ v


def _inputs(kind: str, size, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, cols, width = size
    x = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]
    return x + [torch.tensor(0.3, dtype=torch.float64)] if kind == "slope" else x


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_positions")


def _gradients(function, inputs, cotangent):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, cotangent)


@pytest.mark.parametrize("kind", ["relative", "window", "softcap", "slope", "bucket", "signed", "decay"])
def test_forward_and_gradients_match_the_torch_module_and_autograd(kind, folder):
    inputs = _inputs(kind, SIZES["long"], seed=1)
    cotangent = torch.randn(2, 37, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, grads = _gradients(
        triton_module(positional_spec(kind), folder).forward, [x.float() for x in inputs], cotangent
    )
    for what, function in (("torch module", load(positional_spec(kind), "torch").forward), ("autograd", None)):
        function = function or (lambda *x: reference(kind, *x))
        want, wanted = _gradients(function, inputs, cotangent)
        compare(out, want, f"{kind} forward against the {what}", rtol=1e-4)
        for name, got, expected in zip(("Q", "K", "V", "tau"), grads, wanted):
            assert got.shape == expected.shape
            compare(got, expected, f"{kind} d{name} against the {what}", rtol=1e-4)


@pytest.mark.parametrize("kind, causal", [("relative", True), ("window", False), ("softcap", False), ("slope", True)])
def test_jvp_matches_torch_func_jvp_of_the_independent_forward(kind, causal, folder):
    inputs = _inputs(kind, SIZES["long"], seed=3)
    g = torch.Generator().manual_seed(4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    module = triton_module(positional_spec(kind), folder)
    names = ("Q", "K", "V", "tau")[: len(inputs)]
    out, tangent = module.jvp(
        *(x.float() for x in inputs), {k: t.float() for k, t in zip(names, tangents)}, causal=causal
    )
    want, want_tangent = torch.func.jvp(lambda *x: reference(kind, *x, causal=causal), tuple(inputs), tuple(tangents))
    compare(out, want, f"{kind} jvp output", rtol=1e-4)
    compare(tangent, want_tangent, f"{kind} jvp tangent", rtol=1e-4)
    forward = torch.func.jvp(
        lambda *x: module.forward(*x, causal=causal),
        tuple(x.float() for x in inputs),
        tuple(t.float() for t in tangents),
    )[1]
    compare(forward, want_tangent, f"{kind} torch.func.jvp of forward", rtol=1e-4)


def test_rows_whose_keys_are_all_masked_give_zeros_and_finite_gradients(folder):
    """n > m + WINDOW − 1: rows 33 … 36 see no key of the window. Their outputs are 0 and no gradient is NaN (a row
    of −inf is a row of zero probabilities: docs/language.md), as the kernels give for a mask or causal, and the
    whole matches autograd of the independent forward. The torch backend's module gives NaN on those rows (its
    softmax takes the masked form only for a mask constant or causal, not for a formula's −∞), so it is compared on
    the others."""
    kind, (rows, cols, width) = "window", SIZES["short_keys"]
    inputs = _inputs(kind, (rows, cols, width), seed=5)
    cotangent = torch.randn(2, rows, width, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    module = triton_module(positional_spec(kind), folder)
    out, grads = _gradients(module.forward, [x.float() for x in inputs], cotangent)
    empty = torch.arange(rows) >= cols + WINDOW - 1
    assert empty.sum() == 4 and not out[:, empty].any()
    assert all(g.isfinite().all() for g in grads)
    want, wanted = _gradients(lambda *x: reference(kind, *x), inputs, cotangent)
    compare(out, want, "window forward, rows all masked", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, wanted):
        compare(got, expected, f"window d{name}, rows all masked", rtol=1e-4)
    torch_module = load(positional_spec(kind), "torch").forward(*inputs)
    compare(out[:, ~empty], torch_module[:, ~empty], "window forward against the torch module", rtol=1e-4)
    tangents = {k: torch.randn(x.shape, dtype=torch.float32) for k, x in zip("QKV", inputs)}
    _, tangent = module.jvp(*(x.float() for x in inputs), tangents)
    assert tangent.isfinite().all() and not tangent[:, empty].any()


def alibi_heads_spec() -> sa.Spec:
    """Multi-head attention with ALiBi's slope per head, 2^(−8(h+1)/H) |i − j|."""
    q, k, v = (sa.matrix(x, r, HEADS * d) for x, r in (("Q", n), ("K", m), ("V", m)))
    alibi = sa.entries(n, m, lambda i, j, h: -(2 ** (-8 * (h + 1) / sp.Integer(HEADS))) * sp.Abs(i - j), heads=HEADS)
    qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + alibi) @ vh, HEADS)
    return sa.Spec("triton_alibi_heads", "ALiBi", (q, k, v), output)


def alibi_reference(q, k, v, causal=False):
    def heads(x):
        return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)

    i, j = _grid(q.shape[-2], k.shape[-2])
    slopes = torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], dtype=torch.float64)
    a = heads(q) @ heads(k).mT / math.sqrt(D_K) - slopes[:, None, None] * (i - j).abs()
    if causal:
        a = a.masked_fill(j > i, -math.inf)
    out = _softmax(a) @ heads(v)
    return out.transpose(-3, -2).reshape(*q.shape[:-1], HEADS * D_K)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi_per_head_reads_the_programs_head(causal, folder):
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (37, 45, 45)]
    module = triton_module(alibi_heads_spec(), folder)
    cotangent = torch.randn(2, 37, HEADS * D_K, generator=g, dtype=torch.float64)
    out, grads = _gradients(lambda *x: module.forward(*x, causal=causal), [x.float() for x in inputs], cotangent)
    want, wanted = _gradients(lambda *x: alibi_reference(*x, causal=causal), inputs, cotangent)
    compare(out, want, "alibi forward", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, wanted):
        compare(got, expected, f"alibi d{name}", rtol=1e-4)
    if not causal:  # the torch backend's module (no causal keyword: the spec has no mask)
        compare(out, load(alibi_heads_spec(), "torch").forward(*inputs), "alibi against the torch module", rtol=1e-4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    _, tangent = module.jvp(
        *(x.float() for x in inputs), {k: t.float() for k, t in zip("QKV", tangents)}, causal=causal
    )
    _, want_tangent = torch.func.jvp(lambda *x: alibi_reference(*x, causal=causal), tuple(inputs), tuple(tangents))
    compare(tangent, want_tangent, "alibi jvp tangent", rtol=1e-4)


def test_per_sample_gradients_under_vmap_keep_each_programs_head(folder):
    """torch.func.vmap of grad: vmap's axis merged into the batch·head axis outside the heads, so bh mod H is still
    the head (the batch (3, 2) of two leading axes, heads innermost)."""
    module = triton_module(alibi_heads_spec(), folder)
    g = torch.Generator().manual_seed(13)
    inputs = [torch.randn(3, 2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (37, 45, 45)]

    def loss(function):
        return lambda *x: function(*x).square().sum()

    got = torch.func.vmap(torch.func.grad(loss(module.forward), argnums=(0, 1, 2)))(*(x.float() for x in inputs))
    want = torch.func.vmap(torch.func.grad(loss(alibi_reference), argnums=(0, 1, 2)))(*inputs)
    for name, a, b in zip("QKV", got, want):
        compare(a, b, f"alibi per-sample d{name}", rtol=1e-4)


def test_a_head_count_given_as_a_dimension_is_read_at_run_time(folder):
    """heads=H a dimension (its value bound from the shapes: W has H rows): the kernels' head is bh mod H with H a
    scalar argument; forward and gradients as ALiBi's with H = 4."""
    heads = dim("H")
    q, k, v = (sa.matrix(x, r, heads * d) for x, r in (("Q", n), ("K", m), ("V", m)))
    slopes = sa.entries(n, m, lambda i, j, h: -(2 ** (-8 * (h + 1) / heads)) * sp.Abs(i - j), heads=heads)
    qh, kh, vh = (sa.split_heads(x, heads) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + slopes) @ vh, heads)
    spec = sa.Spec("triton_alibi_dimension", "ALiBi, H a dimension", (q, k, v, sa.matrix("W", heads, d)), output)
    module = triton_module(spec, folder)
    assert "pos_h = (bh % c1.to(tl.int64))" in Path(module.__file__).read_text(encoding="utf-8")
    g = torch.Generator().manual_seed(12)
    inputs = [torch.randn(2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (37, 45, 45)]
    cotangent = torch.randn(2, 37, HEADS * D_K, generator=g, dtype=torch.float64)
    weights = torch.zeros(HEADS, D_K)
    out, grads = _gradients(lambda *x: module.forward(*x, weights), [x.float() for x in inputs], cotangent)
    want, wanted = _gradients(alibi_reference, inputs, cotangent)
    compare(out, want, "alibi (H a dimension) forward", rtol=1e-4)
    for name, got, expected in zip("QKV", grads, wanted):
        compare(got, expected, f"alibi (H a dimension) d{name}", rtol=1e-4)


@pytest.mark.parametrize("kind", ["slope", "heads"])
def test_double_backward_through_the_eager_core_matches_autograd(kind, folder):
    """create_graph=True: the Function's backward differentiates the eager core, its positions from torch grids of
    the same formula (per head: the heads axis): gradients and a Hessian-vector product against float64 autograd."""
    if kind == "heads":
        g = torch.Generator().manual_seed(9)
        inputs = [torch.randn(2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (37, 45, 45)]
        module, function = triton_module(alibi_heads_spec(), folder), alibi_reference
    else:
        inputs = _inputs(kind, SIZES["long"], seed=9)
        module, function = triton_module(positional_spec(kind), folder), lambda *x: reference(kind, *x)
    g = torch.Generator().manual_seed(10)
    cotangent = torch.randn(2, 37, inputs[2].shape[-1], generator=g, dtype=torch.float64)
    directions = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]

    def second(run, xs, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in xs]
        grads = torch.autograd.grad(run(*leaves), leaves, cotangent.to(dtype), create_graph=True)
        along = sum((a * b.to(dtype)).sum() for a, b in zip(grads, directions))
        return [*grads, *torch.autograd.grad(along, leaves)]

    for i, (got, want) in enumerate(
        zip(second(module.forward, inputs, torch.float32), second(function, inputs, torch.float64))
    ):
        compare(got, want, f"{kind}: {'gradient' if i < len(inputs) else 'hvp'} {i % len(inputs)}", rtol=1e-4)


def test_a_log_softmax_map_reads_positions_too(folder):
    """O = log-softmax(Q Kᵀ/√d − |i − j|/2), n × m (a pointer's map: its own kernels), forward, gradients, JVP."""
    q, k = sa.matrix("Q", n, d), sa.matrix("K", m, d)
    spec = sa.Spec(
        "triton_positions_map",
        "a map",
        (q, k),
        sa.log_softmax(q * k.T / sp.sqrt(d) + sa.entries(n, m, FORMULAS["relative"])),
    )
    module = triton_module(spec, folder)

    def reference_map(q, k):
        i, j = _grid(q.shape[-2], k.shape[-2])
        return torch.log_softmax(q @ k.mT / math.sqrt(q.shape[-1]) - (i - j).abs() / 2, -1)

    g = torch.Generator().manual_seed(11)
    inputs = [torch.randn(2, r, 8, generator=g, dtype=torch.float64) for r in (37, 45)]
    cotangent = torch.randn(2, 37, 45, generator=g, dtype=torch.float64)
    out, grads = _gradients(module.forward, [x.float() for x in inputs], cotangent)
    for what, function in (("torch module", load(spec, "torch").forward), ("autograd", reference_map)):
        want, wanted = _gradients(function, inputs, cotangent)
        compare(out, want, f"map forward against the {what}", rtol=1e-4)
        for name, got, expected in zip("QK", grads, wanted):
            compare(got, expected, f"map d{name} against the {what}", rtol=1e-4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    _, tangent = module.jvp(*(x.float() for x in inputs), {k: t.float() for k, t in zip("QK", tangents)})
    compare(tangent, torch.func.jvp(reference_map, tuple(inputs), tuple(tangents))[1], "map jvp tangent", rtol=1e-4)


def test_no_n_by_m_tensor_is_made(folder):
    """The kernels take no tile of positions (no T_ argument) and add no atomics (τ's sums: one slot per program),
    and no torch op of forward, backward or jvp makes a tensor with both n and m among its axes: the entries are
    computed in the tiles from their positions."""
    from torch.utils._python_dispatch import TorchDispatchMode

    module = triton_module(positional_spec("slope"), folder)
    for kernel in (module._forward_kernel, module._backward_kernel, module._jvp_kernel):
        assert not [a for a in kernel.arg_names if a.startswith("T_")], kernel.arg_names
    assert "tl.atomic_" not in Path(module.__file__).read_text(encoding="utf-8")
    rows, cols, _ = SIZES["long"]
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(
                tuple(x.shape) for x in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(x)
            )
            return out

    inputs = [x.float() for x in _inputs("slope", SIZES["long"], seed=8)]
    with Shapes():
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = module.forward(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        module.jvp(*inputs, {"tau": torch.tensor(1.0)})
    assert shapes and not [s for s in shapes if rows in s and cols in s]
