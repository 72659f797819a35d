"""The Triton kernels' own checks in benchmarks/gpu.py (issue 41): right on the device before they are timed, and
the launch settings they are timed at.

1. ``sweep``: ``attention_triton``'s forward + backward in bfloat16 at 4×16×2048×64, causal and not, for each
   launch setting (BLOCK_M, BLOCK_N, warps, stages) set on the forward and both backward parts (then launched as
   one): each kernel's device time (torch.profiler; the backward's: both parts' launches), the step's wall time.
   The module's own setting is the first row (its backward parts apart, each its own). Each kernel's setting of
   least time is chosen (the backward's for both parts, or the module's own pair), and every Triton module of the
   run launches at it from then on (the module's LAUNCH table; the sections after it measure the chosen settings,
   and LAUNCH's defaults are read from its rows).
2. ``correctness``: every variant of ``benchmarks/gpu_triton.py`` (bfloat16; plain and causal also float16 and
   float32) at 2×3×304×64 (304 rows: a partial last block) and plain attention with wide heads (d = 128, 256: the
   smaller blocks of the shared-memory rule), the worst error of output and gradients against float64 eager math on
   the same rounded inputs, the eager math's own error in that dtype beside it; and ``mha_triton`` against
   ``mha_torch`` (grouped heads, a key padding mask, causal) in float32.
3. ``profile``: where one forward + backward of ``attention_triton`` spends its time, by kernel.
4. ``host``: the host's time per forward + backward call of ``attention_triton`` and SDPA, the device kept busy so
   that every launch queues (its Python and torch ops alone, the kernels' launches stubbed; the Triton launchers
   are the difference), the synchronised step, and the step replayed as a CUDA graph (no host work per call: the
   kernels' own time).

Under ``--cpu-smoke`` both run under Triton's interpreter at tiny sizes (float32 and float16; the interpreter's
bfloat16 products are wrong), the sweep over two settings (the interpreter's blocks are its own: nothing is chosen).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path

import gpu_triton as TRITON  # benchmarks/gpu.py imports both first, by these names
import precision
import torch

EXTRA = ("plain", "causal")  # also float16 and float32
SETTINGS = (  # BLOCK_M, BLOCK_N, warps, stages: Triton's tutorial's and FlashAttention-2's launches for d = 64
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (64, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (32, 128, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
)  # no num_stages = 4: with triton 3.6 on an H200 the sweep did not get past its first such setting (GPU.md)
GENERATED = Path(__file__).resolve().parents[1] / "generated"
CHOSEN: dict = {}  # each kernel's setting chosen by the sweep (on CUDA): every Triton module of the run launches at it
SWEPT = ("forward", "backward")  # the kernels timed (the JVP kernel keeps its own: its target met at 64 × 64)
LAUNCHED = {"forward": ("forward",), "backward": ("backward_keys", "backward_queries")}  # their LAUNCH rows


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


def _operands(device: str, smoke: bool) -> tuple[list, torch.Tensor]:
    """attention_triton's Q, K, V (requiring grad) and a cotangent of O, seeded: bfloat16 4×16×2048×64 on CUDA,
    float32 1×1×32×16 under --cpu-smoke (two query blocks of the interpreter's 16)."""
    size, dtype = ((1, 1, 32, 16), torch.float32) if smoke else ((4, 16, 2048, 64), torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(*size, generator=generator, device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    return leaves, torch.randn(*size, generator=generator, device=device, dtype=dtype)


def _labelled(kernel, label: str):
    """The kernel, each launch inside torch.profiler.record_function(label): under the interpreter its CPU time
    under that label (on CUDA the profiler names each kernel's own device time by it)."""

    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with torch.profiler.record_function(label):
                    return kernel[grid](*args, **kwargs)

            return launch

    return Launch()


def _kernel_us(module, leaves: list, cotangent: torch.Tensor, device: str, steps: int) -> dict[tuple, float]:
    """{(kernel, causal): µs per call} of the module's forward + backward over steps calls, each kernel's device time
    by torch.profiler (its CPU time under the interpreter), and {("step", causal): ms}, the step's best wall time of
    steps + 2 calls (CUDA synchronised), after one call (compiles) timed as ("compile", causal): s."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    spent = {}
    for causal in (False, True):

        def step(causal=causal):
            torch.autograd.grad(module.forward(*leaves, causal=causal), leaves, cotangent)

        began = time.perf_counter()
        step()
        spent["compile", causal] = time.perf_counter() - began
        spent["step", causal] = TRITON.best_ms(step, steps + 2, device)
        with torch.profiler.profile(activities=activities) as run:
            for _ in range(steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
        for e in run.key_averages():
            kernel = e.key.removeprefix("_").removesuffix("_kernel")
            if kernel in SWEPT and e.key == f"_{kernel}_kernel":
                total = e.device_time_total if device == "cuda" else e.cpu_time_total
                spent[kernel, causal] = total / steps
    return spent


def sweep(device: str, smoke: bool, budget: float) -> list[str]:
    """Rows: each launch setting of SETTINGS set on the forward and backward kernels of attention_triton (no
    setting begun after budget seconds), its compile time, forward + backward wall time and each kernel's device µs
    (no mask / causal); then each kernel's setting of least time (no mask + causal), which every Triton module of
    this run launches at from here on (CHOSEN; on CUDA: the interpreter's blocks are its own). Each row is printed as
    it is measured."""
    from generated import attention_triton as module

    leaves, cotangent = _operands(device, smoke)
    own = {row: module.LAUNCH[row] for kernel in SWEPT for row in LAUNCHED[kernel]}
    kernels = {f"_{kernel}_kernel": getattr(module, f"_{kernel}_kernel") for kernel in SWEPT}
    settings = [None, *(SETTINGS[:1] if smoke else SETTINGS)]
    columns = ["compile s", "step ms", *(f"{k} µs" for k in SWEPT)]
    rows = ["| BLOCK_M × BLOCK_N, warps, stages | " + " | ".join(columns) + " |", "|---" * (1 + len(columns)) + "|"]
    times, began = {}, time.perf_counter()
    try:
        for name, kernel in kernels.items():
            if device != "cuda":
                setattr(module, name, _labelled(kernel, name))
        for setting in settings:
            named = "the module's own" if setting is None else "{} × {}, {}, {}".format(*setting)
            if time.perf_counter() - began > budget:
                rows.append(f"| {named} | not tried: the sweep's {budget:.0f} s were spent |")
                continue
            module.LAUNCH.update(own if setting is None else dict.fromkeys(own, setting))
            module._PLANS.clear()  # the launches planned again at this setting (a plan is made once per shape)
            try:
                spent = _kernel_us(module, leaves, cotangent, device, 1 if smoke else 3)
            except Exception as failure:  # a setting that does not launch is reported, the others run
                rows.append(f"| {named} | failed: {type(failure).__name__}: {str(failure).splitlines()[0][:80]} |")
                print(rows[-1], flush=True)
                continue
            for kernel in SWEPT:
                times.setdefault(kernel, []).append((spent[kernel, False] + spent[kernel, True], setting))
            cells = [f"{spent[k, False]:.1f} / {spent[k, True]:.1f}" for k in ("compile",)]
            cells += [f"{spent[k, False]:.3f} / {spent[k, True]:.3f}" for k in ("step",)]
            cells += [f"{spent[k, False]:.1f} / {spent[k, True]:.1f}" for k in SWEPT]
            rows.append(f"| {named} | " + " | ".join(cells) + " |")
            print(rows[-1], f"({time.perf_counter() - began:.0f} s)", flush=True)
    finally:
        module.LAUNCH.update(own)
        module._PLANS.clear()
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    best = {k: min(spent, key=lambda pair: pair[0])[1] for k, spent in times.items()}
    chosen = {row: own[row] if setting is None else setting for k, setting in best.items() for row in LAUNCHED[k]}
    if device == "cuda":
        CHOSEN.update(chosen)
        chose({})
    used = "every Triton module launches at it from here on" if device == "cuda" else "the interpreter's blocks stay"
    return rows + ["", f"Chosen (least time, no mask + causal): {chosen}; {used}."]


def chose(modules: dict) -> None:
    """The modules given and every Triton module of generated/ (imported here: the torch modules route to them)
    launch each kernel at CHOSEN's setting (none chosen yet: their own)."""
    built = [importlib.import_module(f"generated.{path.stem}") for path in GENERATED.glob("*_triton.py")]
    for module in [*modules.values(), *built]:
        module.LAUNCH.update(CHOSEN)
        module._PLANS.clear()  # the launches planned again at CHOSEN's settings


def profile(device: str, smoke: bool) -> list[str]:
    """Rows: where one forward + backward of attention_triton spends its time (torch.profiler, the device's time per
    call of each kernel and op, and the host's wall time per step), causal and not."""
    from generated import attention_triton as module

    leaves, cotangent = _operands(device, smoke)
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


def host(device: str, smoke: bool) -> list[str]:
    """Rows: attention_triton and SDPA, no mask and causal: the host's µs in the forward call and in the backward
    call (CUDA kept busy by a sleep kernel queued first, so the calls' time is the host's alone), the same with
    attention_triton's launches stubbed, the synchronised step's ms, and the step's ms as a CUDA graph
    (torch.cuda.make_graphed_callables: its forward and backward replayed, no host work per call)."""
    from generated import attention_triton as module

    leaves, cotangent = _operands(device, smoke)
    repeats = 1 if smoke else 20
    columns = "host µs: forward / backward | launches stubbed | step ms | step ms, CUDA graph"
    rows = [f"| call | mask | {columns} |", "|---|---|---|---|---|---|"]
    for name, attend in (
        ("attention_triton", module.forward),
        ("SDPA", torch.nn.functional.scaled_dot_product_attention),
    ):
        for causal in (False, True):

            def call(q, k, v, attend=attend, causal=causal):
                return (
                    attend(q, k, v, is_causal=causal)
                    if attend is not module.forward
                    else attend(q, k, v, causal=causal)
                )

            stubbed = max(repeats, 200)  # stubbed calls cost µs: enough of them for a best that is not noise
            cells = [_host_us(call, leaves, cotangent, device, stubbed if name == "SDPA" else repeats)]  # (SDPA: µs)
            cells.append(_stubbed(module, call, leaves, cotangent, device, stubbed) if name != "SDPA" else "")
            cells.append(f"{TRITON.best_ms(lambda: _step(call, leaves, cotangent), repeats, device):.3f}")
            cells.append(_graphed_ms(call, leaves, cotangent, repeats) if device == "cuda" else "CUDA only")
            rows.append(f"| {name} | {'causal' if causal else 'none'} | " + " | ".join(cells) + " |")
    return rows


def _step(call: Callable, leaves: list, cotangent: torch.Tensor) -> None:
    torch.autograd.grad(call(*leaves), leaves, cotangent)


def _host_us(call: Callable, leaves: list, cotangent: torch.Tensor, device: str, repeats: int) -> str:
    """ "forward / backward": the best host µs of each call over repeats steps, the device busy before them."""
    _step(call, leaves, cotangent)
    best = [float("inf")] * 2
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # about 10 ms of device work: the step's launches queue behind it
        began = time.perf_counter()
        out = call(*leaves)
        middle = time.perf_counter()
        torch.autograd.grad(out, leaves, cotangent)
        ended = time.perf_counter()
        best = [min(best[0], middle - began), min(best[1], ended - middle)]
    if device == "cuda":
        torch.cuda.synchronize()
    return f"{best[0] * 1e6:.0f} / {best[1] * 1e6:.0f}"


def _stubbed(module, call: Callable, leaves: list, cotangent: torch.Tensor, device: str, repeats: int) -> str:
    """_host_us with each of the module's kernels launching nothing: its Python and torch ops alone. A stubbed
    kernel's JIT launch returns a stand-in compiled kernel whose launcher does nothing, so the plans (made again
    under the stubs) launch it directly after the first call, as they launch a compiled kernel on CUDA: the Python
    measured is the CUDA path's (less the current device's stream, read there by two C calls)."""

    class Compiled:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    class Stub:
        def __init__(self, kernel):
            self.arg_names = kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled()

    kernels = {name: getattr(module, name) for name in dir(module) if name.endswith("_kernel")}
    plans = dict(module._PLANS)
    try:
        module._PLANS.clear()
        for name, kernel in kernels.items():
            setattr(module, name, Stub(kernel))
        return _host_us(call, leaves, cotangent, device, repeats)
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
        module._PLANS.clear()
        module._PLANS.update(plans)


def _graphed_ms(call: Callable, leaves: list, cotangent: torch.Tensor, repeats: int) -> str:
    """The best ms of a step whose forward and backward replay CUDA graphs (torch.cuda.make_graphed_callables)."""
    try:
        graphed = torch.cuda.make_graphed_callables(call, tuple(leaves))
        return f"{TRITON.best_ms(lambda: _step(graphed, leaves, cotangent), repeats, 'cuda'):.3f}"
    except Exception as failure:  # a call that cannot be captured is reported, the others run
        return f"failed: {type(failure).__name__}: {str(failure).splitlines()[0][:80]}"
