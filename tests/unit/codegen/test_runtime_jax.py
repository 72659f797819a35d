"""The JAX runtime helpers generated modules copy, run as ordinary code and checked against NumPy's."""

from __future__ import annotations

import numpy as np
import pytest

from symattn.codegen.backends.jax.backend import JAX_RUNTIME
from symattn.codegen.backends.numpy import runtime as numpy_runtime
from symattn.numeric import numpy_runtime as eval_runtime

jax = pytest.importorskip("jax", reason="jax is an optional extra: pip install -e '.[jax]'")
jax.config.update("jax_enable_x64", True)
from symattn.codegen.backends.jax import runtime as jax_runtime  # noqa: E402 (after the skip: it needs jax to run)


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


def test_block_helpers_agree_with_numpy_and_write_nothing_in_place():
    # the blocks of a causal loop: the causal part written into a block of scores, the sums over blocks of key
    # rows, the n × m value placed block by block (zero on the keys a block skipped), as NumPy's helpers make them
    rng = np.random.default_rng(1)
    n, m = 7, 6
    scores = rng.normal(size=(2, 3, 4))
    got = jax_runtime.causal_fill(jax.numpy.asarray(scores), slice(2, 5), slice(0, 4))
    np.testing.assert_array_equal(np.asarray(got), numpy_runtime.causal_fill(scores.copy(), slice(2, 5), slice(0, 4)))
    total, placed, want_total, want_placed = 0, None, 0, None
    for start in range(0, n, 3):
        rows = slice(start, start + 3)
        keys = jax_runtime.key_range(None, True, rows, m)
        assert keys == numpy_runtime.key_range(None, True, rows, m)
        part = rng.normal(size=(2, keys.stop - keys.start, 5))
        total = jax_runtime.add_rows(total, keys, jax.numpy.asarray(part), m)
        want_total = numpy_runtime.add_rows(want_total, keys, part.copy(), m)
        block = rng.normal(size=(2, min(rows.stop, n) - start, keys.stop - keys.start))
        placed = jax_runtime.put_rows(placed, rows, keys, jax.numpy.asarray(block), n, m)
        want_placed = numpy_runtime.put_rows(want_placed, rows, keys, block, n, m)
    np.testing.assert_allclose(np.asarray(total), want_total, rtol=1e-15)
    np.testing.assert_array_equal(np.asarray(jax_runtime.placed_rows(placed)), want_placed)
    # without causal: every key, in one block of every row
    assert jax_runtime.key_range(jax.numpy.zeros((n, m)), False, slice(0, n), m) == slice(0, m)
    assert jax_runtime.rows_per_block(None, False, jax.numpy.zeros((n, 4))) == n


def test_the_mask_by_blocks_leaves_the_causal_part_to_the_loop():
    q, k = jax.numpy.zeros((2, 5, 3)), jax.numpy.zeros((2, 4, 3))
    padding = np.array([[False, False, False, True], [True, False, False, False]])
    whole = jax_runtime._additive_mask(None, padding, True, q, k)
    by_blocks = jax_runtime._additive_mask(None, padding, True, q, k, by_blocks=True)
    assert not np.isneginf(np.asarray(by_blocks)[:, :, 1:3]).any()  # no causal -inf: padding alone
    np.testing.assert_array_equal(np.asarray(jax_runtime.with_causal(by_blocks, True, q, k)), np.asarray(whole))
    assert jax_runtime._additive_mask(None, None, True, q, k, by_blocks=True) is None
