"""The fused row softmax (numba, when installed) against the pure NumPy passes it replaces (issue 27, item 2)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from symattn.generated import attention_numpy, mha_numpy

from symattn.codegen.backends import numpy_runtime
from symattn.codegen.backends.numpy_backend import GENERATED_NUMPY_RUNTIME

# float rounding: a few ulps of each entry (the fused kernel's exp is a polynomial, its scale a reciprocal)
RTOL = {np.float32: 1e-5, np.float64: 1e-13}


@pytest.fixture
def no_numba(monkeypatch):
    """The pure NumPy path: _fused_kernels answers None, as without numba."""
    for module in (numpy_runtime, attention_numpy, mha_numpy):
        monkeypatch.setattr(module._fused_kernels, "made", None, raising=False)


def fused_or_skip():
    """Skip a test of the fused kernel where it is off: numba absent (the floor) or SYMATTN_NUMBA=0."""
    pytest.importorskip("numba")
    if os.environ.get("SYMATTN_NUMBA") == "0":
        pytest.skip("SYMATTN_NUMBA=0: the NumPy passes")


def numpy_path(helper, a):
    """helper(a) by the NumPy passes alone."""
    made = numpy_runtime._fused_kernels.__dict__.get("made", False)
    numpy_runtime._fused_kernels.made = None
    try:
        return helper(a.copy())
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


def run_modules(rng, dtype, causal):
    """forward + backward of the generated attention and mha modules."""
    B, H, n, m, d = 2, 2, 70, 45, 8
    Q, K, V, G = (
        rng.standard_normal(s).astype(dtype) for s in [(B, H, n, d), (B, H, m, d), (B, H, m, d), (B, H, n, d)]
    )
    padding = np.zeros((B, H, m), dtype=bool)
    padding[0, 1, 20:] = True
    padding[1, 0, :] = True  # every key hidden: zero rows
    out, saved = attention_numpy.forward(Q, K, V, causal=causal, key_padding_mask=padding)
    results = {"attention O": out, **{f"attention d{k}": v for k, v in attention_numpy.backward(saved, G).items()}}
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
    for module in (attention_numpy, mha_numpy):
        monkeypatch.setattr(module._fused_kernels, "made", None)
    plain = run_modules(np.random.default_rng(seed), dtype, causal)
    for name, value in plain.items():
        assert not np.isnan(fused[name]).any(), name
        scale = np.abs(value).max()
        np.testing.assert_allclose(fused[name], value, rtol=0, atol=50 * np.finfo(dtype).eps * scale, err_msg=name)


def test_every_generated_module_shares_one_compilation():
    # two copies of the helper (two generated modules): the kernels compiled once per process, not per module
    fused_or_skip()
    copies = []
    for _ in range(2):
        namespace: dict = {"np": np}
        exec(GENERATED_NUMPY_RUNTIME["_fused_kernels"], namespace)
        copies.append(namespace["_fused_kernels"]())
    assert copies[0] is not None and copies[0] is copies[1]
