"""The GPU check in one command (issues 40 and 41): the Triton kernels first, then the torch modules.

With CUDA (``python benchmarks/gpu.py``, a few minutes on one GPU), on ``cuda``, in this order (the file is
written after each section, so a run stopped at a time limit keeps what it did):

1. the Triton kernels' launch settings (``benchmarks/gpu_kernels.py``): each kernel of ``attention_triton`` timed
   at every setting (BLOCK_M, BLOCK_N, warps, stages), each kernel's fastest chosen for every Triton module of the
   run; then, at the chosen settings, every variant's output and gradients against float64 beside the eager math's
   error, and ``mha_triton`` against ``mha_torch``;
2. the Triton modules (``benchmarks/gpu_triton.py``): plain, causal, softcap, ALiBi, learned bias (its gradient
   bitwise across two runs), sigmoid, softplus-normalised, differential and pointer attention beside SDPA,
   FlexAttention, torch.compile and eager math, with the Triton time (memory) ÷ its peer's (FlexAttention, or SDPA's
   plain attention for the variants FlexAttention cannot express);
3. positions (``benchmarks/gpu_positions.py``): a sliding window, a prefix-LM mask and a distance bias written as
   ``sa.entries``, the Triton kernels beside FlexAttention's block masks, SDPA's dense mask and the eager math;
   dropout 0.1 on the weights (``benchmarks/gpu_dropout.py``): the Triton kernels' Philox mask, the torch module's
   saved mask, SDPA's ``dropout_p`` and the eager math, each with ÷ without, and the kernels' keep rate;
   a torch.profiler breakdown of ``attention_triton``'s forward + backward by kernel (``gpu_kernels.py``); then
   every variant's JVP against ``torch.func.jvp`` of the math;
4. precision: the torch entry points ``attention_torch`` and ``attention_torch_memeff`` (with and without a
   causal mask), ``mha_torch`` and ``mha_torch_memeff`` in float32, bfloat16 and float16: the worst error of output
   and gradients against float64 on the same rounded inputs, SDPA's beside it (``benchmarks/precision.py``);
5. autocast: the same modules and the drop-in ``MultiheadAttention`` under ``torch.autocast`` with float32 leaves
   (bfloat16 and float16): the output's and gradients' dtypes as SDPA's, the errors beside SDPA's;
6. drop-ins: ``mha_torch.MultiheadAttention`` and ``transformer_block_torch.TransformerEncoderLayer`` against
   torch's modules with the same state dict (float32: output and parameter gradients), and the generated JVP
   against ``torch.func.jvp`` of the math forward;
7. time and memory of one forward + backward (bfloat16, a random output cotangent) at 4×16×2048×64, 1×16×8192×64
   and 8×16×1024×128, causal and not: the standard and memory-efficient modules beside SDPA, eager math and
   ``torch.compile`` of the math; best of ``--repeats`` (CUDA synchronised), peak memory above the inputs.

It writes the tables to ``benchmarks/GPU.md`` (``--out``). Without CUDA, ``--cpu-smoke`` runs the same code on the
CPU at tiny sizes (torch.compile with its eager backend), so that the script itself is tested anywhere.

    python benchmarks/gpu.py [--repeats 10] [--no-compile] [--only Triton,Precision] [--out benchmarks/GPU.md]
    python benchmarks/gpu.py --cpu-smoke --out /tmp/GPU.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout that was never installed (the GPU machine): symattn and generated/ from it
from generated import (  # noqa: E402
    attention_torch,
    attention_torch_memeff,
    mha_torch,
    mha_torch_memeff,
    transformer_block_torch,
)

F = torch.nn.functional
HERE = Path(__file__).resolve().parent


def _imported(name: str):
    """benchmarks/<name>.py imported as the module <name> (not runpy's: dynamo imports a traced function's module)."""
    found = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


PRECISION = _imported("precision")  # its cases, run and error
TRITON = _imported("gpu_triton")  # the Triton modules' sections (issue 41, item 5)
KERNELS = _imported("gpu_kernels")  # the Triton kernels' correctness and launch settings
POSITIONS = _imported("gpu_positions")  # positions in the Triton kernels beside FlexAttention (issue 52)
DROPOUT = _imported("gpu_dropout")  # dropout in the Triton kernels beside SDPA's dropout_p (issue 57)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = {"standard": attention_torch, "memeff": attention_torch_memeff}
MHA = {"standard": mha_torch, "memeff": mha_torch_memeff}
SIZES = ((4, 16, 2048, 64), (1, 16, 8192, 64), (8, 16, 1024, 128))  # B, H, n, d
SMOKE_SIZES = ((1, 2, 64, 16),)


def precision(device: str, smoke: bool) -> list[str]:
    """Rows: module, variant, mask, dtype, ours' error, SDPA's, their ratio."""
    shape, size = ((1, 2, 32, 8), (1, 16, 32, 4)) if smoke else ((2, 4, 256, 64), (2, 128, 256, 4))
    rows = ["| module | variant | mask | dtype | error | SDPA's error | ÷ SDPA |", "|---|---|---|---|---|---|---|"]
    for spec, modules, case, at in (
        ("attention", ATTENTION, PRECISION.attention_case, shape),
        ("mha", MHA, PRECISION.mha_case, size),
    ):
        for variant, module in modules.items():
            for causal in (False, True):
                for name, dtype in DTYPES.items():
                    found = case(module, at, causal, dtype, device=device)
                    rows.append(
                        f"| {spec} | {variant} | {'causal' if causal else 'none'} | {name} | {found['ours']:.2e} "
                        f"| {found['sdpa']:.2e} | {found['ours'] / found['sdpa']:.2f} |"
                    )
    return rows


def autocast(device: str, smoke: bool) -> list[str]:
    """Rows: entry point, autocast dtype, output and gradient dtypes (ours, SDPA's), errors against float64."""
    shape = (1, 2, 32, 8) if smoke else (2, 4, 256, 64)
    generator = torch.Generator().manual_seed(0)
    *leaves, cotangent = (torch.randn(*shape, generator=generator).to(device) for _ in range(4))
    reference = PRECISION.run(F.scaled_dot_product_attention, [x.double() for x in leaves], cotangent.double())
    rows = [
        "| entry point | autocast | output, gradients | SDPA's | error | SDPA's error |",
        "|---|---|---|---|---|---|",
    ]
    for low in ("bf16", "fp16"):
        with torch.autocast(device, dtype=DTYPES[low]):
            sdpa = PRECISION.run(F.scaled_dot_product_attention, leaves, cotangent)
        for name, function in (
            ("attention_torch.forward", attention_torch.forward),
            ("attention_torch_memeff.forward", attention_torch_memeff.forward),
        ):
            with torch.autocast(device, dtype=DTYPES[low]):
                ours = PRECISION.run(function, leaves, cotangent)
            rows.append(
                f"| {name} | {low} | {_dtypes(ours)} | {_dtypes(sdpa)} | {PRECISION.error(ours, reference):.2e} "
                f"| {PRECISION.error(sdpa, reference):.2e} |"
            )
        rows.append(f"| mha_torch.MultiheadAttention (AMP step) | {low} | {_amp_step(device, DTYPES[low])} | | | |")
    return rows


def _dtypes(values: list[torch.Tensor]) -> str:
    return ", ".join(str(v.dtype).removeprefix("torch.") for v in values)


def _amp_step(device: str, dtype: torch.dtype) -> str:
    """One AMP training step of the drop-in (GradScaler for float16): the output's dtype and the parameters' state."""
    torch.manual_seed(0)
    model = mha_torch.MultiheadAttention(32, 4, batch_first=True, device=device)
    x = torch.randn(2, 16, 32, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    with torch.autocast(device, dtype=dtype):
        out, _ = model(x, x, x, need_weights=False)
        loss = out.float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    finite = all(bool(torch.isfinite(p).all()) and p.dtype == torch.float32 for p in model.parameters())
    return f"{str(out.dtype).removeprefix('torch.')}, parameters float32 and finite: {finite}"


def dropins(device: str) -> list[str]:
    """Rows: drop-in, largest difference from torch's module (output; parameter gradients) in float32, and the JVP."""
    torch.manual_seed(0)
    rows = ["| check | output | gradients |", "|---|---|---|"]
    peer = torch.nn.MultiheadAttention(32, 4, batch_first=True, device=device)
    ours = mha_torch.MultiheadAttention(32, 4, batch_first=True, device=device)
    ours.load_state_dict(peer.state_dict())
    x = torch.randn(2, 16, 32, device=device)
    rows.append("| mha_torch.MultiheadAttention vs nn.MultiheadAttention | " + _compare(peer, ours, x, True) + " |")
    peer = torch.nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, device=device
    )
    ours = transformer_block_torch.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, device=device
    )
    ours.load_state_dict(peer.state_dict())
    rows.append("| TransformerEncoderLayer vs nn.TransformerEncoderLayer | " + _compare(peer, ours, x, False) + " |")
    q, k, v, tangent = (torch.randn(2, 2, 16, 8, device=device, dtype=torch.float64) for _ in range(4))
    _, ours_t = attention_torch.jvp(q, k, v, {"Q": tangent}, causal=True)
    _, want = torch.func.jvp(lambda a: _math(a, k, v, True), (q,), (tangent,))
    rows.append(f"| attention_torch.jvp vs torch.func.jvp (float64, causal) | {_gap(ours_t, want):.1e} | |")
    return rows


def _compare(peer: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor, attention: bool) -> str:
    def step(module):
        module.zero_grad()
        out = module(x, x, x, need_weights=False)[0] if attention else module(x)
        out.square().sum().backward()
        return out.detach(), [p.grad for p in module.parameters()]

    (want, want_grads), (got, got_grads) = step(peer), step(ours)
    return f"{_gap(got, want):.1e} | {max(_gap(g, w) for g, w in zip(got_grads, want_grads)):.1e}"


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _math(q, k, v, causal):
    """softmax(Q Kᵀ / √d + M) V, eager."""
    scores = q @ k.mT / q.shape[-1] ** 0.5
    if causal:
        n, m = scores.shape[-2:]
        future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def timings(device: str, sizes: tuple, repeats: int, compiled: bool, smoke: bool) -> list[str]:
    """Rows: size, mask, then ms and MiB of each implementation's forward + backward in bfloat16."""
    runs: dict[str, Callable] = {
        "standard": lambda q, k, v, causal: attention_torch.forward(q, k, v, causal=causal),
        "memeff": lambda q, k, v, causal: attention_torch_memeff.forward(q, k, v, causal=causal),
        "SDPA": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "eager math": _math,
    }
    if compiled:
        runs["compiled math"] = torch.compile(_math, backend="eager" if smoke else "inductor", dynamic=False)
    header = "| size | mask | " + " | ".join(f"{name} ms (MiB)" for name in runs) + " |"
    rows = [header, "|---|---|" + "---|" * len(runs)]
    for size in sizes:
        for causal in (False, True):
            cells = []
            for run in runs.values():
                try:
                    ms, mib = _timed(run, size, causal, device, repeats)
                    cells.append(f"{ms:.2f} ({mib:.0f})" if mib is not None else f"{ms:.2f}")
                except (RuntimeError, torch.OutOfMemoryError) as failure:  # one failed run leaves the others
                    cells.append(f"failed: {str(failure).splitlines()[0][:60]}")
            rows.append(
                f"| {'×'.join(map(str, size))} | {'causal' if causal else 'none'} | " + " | ".join(cells) + " |"
            )
    return rows


def _timed(run: Callable, size: tuple, causal: bool, device: str, repeats: int) -> tuple[float, float | None]:
    """Best milliseconds of one forward + backward, and the peak memory above the inputs (CUDA only)."""
    generator = torch.Generator(device=device).manual_seed(0)
    leaves = [torch.randn(*size, generator=generator, device=device, dtype=torch.bfloat16) for _ in range(3)]
    leaves = [x.requires_grad_() for x in leaves]
    cotangent = torch.randn(*size, generator=generator, device=device, dtype=torch.bfloat16)

    def step():
        out = run(*leaves, causal)
        torch.autograd.grad(out, leaves, cotangent)

    cuda = device == "cuda"
    step()  # warm up (and compile)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    return best * 1e3, peak


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="no CUDA: the same code on the CPU at tiny sizes")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile of the math out")
    parser.add_argument("--out", type=Path, default=HERE / "GPU.md")
    parser.add_argument("--only", help="the sections whose titles start with one of these words, comma-separated")
    parser.add_argument("--sweep-seconds", type=float, default=150.0, help="no launch setting begun after these")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --cpu-smoke to check the script on the CPU")
    device = "cpu" if smoke else "cuda"
    started = time.perf_counter()
    machine = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    repeats, compiled = 2 if smoke else args.repeats, not args.no_compile
    modules = {}  # the Triton modules, made by the first section that needs them
    why = TRITON.skipped(smoke)

    def made() -> dict:
        if not modules:
            modules.update(TRITON.modules())
            KERNELS.chose(modules)  # at the sweep's settings where it ran
        return modules

    sections: list[tuple[str, Callable[[], list[str]]]] = [  # the Triton kernels first: right before timed
        (
            "Triton launch settings, attention_triton (bfloat16; float32 under --cpu-smoke)",
            lambda: KERNELS.sweep(device, smoke, args.sweep_seconds),
        ),
        (
            "Triton kernels against float64 (worst of output and gradients)",
            lambda: KERNELS.correctness(device, smoke, made()),
        ),
        (
            "Triton modules, forward + backward (bfloat16; float32 under --cpu-smoke)",
            lambda: TRITON.variants(device, smoke, 1 if smoke else repeats, made(), compiled),
        ),
        (
            "Triton positions (sa.entries) beside FlexAttention's masks (bfloat16; float32 under --cpu-smoke)",
            lambda: POSITIONS.variants(device, smoke, 1 if smoke else repeats, POSITIONS.modules()),
        ),
        (
            "Triton dropout 0.1, with ÷ without, beside SDPA's dropout_p (bfloat16; float32 under --cpu-smoke)",
            lambda: DROPOUT.variants(device, smoke, 1 if smoke else repeats, DROPOUT.modules()),
        ),
        ("Triton forward + backward by kernel (torch.profiler)", lambda: KERNELS.profile(device, smoke)),
        ("Triton host time per call, and as a CUDA graph", lambda: KERNELS.host(device, smoke)),
        (
            "Triton JVP (output and tangent) against torch.func.jvp of the math",
            lambda: TRITON.jvp(made(), device, smoke, 1 if smoke else repeats),
        ),
        ("Precision (error against float64, worst of output and gradients)", lambda: precision(device, smoke)),
        ("Autocast (float32 leaves)", lambda: autocast(device, smoke)),
        ("Drop-ins and JVP (float32 unless stated)", lambda: dropins(device)),
        (
            "Forward + backward, bfloat16",
            lambda: timings(device, SMOKE_SIZES if smoke else SIZES, repeats, compiled, smoke),
        ),
    ]
    if args.only:
        sections = [(title, run) for title, run in sections if title.startswith(tuple(args.only.split(",")))]
    flags = {"--cpu-smoke": smoke, f"--repeats {args.repeats}": args.repeats != 10, "--no-compile": args.no_compile}
    flags[f"--only {args.only}"] = bool(args.only)
    command = " ".join(["python benchmarks/gpu.py", *(flag for flag, given in flags.items() if given)])  # not --out
    head = (
        f"# symattn on {device}: {machine}\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
        f"{platform.platform()}. Command: `{command}`"
    )
    text = ""
    for title, section in sections:
        begun = time.perf_counter()
        if why and title.startswith("Triton"):
            rows = [why]
        else:
            try:
                rows = section()
            except Exception:  # a section that breaks is reported whole; the next one runs
                rows = ["```", traceback.format_exc().rstrip(), "```"]
        text += f"\n## {title}\n\n" + "\n".join(rows) + "\n"
        print(f"{title}: {time.perf_counter() - begun:.0f} s", flush=True)
        whole = f"{head} ({time.perf_counter() - started:.0f} s).\n{text}"
        args.out.write_text(whole, encoding="utf-8")  # written after every section: a run cut short keeps what it did
    print(whole)
    return whole


if __name__ == "__main__":
    main(sys.argv[1:])
