"""float16 in the generated NumPy modules as in the torch and JAX ones (issue 40, item 2): the n × m scores and dP
products are float32 (of the factors widened), P, dS and the row statistics (L, D = rowsum(dO ⊙ O)) stay float32,
every product accumulates in float32, dK and dV are summed over blocks of rows in float32, and the results are
rounded to float16 once; float32 and float64 runs are computed as before. The modules are rendered from the current
printers and runtimes (benchmarks/precision.py, whose figures these are at small sizes)."""

from __future__ import annotations

import importlib
import runpy
from pathlib import Path

import numpy as np
import pytest

from symattn.numeric import low_precision

torch = pytest.importorskip("torch")

BENCHMARK = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "precision.py"))
MODULES = {variant: BENCHMARK["load"]("attention", variant, backend="numpy") for variant in ("standard", "memeff")}


@pytest.mark.parametrize("variant", ["standard", "memeff"])
def test_numpy_float16_is_as_accurate_as_sdpa(variant):
    """The worst error of output and gradients against float64 on the same rounded inputs, at most SDPA's float16
    error (measured 0.41–0.79× SDPA's at this size; the modules before this change, computing in float16,
    0.91–4.07×), with and without a causal mask, over three draws, and for the memory-efficient module in blocks of 32
    rows (dK, dV summed over four blocks)."""
    module = MODULES[variant]
    for causal in (False, True):
        for seed in range(3):
            found = BENCHMARK["numpy_case"](module, (2, 2, 96, 16), causal, seed)
            assert found["ours"] <= 1.0 * found["sdpa"], (causal, seed, found)
        if variant == "memeff":
            found = BENCHMARK["numpy_case"](module, (1, 2, 128, 16), causal, 7, block_size=32)
            assert found["ours"] <= 1.0 * found["sdpa"], (causal, found)


@pytest.mark.parametrize("variant", ["standard", "memeff"])
def test_numpy_float16_runs_return_float16(variant):
    """Output, gradients (a float attn_mask's too), hvp and jvp of a float16 run of the modules in generated/ are
    float16: no float32 array inside leaks out."""
    module = importlib.import_module("symattn.generated.attention_numpy" + ("_memeff" if variant == "memeff" else ""))
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 2, 80, 8)).astype(np.float16) for _ in range(4))
    mask = (rng.standard_normal((80, 80)) / 4).astype(np.float16)
    options = {"block_size": 32} if variant == "memeff" else {}
    out, saved = module.forward(q, k, v, attn_mask=mask, causal=True, **options)
    grads = module.backward(saved, g)
    hvp = module.hvp(q, k, v, g, {"Q": q, "V": v}, causal=True)
    primal, tangent = module.jvp(q, k, v, {"K": k}, causal=True)
    values = [out, *grads.values(), *hvp.values(), primal, tangent]
    assert all(x.dtype == np.float16 and np.isfinite(x).all() for x in values)
    assert set(grads) == ({"Q", "K", "V", "attn_mask"} if variant == "standard" else {"Q", "K", "V"})


def test_the_precision_helpers_leave_wider_runs_as_they_were():
    """Of float32 (and float64) arrays the helpers are exactly the plain NumPy they replace: a @ b, aᵀ b,
    rowsum(a ⊙ b) by vecdot, total += part, the sums; of float16 ones the products and sums are float32 (the float32
    product rounded once by narrow_matmul), and _in_run_dtype rounds a float16 run's results only."""
    rng = np.random.default_rng(1)
    a, b, c = rng.standard_normal((3, 40, 24), dtype=np.float32), rng.standard_normal((3, 24, 8)), None
    b = b.astype(np.float32)
    c = rng.standard_normal((3, 40, 8)).astype(np.float32)
    assert np.array_equal(low_precision.wide_matmul(a, b), a @ b)
    assert np.array_equal(low_precision.narrow_matmul(a, b), a @ b)
    assert np.array_equal(low_precision.matmul_tn(a, c), a.mT @ c)
    assert np.array_equal(low_precision.row_dot(a, a), np.vecdot(a, a)[..., None])
    assert np.array_equal(low_precision.wide_sum(a, 0), a.sum(axis=0))
    total = low_precision.add_blocks(low_precision.add_blocks(0, a), a)
    assert total.dtype == np.float32 and np.array_equal(total, a + a)
    low = a.astype(np.float16)
    assert low_precision.wide_matmul(low, b.astype(np.float16)).dtype == np.float32
    assert low_precision.matmul_tn(low, c.astype(np.float16)).dtype == np.float32
    assert low_precision.row_dot(low, low).dtype == np.float32
    narrow = low_precision.narrow_matmul(a, b.astype(np.float16))  # a float32 n × m factor beside a float16 one
    assert narrow.dtype == np.float16 and np.array_equal(
        narrow, (a @ b.astype(np.float16).astype(np.float32)).astype(np.float16)
    )
    column = np.ones((4096, 1), dtype=np.float16)  # 4096 ones summed in float16 stop at 2048
    assert low_precision.wide_sum(column, 0)[0] == 4096 and low_precision.add_blocks(0, low).dtype == np.float32

    @low_precision._in_run_dtype
    def results(x, y):
        """A docstring."""
        return {"x": x.astype(np.float32), "y": None}, (y.astype(np.float32),)

    assert results.__doc__ == "A docstring." and results.__name__ == "results"
    assert results(low, low)[0]["x"].dtype == np.float16 and results(low, low)[1][0].dtype == np.float16
    assert results(a, low)[0]["x"] is not None and results(a, a)[0]["x"].dtype == np.float32
