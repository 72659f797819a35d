"""The NumPy runtime helpers that generated modules and evaluated expressions copy, run as ordinary code."""

from __future__ import annotations

import math

import numpy as np
import pytest

from symattn.codegen.backends import common_runtime
from symattn.codegen.backends.numpy import runtime as numpy_runtime
from symattn.codegen.backends.numpy.backend import GENERATED_NUMPY_RUNTIME
from symattn.numeric import numpy_runtime as eval_runtime


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_every_helper_runs_from_its_copied_source_with_only_numpy():
    # a generated NumPy module imports only numpy: each helper's source must stand in such a namespace
    namespace: dict = {"np": np, "SHAPES": {}, "OPTIONAL": ()}
    for name, helper in GENERATED_NUMPY_RUNTIME.items():
        exec(helper, namespace)
        assert callable(namespace[name]), name


def test_row_softmax_rows_sum_to_one_and_may_overwrite_its_input(rng):
    # softmax(A) = exp(A − max) / rowsum(exp(A − max))
    a = rng.normal(size=(2, 3, 5))
    expected = np.exp(a) / np.exp(a).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(eval_runtime.row_softmax(a), expected, rtol=1e-14)
    np.testing.assert_allclose(numpy_runtime.row_softmax(a.copy()), expected, rtol=1e-14)
    b = a.copy()
    assert numpy_runtime.row_softmax(b, out=b) is b
    np.testing.assert_allclose(b, expected, rtol=1e-14)


def test_masked_softmax_gives_zeros_for_a_row_of_minus_infinity(rng):
    a = rng.normal(size=(3, 4))
    a[1] = -np.inf
    p = numpy_runtime.masked_row_softmax(a.copy())
    assert np.all(p[1] == 0) and np.allclose(p[[0, 2]].sum(axis=-1), 1)
    p_lse, lse = numpy_runtime.masked_row_softmax_lse(a)
    np.testing.assert_allclose(p_lse, p, rtol=1e-14)
    assert lse[1, 0] == np.inf


def test_log_sum_exp_recovers_the_softmax(rng):
    # P = exp(A − L), L = log rowsum(exp(A))
    a = rng.normal(size=(2, 3, 4))
    p, lse = numpy_runtime.row_softmax_lse(a)
    np.testing.assert_allclose(np.exp(a - lse), p, rtol=1e-14)
    np.testing.assert_allclose(lse, np.log(np.exp(a).sum(axis=-1, keepdims=True)), rtol=1e-14)


def test_rows_and_batch_sums(rng):
    a = rng.normal(size=(2, 3, 4, 5))
    assert numpy_runtime.rows(a).shape == (24, 5)
    np.testing.assert_allclose(numpy_runtime.sum_batch(a), a.sum(axis=(0, 1)), rtol=1e-14)
    assert common_runtime.add_optional(a, None) is a
    np.testing.assert_allclose(common_runtime.add_optional(a, 1.0), a + 1.0)


def test_heads_split_merge_repeat_and_sum_groups(rng):
    a = rng.normal(size=(2, 3, 8))
    heads = eval_runtime.split_heads(a, 4)
    assert heads.shape == (2, 4, 3, 2)
    np.testing.assert_array_equal(eval_runtime.merge_heads(heads, 4), a)
    kv = rng.normal(size=(2, 2, 3, 2))
    g = rng.normal(size=(2, 4, 3, 2))
    # <Rep(kv), g> = <kv, GroupSum(g)>: the two are adjoint
    left = np.sum(eval_runtime.repeat_heads(kv, 4) * g)
    right = np.sum(kv * eval_runtime.sum_groups(g, 2))
    assert math.isclose(left, right, rel_tol=1e-12)


def test_erf_gelu_and_their_derivatives(rng):
    x = np.linspace(-7, 7, 201)
    assert np.max(np.abs(eval_runtime.erf(x) - np.array([math.erf(t) for t in x]))) < 4e-15
    h = 1e-6
    for f, df in ((eval_runtime.gelu, eval_runtime.gelu_grad), (eval_runtime.gelu_tanh, eval_runtime.gelu_tanh_grad)):
        np.testing.assert_allclose(df(x), (f(x + h) - f(x - h)) / (2 * h), atol=1e-8)
    np.testing.assert_allclose(eval_runtime.sigmoid(x), 1 / (1 + np.exp(-x)), rtol=1e-14)


def test_layer_norm_and_row_inverse_std(rng):
    a = rng.normal(size=(3, 6))
    expected = (a - a.mean(axis=-1, keepdims=True)) / np.sqrt(a.var(axis=-1, keepdims=True) + 0.1)
    np.testing.assert_allclose(eval_runtime.layer_norm(a, 0.1), expected, rtol=1e-13)
    np.testing.assert_allclose(eval_runtime.row_inv_std(a, 0.1), 1 / np.sqrt(a.var(axis=-1, keepdims=True) + 0.1))


def test_exact_helpers_agree_with_numpy():
    import sympy as sp

    a = np.array([[sp.Rational(1, 3), sp.Rational(-1, 2)], [1, 2]], dtype=object)
    from symattn.numeric import exact_runtime
    from symattn.numeric.exact_runtime import ExpAtom

    def value(v):  # the opaque exp atoms made exp again, then the number
        return sp.N(v.replace(ExpAtom, sp.exp), 30)

    for name in ("gelu", "gelu_grad", "gelu_tanh", "gelu_tanh_grad", "sigmoid", "row_softmax", "log_softmax"):
        helper = getattr(exact_runtime, name, None) or (lambda x, name=name: exact_runtime.entrywise(x, name))
        exact = np.array(np.vectorize(value)(helper(a)), dtype=float)
        np.testing.assert_allclose(exact, eval_runtime.__dict__[name](a.astype(float)), rtol=1e-12, err_msg=name)


@pytest.fixture
def shapes(monkeypatch):
    shapes = {"Q": "(..., n, d_k)", "W": "(d, d_k)", "b": "(1, d_k)"}
    for module in (numpy_runtime, common_runtime):
        monkeypatch.setattr(module, "SHAPES", shapes)
    monkeypatch.setattr(numpy_runtime, "OPTIONAL", ("b",))
    return shapes


def test_input_checks_name_the_input(shapes, rng):
    q, w = rng.normal(size=(2, 3, 4)), rng.normal(size=(5, 4))
    arrays = numpy_runtime._arrays({"Q": q, "W": w, "b": None})
    assert arrays[2] is None and arrays[0].shape == (2, 3, 4)
    with pytest.raises(ValueError, match="W: expected shape"):
        numpy_runtime._arrays({"Q": q, "W": w[None]})
    with pytest.raises(ValueError, match="mixed dtypes"):
        numpy_runtime._arrays({"Q": q, "W": w.astype(np.float32)})
    with pytest.raises(ValueError, match="floating-point"):
        numpy_runtime._arrays({"Q": q.astype(int)})
    with pytest.raises(ValueError, match=r"Q: expected shape \(\.\.\., n, d_k\) = \(\.\.\., 3, 5\)"):
        common_runtime._check_shape("Q", q, (3, 5))
    with pytest.raises(ValueError, match="a multiple of 3"):
        common_runtime._quotient("Q", (2, 3, 4), 3)
    assert common_runtime._quotient("Q", (2, 3, 4), 2) == 2
    with pytest.raises(ValueError, match="only the query rows may be empty"):
        common_runtime._nonempty({"m": 0}, {"Q": q})
    saved = {"output_shape": (2, 3), "dtype": np.float64}
    with pytest.raises(ValueError, match="grad_out: expected shape"):
        numpy_runtime._cotangent(np.zeros((3, 2)), saved)


def test_positive_integers():
    assert common_runtime._positive_int("h", np.int64(3)) == 3
    for bad in (True, 0, 1.5, "2"):
        with pytest.raises(ValueError, match="h must be a positive integer"):
            common_runtime._positive_int("h", bad)


def test_additive_mask_is_zero_or_minus_infinity():
    q, k = np.zeros((2, 3, 4)), np.zeros((2, 5, 4))
    assert numpy_runtime._additive_mask(None, None, False, q, k) is None
    causal = numpy_runtime._additive_mask(None, None, True, q, k)
    assert causal.shape == (3, 5) and causal[0, 1] == -np.inf and causal[1, 1] == 0
    padding = np.zeros((2, 5), dtype=bool)
    padding[1, 4] = True
    mask = numpy_runtime._additive_mask(None, padding, False, q, k, per_head=True)
    assert mask.shape == (2, 1, 3, 5) and np.all(mask[1, 0, :, 4] == -np.inf) and np.all(mask[0] == 0)
    with pytest.raises(ValueError, match="causal must be True or False"):
        numpy_runtime._additive_mask(None, None, 1, q, k)
    with pytest.raises(ValueError, match="attn_mask: expected shape"):
        numpy_runtime._additive_mask(np.zeros((2, 2), dtype=bool), None, False, q, k)
