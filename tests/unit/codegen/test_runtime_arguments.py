"""The runtime helpers a generated forward reads its arguments with, in each backend: a constant given as a bool
(``_bool_constant``, by its Spec.bool_forms form), the additive mask in its position (``_one_mask``), parameters
given 1-D (``_rows``, NumPy's ``_vectors`` and ``_as_given``)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from symattn.codegen.backends.numpy import runtime as numpy_runtime

BOOL = np.array([[True, False, True]])
# each form of a bool [[True, False, True]]: the matrix the spec holds
FORMS = {
    "additive": [[-np.inf, 0.0, -np.inf]],
    "additive_false": [[0.0, -np.inf, 0.0]],
    "keep": [[0.0, 1.0, 0.0]],
    "keep_false": [[1.0, 0.0, 1.0]],
}


def _library(backend: str):
    """(the runtime module, an array maker) of a backend."""
    if backend == "numpy":
        return numpy_runtime, np.asarray
    if backend == "torch":
        torch = pytest.importorskip("torch")
        return importlib.import_module("symattn.codegen.backends.torch.runtime"), torch.as_tensor
    jnp = pytest.importorskip("jax.numpy")
    return importlib.import_module("symattn.codegen.backends.jax.runtime"), jnp.asarray


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("form", list(FORMS))
def test_a_bool_constant_becomes_the_spec_matrix_of_its_form_in_the_inputs_dtype(backend, form):
    runtime, array = _library(backend)
    like = array(np.zeros((2, 3), dtype=np.float32))
    made = runtime._bool_constant(array(BOOL), form, like)
    assert str(made.dtype).endswith("float32"), made.dtype
    np.testing.assert_array_equal(np.asarray(made), np.array(FORMS[form], dtype=np.float32))
    given = array(np.ones((1, 3), dtype=np.float32))
    assert runtime._bool_constant(given, form, like) is given  # a float matrix: the constant as it is


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_the_mask_in_its_position_is_checked_and_named(backend):
    runtime, array = _library(backend)
    query, key = array(np.zeros((2, 3, 4))), array(np.zeros((2, 5, 4)))
    mask = array(np.zeros((3, 5), dtype=bool))
    assert runtime._one_mask("M", None, mask, query, key) is mask  # attn_mask alone
    np.testing.assert_array_equal(np.asarray(runtime._one_mask("M", mask, None, query, key, allowed=True)), True)
    with pytest.raises(TypeError, match="M both in its position and as attn_mask"):
        runtime._one_mask("M", mask, mask, query, key)
    with pytest.raises(
        ValueError,
        match=r"M: expected shape \(n, m\) = \(3, 5\) or \(2, 3, 5\), or one broadcasting to it, got \(5, 3\)",
    ):
        runtime._one_mask("M", array(np.zeros((5, 3))), None, query, key)
    with pytest.raises(ValueError, match="M: expected a bool or floating-point"):
        runtime._one_mask("M", array(np.zeros((3, 5), dtype=np.int32)), None, query, key)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_a_parameter_given_1d_is_viewed_as_its_row(backend):
    runtime, array = _library(backend)
    bias, row = array(np.arange(3.0)), array(np.ones((1, 3)))
    got = runtime._rows({"b": bias, "c": row, "d": None})
    assert tuple(got[0].shape) == (1, 3) and got[1] is row and got[2] is None
    np.testing.assert_array_equal(np.asarray(got[0])[0], np.arange(3.0))


def test_numpy_returns_the_gradient_of_a_parameter_given_1d_as_a_vector():
    named = {"b": np.zeros(3), "c": np.zeros((1, 3)), "d": None}
    vectors = numpy_runtime._vectors(named)
    assert vectors == ("b",)
    grads = numpy_runtime._as_given({"b": np.ones((1, 3)), "c": np.ones((1, 3)), "d": None}, vectors)
    assert {name: g.shape for name, g in grads.items()} == {"b": (3,), "c": (1, 3)}  # None: left out
