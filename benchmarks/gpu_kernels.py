"""The Triton kernels' own checks in benchmarks/gpu.py (issue 41): right on the device before they are timed, and
the launch settings they are timed at.

1. ``correctness``: every variant of ``benchmarks/gpu_triton.py`` (bfloat16; plain and causal also float16 and
   float32) at 2×3×304×64 (304 rows: a partial last block of 64) and plain attention with wide
   heads (d = 128, 256: the smaller blocks of the shared-memory rule), the worst error of output and gradients
   against float64 eager math on the same rounded inputs, the eager math's own error in that dtype beside it; and
   ``mha_triton`` against ``mha_torch`` (grouped heads, a key padding mask, causal) in float32.
2. ``sweep``: forward, and forward + backward, of ``attention_triton`` in bfloat16 at 4×16×2048×64, causal and not,
   for each launch setting (BLOCK_M, BLOCK_N, warps, stages) set on every kernel; the backward's time is the
   difference. The module's own setting is the first row.

Under ``--cpu-smoke`` both run under Triton's interpreter at tiny sizes (float32 and float16; the interpreter's
bfloat16 products are wrong), the sweep over two settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gpu_triton as TRITON  # benchmarks/gpu.py imports both first, by these names
import precision
import torch

EXTRA = ("plain", "causal")  # also float16 and float32
SETTINGS = (  # BLOCK_M, BLOCK_N, warps, stages; None: the module's own
    None,
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (64, 32, 4, 3),
    (128, 32, 4, 3),
    (128, 64, 8, 2),
    (128, 128, 8, 3),
)
KERNELS = ("_forward_kernel", "_delta_kernel", "_key_kernel", "_query_kernel", "_jvp_kernel")


def _values(run: Callable, leaves: list, cotangent: torch.Tensor) -> list:
    """The output and the gradients of the leaves that need one, for the given cotangent."""
    out = run(*leaves)
    wanted = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, wanted, cotangent.to(out.dtype))]


def _widened(leaves: list) -> list:
    """The same values in float64 (a float32 λ too), leaves again where they were."""
    return [x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]


def correctness(device: str, smoke: bool, modules: dict) -> list[str]:
    """Rows: variant, size, dtype, the Triton module's error, the eager math's in the same dtype, their ratio."""
    rows = ["| variant | size | dtype | Triton error | eager math's error | ÷ eager |", "|---|---|---|---|---|---|"]
    size = (1, 2, 40, 16) if smoke else (2, 3, 304, 64)
    cases = [(v, size, torch.bfloat16) for v in TRITON.VARIANTS if not smoke]
    cases += [(v, size, dtype) for v in EXTRA for dtype in (torch.float16, torch.float32)]
    cases += [("plain", (1, 2, 40 if smoke else 304, width), torch.float32) for width in (128, 256)]
    for variant, at, dtype in cases:
        causal = variant == "causal"
        try:
            leaves = TRITON._leaves(variant, at, causal, device, dtype)
            cotangent = torch.randn(
                at[:3] + ((at[2],) if variant == "pointer" else at[3:]),
                generator=torch.Generator(device=device).manual_seed(3),
                device=device,
            ).to(dtype)
            math_run = TRITON._math("plain" if causal else variant)
            want = _values(math_run, _widened(leaves), cotangent.double())
            ours = precision.error(_values(TRITON._triton(variant, modules), leaves, cotangent), want)
            eager = precision.error(_values(math_run, leaves, cotangent), want)
            cells = f"{ours:.2e} | {eager:.2e} | {ours / eager:.2f}"
        except Exception as failure:  # a failing case is reported, the others run
            cells = f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:80]} | | "
        rows.append(f"| {variant} | {'×'.join(map(str, at))} | {str(dtype).removeprefix('torch.')} | {cells} |")
    return rows + _builtin(device, smoke)


def _builtin(device: str, smoke: bool) -> list[str]:
    """mha_triton against mha_torch, float32: 8 query heads on 2 key/value heads, a key padding mask, causal."""
    from generated import mha_torch, mha_triton

    generator = torch.Generator(device=device).manual_seed(4)
    n, width, heads, groups = (24, 32, 4, 2) if smoke else (200, 512, 8, 2)
    kv = width // heads * groups

    def made(*shape):
        return torch.randn(*shape, generator=generator, device=device).div(shape[-2] ** 0.5 if len(shape) == 2 else 1)

    x = made(2, n, width)
    weights = [made(width, width), made(width, kv), made(width, kv), made(width, width)]
    biases = [made(1, width), made(1, kv), made(1, kv), made(1, width)]
    leaves = [t.requires_grad_(t is not biases[1]) for t in (x, *weights, *biases)]  # b_K's gradient is 0: noise
    padding = torch.zeros(2, n, dtype=torch.bool, device=device)
    padding[1, -n // 3 :] = True
    cotangent = made(2, n, width)
    got = []
    for module in (mha_triton, mha_torch):

        def run(x, *rest, module=module):
            w, b = rest[:4], rest[4:]
            return module.forward(
                x, x, x, *w, *b, num_heads=heads, num_kv_heads=groups, key_padding_mask=padding, causal=True
            )

        got.append(_values(run, leaves, cotangent))
    gap = precision.error(got[0], [w.double() for w in got[1]])
    return [
        f"| mha_triton ÷ mha_torch (GQA {heads}/{groups}, padding, causal) | 2×{n}×{width} | float32 | {gap:.2e} | | |"
    ]


def _launched(kernel, warps: int, stages: int):
    """The kernel, launched with num_warps and num_stages set."""

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernel[grid](*args, **kwargs, num_warps=warps, num_stages=stages)

    return Launch()


def _set(module, setting) -> Callable[[], None]:
    """Every kernel of the module launched at the setting; returns the function that puts the module's own back."""
    kept = {name: getattr(module, name) for name in ("_blocks", *KERNELS) if hasattr(module, name)}
    if setting is not None:
        block_m, block_n, warps, stages = setting
        module._blocks = lambda x, width: (block_m, block_n)
        for name in KERNELS:
            if name in kept:
                setattr(module, name, _launched(kept[name], warps, stages))
    return lambda: [setattr(module, name, value) for name, value in kept.items()]


def sweep(device: str, smoke: bool, repeats: int) -> list[str]:
    """Rows: setting, then forward and backward ms, causal and not, of attention_triton at each launch setting."""
    from generated import attention_triton as module

    size, dtype = ((1, 2, 64, 16), torch.float32) if smoke else ((4, 16, 2048, 64), torch.bfloat16)
    settings = SETTINGS[:2] if smoke else SETTINGS
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(*size, generator=generator, device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    cotangent = torch.randn(*size, generator=generator, device=device, dtype=dtype)
    rows = [
        "| BLOCK_M × BLOCK_N, warps, stages | forward ms | backward ms | causal forward ms | causal backward ms |",
        "|---|---|---|---|---|",
    ]
    for setting in settings:
        name = "the module's own" if setting is None else f"{setting[0]} × {setting[1]}, {setting[2]}, {setting[3]}"
        restore = _set(module, setting)
        cells = []
        try:
            for causal in (False, True):

                def step(causal=causal):
                    return module.forward(*leaves, causal=causal)

                with torch.no_grad():
                    forward = TRITON.best_ms(step, repeats, device)
                both = TRITON.best_ms(lambda step=step: torch.autograd.grad(step(), leaves, cotangent), repeats, device)
                cells += [f"{forward:.3f}", f"{both - forward:.3f}"]
        except Exception as failure:  # a setting that does not launch is reported, the others run
            cells = [f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:60]}"]
        finally:
            restore()
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def profile(device: str, smoke: bool) -> list[str]:
    """Rows: where one forward + backward of attention_triton spends its time (torch.profiler, the device's time per
    call of each kernel and op, and the host's wall time per step), causal and not."""
    from generated import attention_triton as module

    size, dtype = ((1, 2, 64, 16), torch.float32) if smoke else ((4, 16, 2048, 64), torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(*size, generator=generator, device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    cotangent = torch.randn(*size, generator=generator, device=device, dtype=dtype)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rows = ["| mask | kernel or op | calls per step | device µs per step |", "|---|---|---|---|"]
    steps = 3
    for causal in (False, True):

        def step(causal=causal):
            torch.autograd.grad(module.forward(*leaves, causal=causal), leaves, cotangent)

        step()
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as run:
            began = time.perf_counter()
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - began) / steps
        events = [e for e in run.key_averages() if getattr(e, "device_time_total", 0) > 0 or device != "cuda"]
        events.sort(key=lambda e: -(getattr(e, "device_time_total", 0) or e.cpu_time_total))
        mask = "causal" if causal else "none"
        for e in events[:10]:
            spent = getattr(e, "device_time_total", 0) if device == "cuda" else e.self_cpu_time_total
            rows.append(f"| {mask} | {e.key[:70]} | {e.count / steps:g} | {spent / steps:.1f} |")
        rows.append(f"| {mask} | one step's wall time (profiled) | | {wall * 1e6:.1f} |")
    return rows
