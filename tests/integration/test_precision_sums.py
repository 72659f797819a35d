"""16-bit sums over blocks of rows and products of two dtypes in the generated torch modules (issue 40): a weight's
gradient summed over the blocks of a memory-efficient loop (dW_Q = add_blocks(dW_Q, …)) is the float32 sum of the
parts rounded once, and the runtime chain multiplies a float32 n × m array by a 16-bit factor as narrow_matmul does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from symattn.generated import mha_torch_memeff  # noqa: E402

from symattn.codegen.backends.common_runtime import chain  # noqa: E402


def test_a_16_bit_weight_gradient_over_blocks_is_rounded_once():
    """add_blocks of bfloat16 parts: the float32 sum rounded once (the sum rounded at every block differs); float32
    parts: the plain sum."""
    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(16, 4, generator=generator).to(torch.bfloat16) for _ in range(40)]
    total = 0
    for part in parts:
        total = mha_torch_memeff.add_blocks(total, part)
    exact = sum(p.float() for p in parts)
    assert total.dtype == torch.bfloat16 and torch.equal(total, exact.to(torch.bfloat16))
    rounded = parts[0]
    for part in parts[1:]:
        rounded = rounded + part
    assert not torch.equal(rounded, exact.to(torch.bfloat16))
    wide = [p.float() for p in parts[:3]]
    assert torch.equal(mha_torch_memeff.add_blocks(mha_torch_memeff.add_blocks(0, wide[0]), wide[1]), wide[0] + wide[1])


def test_memeff_mha_in_bfloat16_sums_its_weight_gradients_in_float32():
    """mha's memory-efficient backward in 64 blocks of 4 rows: the bfloat16 dW_Q (the float32 sum over the blocks,
    rounded once) is about as far from float64 as with every row in one block (measured 0.98–1.08×; summed in
    bfloat16, block by block, 2.3–3.1×), over three draws."""
    for seed in range(3):
        blocks, whole = (_error_of_dw_q(size, seed) for size in (4, 256))
        assert blocks <= 1.5 * whole, (seed, blocks, whole)


def _error_of_dw_q(block_size, seed, n=256):
    """max |dW_Q − dW_Q₆₄| / max |dW_Q₆₄| of a bfloat16 run of mha_torch_memeff at block_size."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, 16, generator=generator).to(torch.bfloat16)
    weights = [(torch.randn(16, 16, generator=generator) / 4).to(torch.bfloat16) for _ in range(4)]
    g = torch.randn(1, n, 16, generator=generator).to(torch.bfloat16)

    def grad_w_q(dtype):
        w_q = weights[0].to(dtype).requires_grad_()
        rest = [w.to(dtype) for w in weights[1:]]
        out = mha_torch_memeff.forward(*(x.to(dtype),) * 3, w_q, *rest, num_heads=2, block_size=block_size)
        return torch.autograd.grad(out, w_q, g.to(dtype))[0]

    low, exact = grad_w_q(torch.bfloat16), grad_w_q(torch.float64)
    assert low.dtype == torch.bfloat16
    return float((low.double() - exact).abs().max() / exact.abs().max())


def test_the_runtime_chain_rounds_a_wide_factor_to_the_narrow_one():
    """chain(P, V, W) of a float32 P and bfloat16 V, W: P rounded to bfloat16 once, the product bfloat16 (torch
    multiplies no two dtypes); NumPy factors of one dtype as before."""
    generator = torch.Generator().manual_seed(1)
    p = torch.randn(12, 12, generator=generator)
    v, w = (torch.randn(12, 12, generator=generator).to(torch.bfloat16) for _ in range(2))
    got = chain(p, v, w)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, chain(p.to(torch.bfloat16), v, w))
    a, b = np.ones((3, 4)), np.ones((4, 2))
    assert np.array_equal(chain(a, b), a @ b)
