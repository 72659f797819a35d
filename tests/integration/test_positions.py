"""Positions in the language (CONTRACT.md, "Positions"): sa.entries(rows, cols, f), the matrix [f(i, j)].

Each spec below reads positions a different way: ALiBi's −slope·|i − j| added to the scores, a causal sliding
window as a Piecewise with −∞, a distance decay multiplied into the scores, a bucketed log-distance bias with
floor/Min, SymPy's own FunctionMatrix, and a learned slope τ (a trainable scalar in the formula) with a window. Its
derivation verifies, and the generated NumPy, torch and JAX modules match torch autograd of an independent forward
(the positional term built by the test with torch.arange, float64), at two sizes, with n ≠ m; τ gets its gradient,
tangent and second derivative. The memory-efficient variant: test_positions_memeff.py; the Triton kernels:
test_triton_positions.py.
"""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
import sympy as sp
from rendered import load

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, m, d = dim("n"), dim("m"), dim("d")
Q, K, V = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
TAU = sa.scalar("tau")
WINDOW = 3


def _scores():
    return Q * K.T / sp.sqrt(d)


# name → (the spec's positional matrix and how it meets the scores, the same with torch for a reference)
def _alibi(i, j):
    return -sp.Rational(1, 2) * sp.Abs(i - j)


def _window(i, j):
    return sp.Piecewise((0, (j <= i) & (i - j < WINDOW)), (-sp.oo, True))


def _decay(i, j):
    return sp.exp(-sp.Abs(i - j) / 4)


def _bucket(i, j):
    return -sp.Min(sp.floor(2 * sp.log(1 + sp.Abs(i - j))), 3) / 2  # log-spaced buckets, capped (T5's shape)


def _learned(i, j):
    return -TAU * sp.Abs(i - j) + sp.Piecewise((0, j <= i + 2), (-sp.oo, True))


def _grid(rows, cols):
    i = torch.arange(rows, dtype=torch.float64)[:, None]
    j = torch.arange(cols, dtype=torch.float64)[None, :]
    return i, j


REFERENCE = {  # of the position grids i, j and the learned slope tau
    "alibi": lambda i, j, tau: -0.5 * (i - j).abs(),
    "window": lambda i, j, tau: torch.where((j <= i) & (i - j < WINDOW), 0.0, -math.inf).double(),
    "decay": lambda i, j, tau: torch.exp(-(i - j).abs() / 4),
    "bucket": lambda i, j, tau: -torch.clamp(torch.floor(2 * torch.log(1 + (i - j).abs())), max=3) / 2,
    "learned": lambda i, j, tau: -tau * (i - j).abs() + torch.where(j <= i + 2, 0.0, -math.inf).double(),
}
FORMULAS = {"alibi": _alibi, "window": _window, "decay": _decay, "bucket": _bucket, "learned": _learned}


def positional_spec(kind: str) -> sa.Spec:
    if kind == "function_matrix":  # SymPy's own node, accepted as it is
        i, j = sp.symbols("i j", integer=True)
        scores = _scores() + sp.FunctionMatrix(n, m, sp.Lambda((i, j), _alibi(i, j)))
    else:
        positions = sa.entries(n, m, FORMULAS[kind]).expr
        scores = sp.HadamardProduct(_scores(), positions) if kind == "decay" else _scores() + positions
    inputs = (Q, K, V, TAU) if kind == "learned" else (Q, K, V)
    output = sa.softmax(scores) * V
    return sa.Spec(name=f"positions_{kind}", summary="attention with positions", inputs=inputs, output=output)


def reference(kind: str, q, k, v, tau=None):
    i, j = _grid(q.shape[-2], k.shape[-2])
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    bias = REFERENCE["alibi" if kind == "function_matrix" else kind](i, j, tau)
    scores = scores * bias if kind == "decay" else scores + bias
    return torch.softmax(scores, dim=-1) @ v


KINDS = ["alibi", "window", "decay", "bucket", "function_matrix", "learned"]
SIZES = [(5, 7, 3), (6, 9, 2)]  # (n, m, d), n < m: the window leaves no row empty (row i sees key i)


def _inputs(size, seed=0, kind=""):
    g = torch.Generator().manual_seed(seed)
    rows, cols, width = size
    tensors = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]
    return tensors + [torch.tensor(0.3, dtype=torch.float64)] if kind == "learned" else tensors


def _wanted(kind, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = reference(kind, *leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, leaves, cotangent)
    return out.detach(), cotangent, grads


@pytest.mark.parametrize("kind", KINDS)
def test_the_derivation_verifies(kind):
    derivation = sa.derive(positional_spec(kind))
    assert derivation.verify().ok


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_module_matches_autograd(kind, size):
    module = load(positional_spec(kind), "torch")
    inputs = _inputs(size, kind=kind)
    want, cotangent, grads = _wanted(kind, inputs)
    leaves = [x.clone().requires_grad_() for x in inputs]
    got = module.forward(*leaves)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, leaves, cotangent), grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_the_numpy_module_matches_autograd(kind):
    module = load(positional_spec(kind), "numpy")
    inputs = _inputs(SIZES[1], seed=1, kind=kind)
    want, cotangent, grads = _wanted(kind, inputs)
    out, saved = module.forward(*(x.numpy() for x in inputs))
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = module.backward(saved, cotangent.numpy())
    for name, w in zip(("Q", "K", "V", "tau"), grads):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("kind", ["alibi", "window", "bucket"])
def test_the_numpy_module_keeps_float32(kind):
    module = load(positional_spec(kind), "numpy")
    inputs = _inputs(SIZES[0], seed=2)
    out, _ = module.forward(*(x.float().numpy() for x in inputs))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference(kind, *inputs).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["alibi", "window", "decay", "learned"])
def test_the_jax_module_matches_autograd_under_jit(kind):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    module = load(positional_spec(kind), "jax")
    inputs = _inputs(SIZES[0], seed=3, kind=kind)
    want, cotangent, grads = _wanted(kind, inputs)
    arrays = [x.numpy() for x in inputs]
    out = jax.jit(module.forward)(*arrays)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-10, atol=1e-12)
    _, pullback = jax.vjp(module.forward, *arrays)
    for g, w in zip(pullback(cotangent.numpy()), grads):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-10, atol=1e-12)


def test_exact_evaluation_reads_the_formula_at_each_position():
    spec = positional_spec("window")
    positions = next(x for x in sp.preorder_traversal(spec.output) if type(x).__name__ == "Entries")
    values = sa.lambdify([], positions, backend="exact", dims={n: 4, m: 5})()
    want = [[0 if j <= i and i - j < WINDOW else -sp.oo for j in range(5)] for i in range(4)]
    assert np.asarray(values).tolist() == want


def test_the_derivation_prints_the_formula():
    text = sa.derive(positional_spec("alibi")).text()
    assert "[-Abs(i - j)/2]ᵢⱼ" in text
    latex = sa.derive(positional_spec("window")).latex()
    assert r"\right]_{i j}" in latex and r"\begin{cases}" in latex


def test_a_position_matrix_gets_no_gradient_and_is_no_argument():
    spec = positional_spec("alibi")
    assert [str(s) for s in spec.inputs] == ["Q", "K", "V"] and not spec.constants
    source = codegen.render(spec, "torch", second_order=False)
    assert "entries(lambda i, j: (-torch.abs((i - j)) / 2)" in source  # one division: exact at integers


@pytest.mark.parametrize(
    ("formula", "message"),
    [
        (lambda i, j: sp.Symbol("x") * (i - j), "x is no position, dimension or trainable scalar"),
        (lambda i, j: sp.MatrixSymbol("b", n, 1)[j, 0], r"b\[j, 0\]'s row index j runs over \[0, m - 1\]"),
        (lambda i, j: sp.sin(i - j), "sin"),
        (lambda i, j: i >= j, "f(i, j) is a condition"),
    ],
    ids=["unknown symbol", "table read past its end", "sin", "condition"],
)
def test_what_a_formula_may_not_hold_is_refused_in_one_line(formula, message):
    with pytest.raises(SymattnError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        sa.entries(n, m, formula)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["alibi", "window", "decay", "learned"])
def test_forward_mode_and_second_order_match_torch_func(kind):
    spec = positional_spec(kind)
    module = types.ModuleType(spec.name)  # rendered with its second closed form (load() renders first order)
    exec(compile(codegen.render(spec, "torch"), spec.name, "exec"), module.__dict__)
    inputs = _inputs(SIZES[0], seed=4, kind=kind)
    g = torch.Generator().manual_seed(5)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    out, tangent = module.jvp(*inputs, dict(zip(("Q", "K", "V", "tau"), tangents)))
    want_out, want_tangent = torch.func.jvp(lambda *x: reference(kind, *x), tuple(inputs), tuple(tangents))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tangent, want_tangent, rtol=1e-10, atol=1e-12)

    def hvp(function):
        leaves = [x.clone().requires_grad_() for x in inputs]
        first = torch.autograd.grad(function(*leaves).square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((f * t).sum() for f, t in zip(first, tangents)), leaves)

    for got, want in zip(hvp(module.forward), hvp(lambda *x: reference(kind, *x))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_any_spelling_gives_the_same_code():
    def source(kind):
        return codegen.render(dataclasses.replace(positional_spec(kind), name="spelled"), "torch")

    assert source("alibi") == source("function_matrix")


HEADS, D_K = 4, 2


def alibi_heads_spec() -> sa.Spec:
    """Multi-head attention with ALiBi's geometric slopes, one per head: 2^(−8(h+1)/H)."""
    q, k, v = (sp.MatrixSymbol(x, r, HEADS * d) for x, r in (("Q", n), ("K", m), ("V", m)))
    alibi = sa.entries(n, m, lambda i, j, h: -(2 ** (-8 * (h + 1) / sp.Integer(HEADS))) * sp.Abs(i - j), heads=HEADS)
    qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + alibi) @ vh, HEADS)
    return sa.Spec(name="alibi_heads", summary="ALiBi", inputs=(q, k, v), output=output)


def alibi_heads_reference(q, k, v):
    def heads(x):
        return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)

    i, j = _grid(q.shape[-2], k.shape[-2])
    slopes = torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], dtype=torch.float64)
    scores = heads(q) @ heads(k).mT / math.sqrt(D_K) - slopes[:, None, None] * (i - j).abs()
    out = torch.softmax(scores, dim=-1) @ heads(v)
    return out.transpose(-3, -2).reshape(*q.shape[:-1], HEADS * D_K)


def _heads_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, r, HEADS * D_K, generator=g, dtype=torch.float64) for r in (5, 7, 7)]


def test_per_head_positions_derive_and_match_autograd_in_every_backend():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    spec = alibi_heads_spec()
    assert sa.derive(spec).verify().ok
    inputs = _heads_inputs(8)
    leaves = [x.clone().requires_grad_() for x in inputs]
    want = alibi_heads_reference(*leaves)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    grads = torch.autograd.grad(want, leaves, cotangent)

    got = load(spec, "torch").forward(*leaves)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, leaves, cotangent), grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)

    numpy_module = load(spec, "numpy")
    out, saved = numpy_module.forward(*(x.numpy() for x in inputs))
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    for name, w in zip("QKV", grads):
        np.testing.assert_allclose(numpy_module.backward(saved, cotangent.numpy())[name], w.numpy(), rtol=1e-10)

    jax_module = load(spec, "jax")
    out, pullback = jax.vjp(jax_module.forward, *(x.numpy() for x in inputs))
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-10, atol=1e-12)
    for g, w in zip(pullback(cotangent.numpy()), grads):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-10, atol=1e-12)


def test_per_head_positions_need_a_function_of_three_positions():
    with pytest.raises(SymattnError, match=r"with heads, f takes \(i, j, h\)"):
        sa.entries(n, m, sp.Lambda((sp.Symbol("a"), sp.Symbol("b")), 0), heads=2)


def test_rows_the_formula_masks_whole_are_zeros_in_every_backend():
    """n > m and a causal window: rows i ≥ m + WINDOW − 1 (the last ones) see no key. As with a mask, such a row's
    output is 0 and every gradient finite (never NaN): the other rows are torch autograd's of those rows alone."""
    spec = positional_spec("window")
    q, k, v = _inputs((9, 5, 3))
    seen = 5 + WINDOW - 1  # rows 0 … seen − 1 see a key
    cotangent = torch.randn(2, 9, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q[:, :seen], k, v)]
    kept = reference("window", *leaves)
    want = torch.cat([kept.detach(), torch.zeros(2, 9 - seen, 3, dtype=torch.float64)], dim=1)
    dq, dk, dv = torch.autograd.grad(kept, leaves, cotangent[:, :seen])
    dq = torch.cat([dq, torch.zeros(2, 9 - seen, 3, dtype=torch.float64)], dim=1)  # the empty rows read nothing
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    got = load(spec, "torch").forward(*leaves)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, leaves, cotangent), (dq, dk, dv)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    arrays = [x.numpy() for x in (q, k, v)]
    out, saved = load(spec, "numpy").forward(*arrays)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = load(spec, "numpy").backward(saved, cotangent.numpy())
    for name, w in zip(("Q", "K", "V"), (dq, dk, dv)):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    out, pullback = jax.vjp(load(spec, "jax").forward, *arrays)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-10, atol=1e-12)
    for g, w in zip(pullback(cotangent.numpy()), (dq, dk, dv)):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_a_per_head_window_is_exact_at_its_boundaries(backend):
    """Head h sees i − 4 − 6h < j ≤ i. SymPy writes the condition in sixths (h > i/6 − j/6 − 2/3) and the layout's
    head as ⌊J/n⌋; printed as products with 1/6 and 1/n they round, and the mask flipped at its boundary (every
    third row) and at J = n (49 · (1/49) < 1). Printed with integer coefficients and one division: exact. Compared
    with the mask computed in integers, at n = 49, in float32 and float64."""
    q, k, v = (sp.MatrixSymbol(x, n, HEADS * d) for x in "QKV")
    window = sa.entries(
        n, n, lambda i, j, h: sp.Piecewise((0, (j <= i) & (i - j < 4 + 6 * h)), (-sp.oo, True)), heads=HEADS
    )
    qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh @ kh.T + window) @ vh, HEADS)
    module = load(sa.Spec(name="head_windows", summary="a window per head", inputs=(q, k, v), output=output), backend)
    size = 49
    i, j = torch.arange(size)[:, None], torch.arange(size)[None, :]
    hidden = torch.stack([~((j <= i) & (i - j < 4 + 6 * h)) for h in range(HEADS)])
    for dtype in (torch.float32, torch.float64):
        x = [
            torch.randn(1, size, HEADS * D_K, dtype=dtype, generator=torch.Generator().manual_seed(s)) for s in range(3)
        ]
        heads = [t.view(1, size, HEADS, D_K).transpose(1, 2) for t in x]
        want = (heads[0] @ heads[1].mT).masked_fill(hidden, -math.inf).softmax(-1) @ heads[2]
        want = want.transpose(1, 2).reshape(1, size, HEADS * D_K)
        got = module.forward(*x) if backend == "torch" else torch.from_numpy(module.forward(*(t.numpy() for t in x))[0])
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-6)


def test_comparisons_are_printed_with_integer_coefficients():
    """A comparison of one term or several, rational coefficients scaled to integers against 0, others as they are."""
    from symattn.lang.positions import I, J
    from symattn.numeric.positions import integral

    assert integral(sp.Gt(I / 6, 0)) == (I, 0)
    assert integral(sp.Lt(I / 6 - J / 4, sp.Rational(2, 3))) == (2 * I - 3 * J - 8, 0)
    assert integral(sp.Lt(I, J)) == (I, J)
