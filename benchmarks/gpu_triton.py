"""The Triton modules in benchmarks/gpu.py (issue 41, item 5): forward + backward time and peak memory of each
variant beside SDPA, FlexAttention (compiled, its block mask for causal, a score_mod for the variant), torch.compile
of the eager math and the eager math; the learned bias's gradient checked bitwise across two runs; the JVP against
``torch.func.jvp`` of the eager math.

Variants (B×H×n×d, per head, d the head width): plain and causal (``attention_triton``), softcap
softmax(50 tanh(s / 50)) V, learned bias softmax(s + B) V (B per batch·head, with its gradient), sigmoid σ(s) V
(no normaliser: FlexAttention cannot express it), s = Q Kᵀ / √d. The variants' Triton modules are rendered here from
their specs (symattn from the checkout). On CUDA: bfloat16 at 4×16×2048×64 (plain and causal also 1×16×8192×64,
Triton and SDPA only).
Under ``--cpu-smoke`` the Triton kernels run under Triton's interpreter at 1×1×32×16 in float32 (bfloat16
products are wrong there) and FlexAttention is left out (it has no backward on the CPU); without
``TRITON_INTERPRET=1`` (set before triton is imported) the section is skipped with the reason printed.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import sympy as sp
import torch

import symattn as sa
from symattn.codegen.generate import render
from symattn.specs import dim

F = torch.nn.functional
SIZES = {"plain": ((4, 16, 2048, 64), (1, 16, 8192, 64)), "variant": ((4, 16, 2048, 64),)}
SMOKE = (1, 1, 32, 16)
CAP = 50.0


def _specs() -> dict[str, sa.Spec]:
    """The variants' cores as specs of Q, K, V per head (and the bias B)."""
    n, m, d = dim("n"), dim("m"), dim("d_k")
    q, k, v, b = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d), sa.matrix("B", n, m)
    s = q * k.T / sp.sqrt(d)
    return {
        "softcap": sa.Spec(
            "bench_softcap", "softmax(50 tanh(s / 50)) V", (q, k, v), sa.softmax(CAP * sa.tanh(s / CAP)) * v
        ),
        "bias": sa.Spec("bench_bias", "softmax(s + B) V", (q, k, v, b), sa.softmax(s + b) * v),
        "sigmoid": sa.Spec("bench_sigmoid", "σ(s) V", (q, k, v), sa.sigmoid(s) * v),
    }


def _loaded(spec: sa.Spec, folder: Path):
    """The spec's Triton module, rendered to folder (triton.jit reads its source) and imported."""
    path = folder / f"{spec.name}_triton.py"
    path.write_text(render(spec, "triton"), encoding="utf-8")
    found = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _math(variant: str) -> Callable:
    """The variant's eager math: (q, k, v, causal, *extra) → output."""

    def run(q, k, v, causal, *extra):
        s = q @ k.mT / math.sqrt(q.shape[-1])
        s = CAP * torch.tanh(s / CAP) if variant == "softcap" else s + extra[0] if variant == "bias" else s
        if causal:
            hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(hidden, 0.0 if variant == "sigmoid" else -math.inf)
        return (torch.sigmoid(s) if variant == "sigmoid" else torch.softmax(s, -1)) @ v

    return run


def _flex(variant: str, compiled: bool) -> Callable | None:
    """FlexAttention for the variant (None where it cannot express it): its score_mod, and the causal block mask."""
    if variant == "sigmoid":
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
    masks = {}

    mods = {}  # one score_mod per bias tensor: a new function at every call would recompile

    def run(q, k, v, causal, *extra):
        score_mod = _softcap if variant == "softcap" else None
        if variant == "bias":
            score_mod = mods.setdefault(id(extra[0]), _bias_mod(extra[0]))
        key = (q.shape[-2], k.shape[-2], q.device)
        if causal and key not in masks:  # made once per shape, outside the timed calls after the first
            masks[key] = create_block_mask(lambda b, h, i, j: j <= i, None, None, *key[:2], device=q.device)
        return attend(q, k, v, score_mod=score_mod, block_mask=masks[key] if causal else None)

    return run


def _softcap(s, b, h, i, j):
    """FlexAttention's score_mod of softcap: s is already Q Kᵀ / √d."""
    return CAP * torch.tanh(s / CAP)


def _bias_mod(bias: torch.Tensor) -> Callable:
    """FlexAttention's score_mod adding the learned bias (B, H, n, m); its gradient by FlexAttention's backward."""

    def score_mod(s, b, h, i, j):
        return s + bias[b, h, i, j]

    return score_mod


def _triton(variant: str, modules: dict) -> Callable:
    if variant in ("plain", "causal"):
        return lambda q, k, v, causal: modules["attention"].forward(q, k, v, causal=causal)
    return lambda q, k, v, causal, *extra: modules[variant].forward(q, k, v, *extra, causal=causal)


def _timed(run: Callable, leaves: list, repeats: int, device: str) -> tuple[float, float | None, list]:
    """Best ms of one forward + backward (a fixed random cotangent), peak MiB above the inputs (CUDA), gradients."""
    out = run(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
    cotangent = cotangent.to(out.dtype)
    grads = torch.autograd.grad(out, [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad], cotangent)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base, best = torch.cuda.memory_allocated() if cuda else 0, float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = run(*leaves)
        torch.autograd.grad(out, [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad], cotangent)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return best * 1e3, peak, grads


def _leaves(variant: str, size: tuple, causal: bool, device: str, dtype: torch.dtype) -> list:
    generator = torch.Generator(device=device).manual_seed(0)
    shape = {"q": size, "b": (*size[:3], size[2])}
    made = [torch.randn(*shape["q"], generator=generator, device=device, dtype=dtype) for _ in range(3)]
    extra = [torch.randn(*shape["b"], generator=generator, device=device, dtype=dtype)] if variant == "bias" else []
    return [x.requires_grad_() for x in made] + [causal] + [x.requires_grad_() for x in extra]


def _cell(run: Callable | None, leaves: list, repeats: int, device: str) -> tuple[str, list | None]:
    if run is None:
        return "—", None
    try:
        ms, mib, grads = _timed(lambda *x: run(*x), leaves, repeats, device)
    except (RuntimeError, torch.OutOfMemoryError, NotImplementedError) as failure:  # one failed run leaves the others
        return f"failed: {str(failure).splitlines()[0][:60]}", None
    return (f"{ms:.2f} ({mib:.0f})" if mib is not None else f"{ms:.2f}"), grads


def variants(device: str, smoke: bool, repeats: int, compiled: bool = True) -> tuple[list[str], list[str]]:
    """(timing rows, JVP rows); rows saying why where the section cannot run. compiled=False (gpu.py's --no-compile):
    no torch.compile of the math (FlexAttention is compiled all the same)."""
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        reason = "skipped: --cpu-smoke without TRITON_INTERPRET=1 (set it before triton is imported)"
        print(f"Triton section {reason}")
        return [reason], [reason]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # one score_mod each
    dtype = torch.float32 if smoke else torch.bfloat16
    folder = Path(tempfile.mkdtemp(prefix="symattn_triton_"))
    modules = {name: _loaded(spec, folder) for name, spec in _specs().items()}
    from generated import attention_triton

    modules["attention"] = attention_triton
    names = ["symattn Triton", "SDPA", "FlexAttention", "compiled math", "eager math"]
    rows = ["| variant | size | " + " | ".join(f"{x} ms (MiB)" for x in names) + " | dB bitwise (Triton, Flex) |"]
    rows.append("|---|---|" + "---|" * (len(names) + 1))
    for variant in ("plain", "causal", "softcap", "bias", "sigmoid"):
        kind = "plain" if variant in ("plain", "causal") else "variant"
        for size in (SMOKE,) if smoke else SIZES[kind]:
            causal = variant == "causal"
            leaves = _leaves(variant, size, causal, device, dtype)
            math_run = _math("plain" if kind == "plain" else variant)
            runs = [
                _triton(variant, modules),
                (lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)) if kind == "plain" else None,
                None if smoke else _flex("plain" if kind == "plain" else variant, True),  # no backward on CPU
                torch.compile(math_run, backend="eager" if smoke else "inductor", dynamic=False) if compiled else None,
                math_run,
            ]
            if size[2] > 4096:  # compiling FlexAttention and the math again at n = 8192 costs the 5 minutes' budget
                runs[2:] = [None, None, None]
            cells, grads = zip(*(_cell(run, leaves, repeats, device) for run in runs))
            bitwise = ""
            if variant == "bias":
                again = [_cell(runs[i], leaves, 1, device)[1] for i in (0, 2)]
                bitwise = ", ".join(
                    "—" if a is None or b is None else str(torch.equal(a[-1], b[-1]))
                    for a, b in zip((grads[0], grads[2]), again)
                )
            rows.append(f"| {variant} | {'×'.join(map(str, size))} | " + " | ".join(cells) + f" | {bitwise} |")
    return rows, _jvp(modules["attention"], device, smoke, repeats)


def _jvp(module, device: str, smoke: bool, repeats: int) -> list[str]:
    """The Triton JVP (output and tangent) against torch.func.jvp of the eager math: ms, and the tangent's error."""
    rows = [
        "| size | mask | Triton jvp ms | torch.func.jvp of the math ms | tangent error ÷ max |",
        "|---|---|---|---|---|",
    ]
    dtype = torch.float32 if smoke else torch.bfloat16
    for causal in (False, True):
        size = SMOKE if smoke else SIZES["plain"][0]
        generator = torch.Generator(device=device).manual_seed(2)
        q, k, v, t = (torch.randn(*size, generator=generator, device=device, dtype=dtype) for _ in range(4))
        ours = lambda q=q, k=k, v=v, t=t, c=causal: module.jvp(q, k, v, {"Q": t}, causal=c)  # noqa: E731
        theirs = lambda q=q, k=k, v=v, t=t, c=causal: torch.func.jvp(  # noqa: E731
            lambda a: _math("plain")(a, k, v, c), (q,), (t,)
        )
        times = []
        for run in (ours, theirs):
            run()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                if device == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - start)
            times.append(best * 1e3)
        got, want = ours()[1].double(), theirs()[1].double()
        error = float((got - want).abs().max() / want.abs().max())
        mask = "causal" if causal else "none"
        rows.append(f"| {'×'.join(map(str, size))} | {mask} | {times[0]:.2f} | {times[1]:.2f} | {error:.1e} |")
    return rows
