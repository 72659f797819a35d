"""Time the generated attention against torch's fused SDPA, causal and not, on one thread (docs/performance.md).

Forward + backward of B × H × n × d attention, float32, best of a few rounds taking turns: torch's
``F.scaled_dot_product_attention`` (ms), then the generated torch, torch memory-efficient and NumPy modules as
a ratio to it (< 1: faster), and the generated torch module's GFLOP/s by the cost model's
12·n²·d + 5·n·d + 7·n² FLOPs per head. A small size, so it runs in seconds; benchmarks/attention_grid.py
is the full grid. ``symattn derive attention --cost`` prints the cost model value by value.

    python examples/performance.py [n]
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread, before NumPy and torch load
import torch
import torch.nn.functional as F
from symattn.generated import attention_numpy, attention_torch, attention_torch_memeff

torch.set_num_threads(1)
B, H, n, d = 1, 4, int(sys.argv[1]) if len(sys.argv) > 1 else 512, 64
q, k, v, g = (torch.randn(B, H, n, d) for _ in range(4))


def torch_step(forward, causal):
    def step():
        args = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(forward(*args, causal), args, g)

    return step


def numpy_step(causal):
    arrays = [t.numpy() for t in (q, k, v)]
    return lambda: attention_numpy.backward(attention_numpy.forward(*arrays, causal=causal)[1], g.numpy())


for causal in (False, True):
    steps = {
        "SDPA": torch_step(lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c), causal),
        "torch": torch_step(lambda q, k, v, c: attention_torch.forward(q, k, v, causal=c), causal),
        "torch memeff": torch_step(lambda q, k, v, c: attention_torch_memeff.forward(q, k, v, causal=c), causal),
        "NumPy": numpy_step(causal),
    }
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(5):  # rounds taking turns, so that load from elsewhere falls on all alike
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    ratios = ", ".join(f"{name} {best[name] / best['SDPA']:.2f}" for name in steps if name != "SDPA")
    gflops = B * H * (12 * n * n * d + 5 * n * d + 7 * n * n) / best["torch"] / 1e9
    print(f"{B}×{H}×{n}×{d} causal={causal}: SDPA {best['SDPA'] * 1e3:.1f} ms; ÷ SDPA: {ratios}")
    if not causal:
        print(f"  generated torch module: {gflops:.1f} GFLOP/s")
