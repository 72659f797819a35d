"""The JAX runtime helpers generated modules copy, run as ordinary code and checked against NumPy's."""

from __future__ import annotations

import numpy as np
import pytest

from symattn.codegen.backends import numpy_runtime
from symattn.codegen.backends.jax_backend import JAX_RUNTIME
from symattn.numeric import numpy_runtime as eval_runtime

jax = pytest.importorskip("jax", reason="jax is an optional extra: pip install -e '.[jax]'")
jax.config.update("jax_enable_x64", True)
from symattn.codegen.backends import jax_runtime  # noqa: E402 (after the skip: it needs jax to run)


def test_every_helper_runs_from_its_copied_source_with_only_jax():
    namespace: dict = {"jax": jax, "jnp": jax.numpy, "SHAPES": {}, "OPTIONAL": ()}
    for name, helper in JAX_RUNTIME.items():
        exec(helper, namespace)
        assert callable(namespace[name]), name


@pytest.mark.parametrize(
    "name, args",
    [
        ("row_softmax", ()),
        ("masked_row_softmax", ()),
        ("rows", ()),
        ("sum_batch", ()),
        ("sigmoid", ()),
        ("gelu", ()),
        ("gelu_grad", ()),
        ("gelu_tanh", ()),
        ("gelu_tanh_grad", ()),
        ("layer_norm", (0.1,)),
        ("row_inv_std", (0.1,)),
        ("split_heads", (2,)),
        ("merge_heads", (3,)),
        ("repeat_heads", (6,)),
        ("sum_groups", (1,)),
    ],
)
def test_jax_helpers_agree_with_numpy(name, args):
    a = np.random.default_rng(0).normal(size=(2, 3, 4, 6))
    expected = getattr(numpy_runtime, name, None) or getattr(eval_runtime, name)
    got = getattr(jax_runtime, name)(jax.numpy.asarray(a), *args)
    np.testing.assert_allclose(np.asarray(got), expected(a.copy(), *args), rtol=1e-12, atol=1e-14, err_msg=name)


def test_sum_to_shape_and_residuals():
    a = jax.numpy.ones((2, 3, 4, 5))
    assert jax_runtime.sum_to_shape(a, (4, 5)).tolist() == np.full((4, 5), 6.0).tolist()
    assert jax_runtime.sum_to_shape(a, (2, 1, 4, 5)).shape == (2, 1, 4, 5)
    assert float(jax_runtime.sum_to_shape(a, (2, 1, 4, 5))[0, 0, 0, 0]) == 3.0
    saved = {"P": a, "b": None, "H": 2, "shape": (4, 5)}
    arrays, static = jax_runtime._residuals(saved)
    assert set(arrays) == {"P", "b"} and jax.tree_util.tree_leaves(static) == []
    assert jax_runtime._restore((arrays, static)) == saved
