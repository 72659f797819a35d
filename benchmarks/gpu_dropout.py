"""Dropout on the GPU in benchmarks/gpu.py (issue 57): attention with dropout 0.1 on the weights against the same
without, forward + backward, each implementation against itself: the Triton module (the mask drawn in registers by
Philox, ``training=False`` its run without), the generated torch module (the mask drawn whole by torch's generator
and saved; ``training=False``), SDPA (``dropout_p=0.1`` against 0) and the eager math with ``F.dropout``. Issue
57's GPU target: the Triton module's with ÷ without ≤ 1.1, beside SDPA's own ratio. Besides, the kept fraction of
the Triton module's mask over its n·m·B·H draws against 1 − p (within 3σ).

On CUDA bfloat16 at 4×16×2048×64 and causal; under ``--cpu-smoke`` the kernels run under Triton's interpreter at
1×1×32×16 in float32.
"""

from __future__ import annotations

import math
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import sympy as sp
import torch
from gpu_triton import SMOKE, _loaded, _timed

import symattn as sa
from symattn.codegen.generate import render
from symattn.specs import dim

P = 0.1
SIZES = ((4, 16, 2048, 64),)


def _spec() -> sa.Spec:
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    out = sa.dropout(sa.softmax(q * k.T / sp.sqrt(d)), P) * v
    return sa.Spec("bench_dropout", f"attention with dropout {P} on the weights", (q, k, v), out)


def modules() -> dict:
    """The spec's Triton module (rendered to a folder: triton.jit reads its source) and its torch module."""
    spec = _spec()
    made = types.ModuleType("bench_dropout_torch")
    exec(compile(render(spec, "torch", second_order=False), made.__name__, "exec"), made.__dict__)
    return {"triton": _loaded(spec, Path(tempfile.mkdtemp(prefix="symattn_dropout_"))), "torch": made}


def _runs(made: dict, causal: bool) -> dict[str, tuple[Callable, Callable]]:
    """Each implementation's (with dropout, without) forward."""
    F = torch.nn.functional

    def eager(p: float) -> Callable:
        def run(q, k, v):
            scores = q @ k.mT / math.sqrt(q.shape[-1])
            if causal:
                hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
                scores = scores.masked_fill(hidden, -math.inf)
            return F.dropout(torch.softmax(scores, dim=-1), p, True) @ v

        return run

    def module(which: str, training: bool) -> Callable:
        extra = {"causal": causal} if which == "triton" else {}
        if which == "torch" and causal:
            return None
        return lambda q, k, v: made[which].forward(q, k, v, training=training, **extra)

    def sdpa(p: float) -> Callable:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)

    return {
        "symattn Triton (Philox)": (module("triton", True), module("triton", False)),
        "symattn torch (saved mask)": (module("torch", True), module("torch", False)),
        "SDPA dropout_p": (sdpa(P), sdpa(0.0)),
        "eager math, F.dropout": (eager(P), eager(0.0)),
    }


def _keep_rate(made: dict, size: tuple, device: str, dtype: torch.dtype) -> str:
    """The kept fraction of one call's mask (V the identity: O = P ⊙ Z with P uniform over m keys) against 1 − p."""
    batch, heads, n = size
    q = torch.zeros(batch, heads, n, n, device=device, dtype=dtype)  # uniform weights 1/n over n keys
    v = torch.eye(n, device=device, dtype=dtype).expand(batch, heads, n, n)  # O = P ⊙ Z (the spec's V is d = n wide)
    torch.manual_seed(0)  # one seed: the check reads the same draws on every run
    kept = (made["triton"].forward(q, q, v, training=True) != 0).double().mean().item()
    sigma = math.sqrt(P * (1 - P) / (batch * heads * n * n))
    return f"kept {kept:.5f} of {batch * heads * n * n} draws, 1 − p = {1 - P} (|Δ| = {abs(kept - 1 + P) / sigma:.1f}σ)"


def variants(device: str, smoke: bool, repeats: int, made: dict) -> list[str]:
    """The rows: each implementation's ms with and without dropout and their ratio; then the keep rate."""
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = ["| implementation | size | causal | ms with p = 0.1 | ms without | with ÷ without |"]
    rows.append("|---|---|---|---|---|---|")
    for size in (SMOKE,) if smoke else SIZES:
        for causal in (False, True):
            generator = torch.Generator(device=device).manual_seed(0)
            leaves = [torch.randn(*size, generator=generator, device=device, dtype=dtype) for _ in range(3)]
            leaves = [x.requires_grad_() for x in leaves]
            for name, (with_, without) in _runs(made, causal).items():
                if with_ is None:
                    continue
                times = []
                for run in (with_, without):
                    try:
                        times.append(_timed(run, leaves, repeats, device)[0])
                    except (RuntimeError, NotImplementedError) as failure:
                        times.append(f"failed: {str(failure).splitlines()[0][:60]}")
                if all(isinstance(t, float) for t in times):
                    cells = f"{times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.3f}"
                else:
                    cells = " | ".join(t if isinstance(t, str) else f"{t:.2f}" for t in times) + " | —"
                rows.append(f"| {name} | {'×'.join(map(str, size))} | {causal} | {cells} |")
    size = (1, 2, 32) if smoke else (64, 16, 64)  # B, H, n = m = d: 4·2²⁰ draws on the GPU
    return [*rows, "", _keep_rate(made, size, device, dtype)]
