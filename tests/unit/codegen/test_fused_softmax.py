"""The fused row softmax (numba, when installed) against the pure NumPy passes it replaces (issue 27, item 2)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from symattn.generated import attention_numpy, attention_numpy_memeff, mha_numpy
from sympy import HadamardProduct, MatrixSymbol, OneMatrix

from symattn.codegen.backends.jax.backend import JaxMatrixPrinter
from symattn.codegen.backends.numpy import runtime as numpy_runtime
from symattn.codegen.backends.numpy.backend import GENERATED_NUMPY_RUNTIME, GeneratedNumPyPrinter
from symattn.lang.functions import Exp

# float rounding: a few ulps of each entry (the fused kernel's exp is a polynomial, its scale a reciprocal)
RTOL = {np.float32: 1e-5, np.float64: 1e-13}


@pytest.fixture
def no_numba(monkeypatch):
    """The pure NumPy path: _fused_kernels answers None, as without numba."""
    for module in (numpy_runtime, attention_numpy, attention_numpy_memeff, mha_numpy):
        monkeypatch.setattr(module._fused_kernels, "made", None, raising=False)


def fused_or_skip():
    """Skip a test of the fused kernel where it is off: numba absent (the floor) or SYMATTN_NUMBA=0."""
    pytest.importorskip("numba")
    if os.environ.get("SYMATTN_NUMBA") == "0":
        pytest.skip("SYMATTN_NUMBA=0: the NumPy passes")


def numpy_path(helper, a, *rest):
    """helper(a, *rest) by the NumPy passes alone."""
    made = numpy_runtime._fused_kernels.__dict__.get("made", False)
    numpy_runtime._fused_kernels.made = None
    try:
        return helper(a.copy(), *rest)
    finally:
        numpy_runtime._fused_kernels.made = made


def scores(rng, dtype, shape=(2, 3, 37, 53)):
    return (4 * rng.standard_normal(shape)).astype(dtype)


def test_without_numba_the_helpers_are_numpys(no_numba, rng):
    a = scores(rng, np.float64)
    assert numpy_runtime.fused_row_softmax(a) is None
    expected = np.exp(a - a.max(axis=-1, keepdims=True))
    expected /= expected.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(numpy_runtime.row_softmax(a.copy()), expected, rtol=1e-14)


def test_symattn_numba_0_turns_the_kernels_off(monkeypatch):
    # a fresh copy of the helper, as a generated module holds one: the variable is read on its first call
    monkeypatch.setenv("SYMATTN_NUMBA", "0")
    namespace: dict = {"np": np}
    exec(GENERATED_NUMPY_RUNTIME["_fused_kernels"], namespace)
    assert namespace["_fused_kernels"]() is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_softmax_matches_the_numpy_passes(rng, dtype, masked):
    fused_or_skip()
    helper = numpy_runtime.masked_row_softmax if masked else numpy_runtime.row_softmax
    a = scores(rng, dtype)
    if masked:  # a row of -inf (zeros, not NaN), rows partly -inf, one key hidden from every row
        a[0, 1, 4] = -np.inf
        a[1, 2, :5, 10:40] = -np.inf
        a[..., 7] = -np.inf
    assert numpy_runtime.fused_row_softmax(a.copy()) is not None
    expected = numpy_path(helper, a)
    got = helper(a.copy())
    assert got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=RTOL[dtype], atol=0)
    if masked:
        assert not np.isnan(got).any()
        assert (got[0, 1, 4] == 0).all() and (got[..., 7] == 0).all()
    # in place, into another array, and a new array: the same values
    b = a.copy()
    assert helper(b, out=b) is b
    np.testing.assert_array_equal(b, got)
    c = np.empty_like(a)
    assert helper(a, out=c) is c
    np.testing.assert_array_equal(c, got)


def test_fused_softmax_keeps_nan_and_tiny_probabilities(rng):
    fused_or_skip()
    a = scores(rng, np.float64, (4, 300))
    a[0, 3] = np.nan
    a[1] = np.linspace(-800.0, 0.0, 300)  # exp underflows below -708 (to subnormals in NumPy, to 0 here)
    got = numpy_runtime.row_softmax(a.copy())
    expected = numpy_path(numpy_runtime.row_softmax, a)
    assert np.isnan(got[0]).all() and np.isnan(expected[0]).all()
    np.testing.assert_allclose(got[1:], expected[1:], rtol=1e-13, atol=1e-300)


def test_other_dtypes_and_layouts_take_the_numpy_passes(rng):
    fused_or_skip()
    assert numpy_runtime.fused_row_softmax(scores(rng, np.float16)) is None
    assert numpy_runtime.fused_row_softmax(scores(rng, np.float64).mT) is None
    assert numpy_runtime.fused_row_softmax(np.zeros((0, 5))) is None
    a = scores(rng, np.float64).mT  # not contiguous: row_softmax still right
    np.testing.assert_allclose(numpy_runtime.row_softmax(a), numpy_path(numpy_runtime.row_softmax, a), rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_and_log_sum_exp_match_the_numpy_passes(rng, dtype, masked):
    fused_or_skip()
    helper = numpy_runtime.masked_row_softmax_lse if masked else numpy_runtime.row_softmax_lse
    a = scores(rng, dtype)
    if masked:
        a[0, 1, 4] = -np.inf  # a row of -inf: zeros and L = +inf
        a[1, 2, :5, 10:40] = -np.inf
    expected, expected_lse = numpy_path(helper, a)
    for out in (None, "a", "other"):
        b = a.copy()
        target = {None: None, "a": b, "other": np.empty_like(a)}[out]
        got, lse = helper(b, out=target)
        assert out is None or got is target
        np.testing.assert_allclose(got, expected, rtol=RTOL[dtype], atol=0)
        np.testing.assert_allclose(lse, expected_lse, rtol=RTOL[dtype], atol=0)
    if masked:
        assert (got[0, 1, 4] == 0).all() and (lse[0, 1, 4] == np.inf).all()
    np.testing.assert_allclose(np.exp(a - lse), expected, rtol=10 * RTOL[dtype], atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fused", [True, False])
def test_row_shifted_forms_match_the_numpy_passes(rng, request, dtype, fused):
    # exp(X − u 𝟏ᵀ) and F ⊙ (X − u 𝟏ᵀ), u a strided view (one block of a row log-sum-exp), into a new array,
    # into X, into F and into another array; u = +inf gives 0, NaN stays NaN; the kernels and NumPy's passes
    if fused:
        fused_or_skip()
    else:
        request.getfixturevalue("no_numba")
    a = scores(rng, dtype)
    shift = (a.max(axis=-1, keepdims=True) + rng.random((2, 3, 37, 1)))[:, :, 5:25].astype(dtype)
    a = a[:, :, 5:25].copy()
    shift[0, 0, 3] = np.inf
    a[1, 1, 2, 7] = np.nan
    p = rng.random(a.shape).astype(dtype)
    cases = {
        "exp_rows": (numpy_runtime.exp_rows, (a, shift), lambda: np.exp(a - shift)),
        "shifted_product": (numpy_runtime.shifted_product, (p, a, shift), lambda: p * (a - shift)),
    }
    for name, (helper, operands, expected) in cases.items():
        want = expected()
        for into in (None, "a", "p", "other"):
            if into == "p" and name == "exp_rows":
                continue
            args = [x.copy() for x in operands]
            out = {None: None, "a": args[-2], "p": args[0], "other": np.empty_like(a)}[into]
            got = helper(*args, out=out)
            assert into is None or got is out
            np.testing.assert_allclose(got, want, rtol=RTOL[dtype], atol=0, err_msg=f"{name} into {into}")
        assert (got[0, 0, 3] == (0 if name == "exp_rows" else -np.inf)).all() and np.isnan(got[1, 1, 2, 7])
    # a broadcast shift, another dtype: NumPy's passes, the same values
    np.testing.assert_allclose(numpy_runtime.exp_rows(a, shift[0]), np.exp(a - shift[0]), rtol=RTOL[dtype])
    np.testing.assert_allclose(
        numpy_runtime.exp_rows(a, shift.astype(np.float16)), np.exp(a - shift.astype(np.float16)), rtol=1e-3
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_polynomial_exp_over_the_whole_range(dtype):
    # exp_rows' exp where NumPy's is a normal number (to within 2 ulps), inf above the largest float's log, 0
    # below the smallest normal's (NumPy gives subnormals there)
    fused_or_skip()
    tiny, big = np.log(np.finfo(dtype).tiny), np.log(np.finfo(dtype).max)
    x = np.linspace(tiny + 1e-3, big - 1e-3, 300_001).astype(dtype)[None, None, :]
    got = numpy_runtime.exp_rows(x, np.zeros((1, 1, 1), dtype))
    np.testing.assert_allclose(got, np.exp(x), rtol=2 * np.finfo(dtype).eps, atol=0)
    edges = np.array([[[big + 0.5, 1e30, np.inf, tiny - 1, -np.inf, 0.0]]], dtype=dtype)
    got = numpy_runtime.exp_rows(edges, np.zeros((1, 1, 1), dtype))
    np.testing.assert_array_equal(got, np.array([[[np.inf, np.inf, np.inf, 0.0, 0.0, 1.0]]], dtype=dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_and_softplus_kernels_over_the_whole_range(dtype):
    # σ(x) = 1 / (1 + exp(−x)) and softplus(x) = max(x, 0) + log1p(exp(−|x|)) (its log1p 2 atanh(u / (2 + u)), a
    # series) against long-double references: within 4 ulps where the value is a normal number, below the
    # smallest normal where it is not (the polynomial exp gives 0 there), inf, 0 and NaN at the edges
    fused_or_skip()
    big = float(np.log(np.finfo(dtype).max))
    x = np.concatenate([np.linspace(-big, big, 400_001), np.geomspace(1e-30, 30, 20_001) * -1]).astype(dtype)
    wide = x.astype(np.longdouble)
    references = {
        numpy_runtime.sigmoid: 1 / (1 + np.exp(-wide)),
        numpy_runtime.softplus: np.logaddexp(np.longdouble(0), wide),
    }
    tiny = np.finfo(dtype).tiny
    for helper, reference in references.items():
        got, want = helper(x), reference.astype(dtype)
        assert got.dtype == dtype and got is not x
        normal = want >= tiny
        np.testing.assert_allclose(got[normal], want[normal], rtol=4 * np.finfo(dtype).eps, atol=0)
        assert np.all(got[~normal] < tiny) and np.all(got[~normal] >= 0)
    edges = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], dtype=dtype)
    ulps = {"rtol": 4 * np.finfo(dtype).eps, "atol": 0}
    np.testing.assert_allclose(numpy_runtime.sigmoid(edges), np.array([1, 0, np.nan, 0.5, 0.5], dtype=dtype), **ulps)
    np.testing.assert_allclose(
        numpy_runtime.softplus(edges), np.array([np.inf, 0, np.nan, np.log(2), np.log(2)], dtype=dtype), **ulps
    )


def test_sigmoid_and_softplus_without_the_kernels_are_numpys(rng):
    # no numba, another dtype, a strided array or a scalar: NumPy's passes (np.logaddexp for softplus), the same
    # values; the kernel leaves its argument as it was
    a = scores(rng, np.float64)
    np.testing.assert_array_equal(numpy_path(numpy_runtime.softplus, a), np.logaddexp(0.0, a))
    np.testing.assert_array_equal(numpy_path(numpy_runtime.sigmoid, a), 1.0 / (1.0 + np.exp(-a)))
    half = a.astype(np.float16)
    np.testing.assert_array_equal(numpy_runtime.softplus(half), np.logaddexp(0.0, half))
    assert numpy_runtime.softplus(2.0) == np.logaddexp(0.0, 2.0)
    before = a.copy()
    strided = a[..., ::2]
    np.testing.assert_allclose(numpy_runtime.softplus(strided), np.logaddexp(0.0, strided), rtol=RTOL[np.float64])
    np.testing.assert_allclose(numpy_runtime.sigmoid(a), 1.0 / (1.0 + np.exp(-a)), rtol=RTOL[np.float64])
    np.testing.assert_array_equal(a, before)


def test_the_numpy_printer_prints_the_row_shifted_forms():
    X, F, u, v = MatrixSymbol("X", 4, 5), MatrixSymbol("F", 4, 5), MatrixSymbol("u", 4, 1), MatrixSymbol("v", 1, 5)
    shifted = X - u * OneMatrix(1, 5)
    printer = GeneratedNumPyPrinter()
    assert printer.doprint(Exp(shifted)) == "exp_rows(X, u)"
    assert printer.doprint(HadamardProduct(F, shifted)) == "shifted_product(F, X, u)"
    assert printer.doprint(HadamardProduct(X - 2 * u * OneMatrix(1, 5), F)) == "shifted_product(F, X, 2 * u)"
    assert printer.doprint(Exp(X - OneMatrix(4, 1) * v)) == "np.exp(X - v)"  # a row broadcast down the columns
    assert printer.doprint(Exp(X + u * OneMatrix(1, 5))) == "np.exp(u + X)"
    assert JaxMatrixPrinter().doprint(Exp(shifted)) == "jnp.exp(X - u)"  # XLA fuses it


def run_modules(rng, dtype, causal):
    """forward + backward of the generated attention (standard and memory-efficient) and mha modules."""
    B, H, n, m, d = 2, 2, 70, 45, 8
    Q, K, V, G = (
        rng.standard_normal(s).astype(dtype) for s in [(B, H, n, d), (B, H, m, d), (B, H, m, d), (B, H, n, d)]
    )
    padding = np.zeros((B, H, m), dtype=bool)
    padding[0, 1, 20:] = True
    padding[1, 0, :] = True  # every key hidden: zero rows
    results = {}
    for module in (attention_numpy, attention_numpy_memeff):
        out, saved = module.forward(Q, K, V, causal=causal, key_padding_mask=padding, **block(module))
        results[f"{module.__name__} O"] = out
        results |= {f"{module.__name__} d{k}": v for k, v in module.backward(saved, G).items()}
    X = rng.standard_normal((B, n, 16)).astype(dtype)
    W = [rng.standard_normal((16, 16)).astype(dtype) / 4 for _ in range(4)]
    out, saved = mha_numpy.forward(X, X, X, *W, num_heads=4, causal=causal)
    results["mha out"] = out
    results |= {
        f"mha d{k}": v for k, v in mha_numpy.backward(saved, rng.standard_normal(out.shape).astype(dtype)).items()
    }
    return results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_generated_modules_give_the_same_gradients_with_and_without_numba(rng, monkeypatch, dtype, causal):
    fused_or_skip()
    assert attention_numpy._fused_kernels() is not None and mha_numpy._fused_kernels() is not None
    seed = int(rng.integers(1 << 31))
    fused = run_modules(np.random.default_rng(seed), dtype, causal)
    for module in (attention_numpy, attention_numpy_memeff, mha_numpy):
        monkeypatch.setattr(module._fused_kernels, "made", None)
    plain = run_modules(np.random.default_rng(seed), dtype, causal)
    for name, value in plain.items():
        assert not np.isnan(fused[name]).any(), name
        scale = np.abs(value).max()
        np.testing.assert_allclose(fused[name], value, rtol=0, atol=50 * np.finfo(dtype).eps * scale, err_msg=name)


def block(module):
    """Blocks of 32 rows for the memory-efficient module (its loop), nothing for the others."""
    return {"block_size": 32} if module.__name__.endswith("memeff") else {}


def test_every_generated_module_shares_one_compilation():
    # two copies of the helper (two generated modules): the kernels compiled once per process, not per module
    fused_or_skip()
    copies = []
    for _ in range(2):
        namespace: dict = {"np": np}
        exec(GENERATED_NUMPY_RUNTIME["_fused_kernels"], namespace)
        copies.append(namespace["_fused_kernels"]())
    assert copies[0] is not None and copies[0] is copies[1]
