"""The Triton modules in benchmarks/gpu.py (issue 41, item 5): forward + backward time and peak memory of each
variant beside SDPA, FlexAttention (compiled, its block mask for causal, a score_mod for the variant), torch.compile
of the eager math and the eager math, and the Triton time (memory) ÷ its peer's; the learned bias's gradient checked
bitwise across two runs; the JVP against ``torch.func.jvp`` of the eager math, every variant.

Variants (B×H×n×d, per head, d the head width), s = Q Kᵀ / √d: plain and causal (``attention_triton``; each also
with ``deterministic=False``, dQ by the backward's atomic adds: its Triton cell beside the same peers), softcap
softmax(50 tanh(s / 50)) V, ALiBi softmax(s + M) V (M = −slope_h·|i − j| a constant, no gradient; FlexAttention's
score_mod computes it from h, i, j), learned bias softmax(s + B) V (B per batch·head, with its gradient), sigmoid
σ(s) V (no normaliser), softplus-normalised (F ⊘ rowsum(F) 𝟏ᵀ) V with F = softplus(s) (FlexAttention cannot express
either: their peer is SDPA's plain attention at the same size), differential (softmax(s₁) − λ softmax(s₂)) V with
λ a trainable scalar (two SDPA calls, two FlexAttention calls), pointer log_softmax(s) (an n × m output, no V: no
SDPA or FlexAttention form). The peer of the ratio: FlexAttention where it expresses the variant (SDPA of the same
variant where FlexAttention is not timed: n = 8192, --cpu-smoke), SDPA's plain attention where it cannot. The
variants' Triton modules are rendered here from their specs (symattn from the checkout). On CUDA: bfloat16 at
4×16×2048×64 (plain and causal also 1×16×8192×64, Triton and SDPA only).
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
LAMBDA = 0.8  # differential attention's λ (the paper initialises it near 0.8)
VARIANTS = ("plain", "causal", "softcap", "alibi", "bias", "sigmoid", "softplus", "differential", "pointer")
ATOMIC = ("plain", "causal")  # also timed with deterministic=False (dQ by atomic adds), the Triton cell alone
FLEXLESS = ("sigmoid", "softplus", "pointer")  # FlexAttention cannot express them: SDPA's plain attention the peer


def _specs() -> dict[str, sa.Spec]:
    """The variants' cores as specs of Q, K, V per head (and the bias B, the ALiBi constant M, Q₂, K₂ and λ)."""
    n, m, d = dim("n"), dim("m"), dim("d_k")
    q, k, v, b = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d), sa.matrix("B", n, m)
    alibi, q2, k2, lam = sa.matrix("M", n, m), sa.matrix("Q2", n, d), sa.matrix("K2", m, d), sp.Symbol("lam", real=True)
    s, s2 = q * k.T / sp.sqrt(d), q2 * k2.T / sp.sqrt(d)
    f = sa.softplus(s)
    return {
        "softcap": sa.Spec(
            "bench_softcap", "softmax(50 tanh(s / 50)) V", (q, k, v), sa.softmax(CAP * sa.tanh(s / CAP)) * v
        ),
        "alibi": sa.Spec(
            "bench_alibi",
            "softmax(s + M) V, M the ALiBi bias",
            (q, k, v),
            sa.softmax(s + alibi) * v,
            constants=(alibi,),
        ),
        "bias": sa.Spec("bench_bias", "softmax(s + B) V", (q, k, v, b), sa.softmax(s + b) * v),
        "sigmoid": sa.Spec("bench_sigmoid", "σ(s) V", (q, k, v), sa.sigmoid(s) * v),
        "softplus": sa.Spec(
            "bench_softplus",
            "(F ⊘ rowsum(F) 𝟏ᵀ) V, F = softplus(s)",
            (q, k, v),
            sa.hadamard(f, sp.HadamardPower(sa.rowsum(f) * sa.ones(1, m), -1)) * v,
        ),
        "differential": sa.Spec(
            "bench_differential",
            "(softmax(s₁) − λ softmax(s₂)) V",
            (q, k, q2, k2, v, lam),
            (sa.softmax(s) - lam * sa.softmax(s2)) * v,
        ),
        "pointer": sa.Spec("bench_pointer", "log_softmax(s), n × m", (q, k), sa.log_softmax(s)),
    }


def _loaded(spec: sa.Spec, folder: Path):
    """The spec's Triton module, rendered to folder (triton.jit reads its source) and imported."""
    path = folder / f"{spec.name}_triton.py"
    path.write_text(render(spec, "triton"), encoding="utf-8")
    found = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's per-head slopes 2^(−8 (h + 1) / H), float32."""
    return torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)], device=device)


def _alibi(size: tuple, device: str, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's constant M (H, n, m) = −slope_h·|i − j|, broadcast over the batch."""
    i = torch.arange(size[2], device=device)
    return (-_slopes(size[1], device)[:, None, None] * (i[:, None] - i[None, :]).abs()).to(dtype)


def _scores(q, k, causal):
    """s = Q Kᵀ / √d, and the keys the causal mask hides (None without it)."""
    s = q @ k.mT / math.sqrt(q.shape[-1])
    return s, torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1) if causal else None


def _math(variant: str) -> Callable:
    """The variant's eager math: (q, k, v, causal, *extra) → output."""

    def softmax(q, k, causal, add=None, cap=False):
        s, hidden = _scores(q, k, causal)
        s = CAP * torch.tanh(s / CAP) if cap else s if add is None else s + add
        return torch.softmax(s if hidden is None else s.masked_fill(hidden, -math.inf), -1)

    def run(q, k, v, causal, *extra):
        if variant == "pointer":
            s, hidden = _scores(q, k, causal)
            return torch.log_softmax(s if hidden is None else s.masked_fill(hidden, -math.inf), -1)
        if variant in ("sigmoid", "softplus"):
            s, hidden = _scores(q, k, causal)
            f = torch.sigmoid(s) if variant == "sigmoid" else F.softplus(s)
            f = f if hidden is None else f.masked_fill(hidden, 0.0)  # a hidden key adds nothing
            return (f if variant == "sigmoid" else f / f.sum(-1, keepdim=True)) @ v
        if variant == "differential":
            q2, k2, lam = extra
            return (softmax(q, k, causal) - lam * softmax(q2, k2, causal)) @ v
        return softmax(q, k, causal, extra[0] if extra else None, variant == "softcap") @ v

    return run


_ATTEND = []  # flex_attention compiled once for every variant: the same call (plain's, differential's) compiles once


def _flex(variant: str, compiled: bool) -> Callable | None:
    """FlexAttention for the variant (None where it cannot express it): its score_mod, and the causal block mask."""
    if variant in FLEXLESS:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled and not _ATTEND:
        _ATTEND.append(torch.compile(flex_attention, dynamic=False))
    attend = _ATTEND[0] if compiled else flex_attention
    masks = {}

    mods = {}  # one score_mod per bias tensor (per head count for ALiBi): a new function at every call would recompile

    def run(q, k, v, causal, *extra):
        score_mod = _softcap if variant == "softcap" else None
        if variant == "bias":
            score_mod = mods.setdefault(id(extra[0]), _bias_mod(extra[0]))
        if variant == "alibi":
            score_mod = mods.setdefault((q.shape[1], q.device), _alibi_mod(_slopes(q.shape[1], q.device)))
        key = (q.shape[-2], k.shape[-2], q.device)
        if causal and key not in masks:  # made once per shape, outside the timed calls after the first
            masks[key] = create_block_mask(lambda b, h, i, j: j <= i, None, None, *key[:2], device=q.device)
        mask = masks[key] if causal else None
        if variant == "differential":
            q2, k2, lam = extra
            return attend(q, k, v, block_mask=mask) - lam * attend(q2, k2, v, block_mask=mask)
        return attend(q, k, v, score_mod=score_mod, block_mask=mask)

    return run


def _softcap(s, b, h, i, j):
    """FlexAttention's score_mod of softcap: s is already Q Kᵀ / √d."""
    return CAP * torch.tanh(s / CAP)


def _bias_mod(bias: torch.Tensor) -> Callable:
    """FlexAttention's score_mod adding the learned bias (B, H, n, m); its gradient by FlexAttention's backward."""

    def score_mod(s, b, h, i, j):
        return s + bias[b, h, i, j]

    return score_mod


def _alibi_mod(slopes: torch.Tensor) -> Callable:
    """FlexAttention's score_mod of ALiBi: −slope_h·|i − j| from the head and the positions (no n × m tensor)."""

    def score_mod(s, b, h, i, j):
        return s - slopes[h] * (i - j).abs()

    return score_mod


def _sdpa(variant: str) -> Callable | None:
    """SDPA where it expresses the variant: plain and causal, ALiBi (M its float attn_mask), differential (twice)."""
    attend = F.scaled_dot_product_attention
    if variant in ("plain", "causal"):
        return lambda q, k, v, causal: attend(q, k, v, is_causal=causal)
    if variant == "alibi":
        return lambda q, k, v, causal, m: attend(q, k, v, attn_mask=_hidden(m, causal))
    if variant == "differential":
        return lambda q, k, v, causal, q2, k2, lam: (
            attend(q, k, v, is_causal=causal) - lam * attend(q2, k2, v, is_causal=causal)
        )
    return None


def _hidden(m: torch.Tensor, causal: bool) -> torch.Tensor:
    """The float mask m, −∞ where the causal mask hides a key."""
    hidden = torch.ones(m.shape[-2:], dtype=torch.bool, device=m.device).triu(1)
    return m.masked_fill(hidden, -math.inf) if causal else m


def _triton(variant: str, modules: dict, deterministic: bool = True) -> Callable:
    if variant in ("plain", "causal"):
        return lambda q, k, v, causal: modules["attention"].forward(q, k, v, causal=causal, deterministic=deterministic)
    if variant == "differential":
        return lambda q, k, v, causal, q2, k2, lam: modules[variant].forward(q, k, q2, k2, v, lam, causal=causal)
    if variant == "pointer":
        return lambda q, k, v, causal: modules[variant].forward(q, k, causal=causal)
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
    """Q, K, V, causal, then the variant's own: B; Q₂, K₂, λ (float32, 0-d); ALiBi's M (no grad), in this order."""
    generator = torch.Generator(device=device).manual_seed(0)
    made = [torch.randn(*size, generator=generator, device=device, dtype=dtype) for _ in range(3)]
    extra = []
    if variant == "bias":
        extra = [torch.randn(*size[:3], size[2], generator=generator, device=device, dtype=dtype)]
    if variant == "differential":
        extra = [torch.randn(*size, generator=generator, device=device, dtype=dtype) for _ in range(2)]
        extra.append(torch.tensor(LAMBDA, device=device))
    made = [x.requires_grad_() if i < 2 or variant != "pointer" else x for i, x in enumerate(made)]  # pointer: no V
    leaves = made + [causal] + [x.requires_grad_() for x in extra]
    return leaves + ([_alibi(size, device, dtype)] if variant == "alibi" else [])


def _cell(run: Callable | None, leaves: list, repeats: int, device: str) -> tuple[str, list | None, tuple | None]:
    """The cell's text, the gradients, and (ms, MiB or None) where it ran."""
    if run is None:
        return "—", None, None
    try:
        ms, mib, grads = _timed(lambda *x: run(*x), leaves, repeats, device)
    except (RuntimeError, torch.OutOfMemoryError, NotImplementedError) as failure:  # one failed run leaves the others
        return f"failed: {str(failure).splitlines()[0][:60]}", None, None
    return (f"{ms:.2f} ({mib:.0f})" if mib is not None else f"{ms:.2f}"), grads, (ms, mib)


def _ratio(ours: tuple | None, peers: list[tuple[str, tuple | None]]) -> str:
    """The Triton ms (MiB) ÷ the first peer that ran, and the peer's name."""
    for name, theirs in peers:
        if ours is not None and theirs is not None:
            memory = f" ({ours[1] / theirs[1]:.2f})" if ours[1] is not None and theirs[1] else ""
            return f"{ours[0] / theirs[0]:.2f}{memory} ÷ {name}"
    return "—"


def skipped(smoke: bool) -> str | None:
    """Why the Triton sections cannot run here (None where they can)."""
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        return "skipped: --cpu-smoke without TRITON_INTERPRET=1 (set it before triton is imported)"
    return None


def modules() -> dict:
    """The variants' Triton modules by variant, rendered from their specs, and the built-in attention_triton."""
    folder = Path(tempfile.mkdtemp(prefix="symattn_triton_"))
    made = {name: _loaded(spec, folder) for name, spec in _specs().items()}
    from generated import attention_triton

    return made | {"attention": attention_triton}


def variants(device: str, smoke: bool, repeats: int, modules: dict, compiled: bool = True) -> list[str]:
    """The timing rows. compiled=False (gpu.py's --no-compile): no torch.compile of the math (FlexAttention is
    compiled all the same)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)  # one score_mod each
    dtype = torch.float32 if smoke else torch.bfloat16
    names = ["symattn Triton", "SDPA", "FlexAttention", "compiled math", "eager math"]
    rows = [
        "| variant | size | "
        + " | ".join(f"{x} ms (MiB)" for x in names)
        + " | dB bitwise (Triton, Flex) | Triton ÷ peer ms (MiB) |"
    ]
    rows.append("|---|---|" + "---|" * (len(names) + 2))
    plain = {}  # SDPA's plain attention by size: the peer of the variants FlexAttention cannot express
    for variant in VARIANTS:
        kind = "plain" if variant in ("plain", "causal") else "variant"
        for size in (SMOKE,) if smoke else SIZES[kind]:
            causal = variant == "causal"
            leaves = _leaves(variant, size, causal, device, dtype)
            math_run = _math("plain" if kind == "plain" else variant)
            runs = [
                _triton(variant, modules),
                _sdpa(variant),
                None if smoke else _flex("plain" if kind == "plain" else variant, True),  # no backward on CPU
                torch.compile(math_run, backend="eager" if smoke else "inductor", dynamic=False) if compiled else None,
                math_run,
            ]
            if size[2] > 4096:  # compiling FlexAttention and the math again at n = 8192 costs the 5 minutes' budget
                runs[2:] = [None, None, None]
            cells, grads, times = zip(*(_cell(run, leaves, repeats, device) for run in runs))
            if variant == "plain":
                plain[size] = times[1]
            bitwise = ""
            if variant == "bias":
                again = [_cell(runs[i], leaves, 1, device)[1] for i in (0, 2)]
                bitwise = ", ".join(
                    "—" if a is None or b is None else str(torch.equal(a[-1], b[-1]))
                    for a, b in zip((grads[0], grads[2]), again)
                )
            if variant in FLEXLESS:
                peers = [("SDPA plain", plain.get(size))]
            else:
                peers = [("Flex", times[2]), ("SDPA", times[1])]
            rows.append(
                f"| {variant} | {'×'.join(map(str, size))} | "
                + " | ".join(cells)
                + f" | {bitwise} | {_ratio(times[0], peers)} |"
            )
            if variant in ATOMIC:  # the other backward mode: its Triton cell, beside the same peers
                cell, _, ours = _cell(_triton(variant, modules, False), leaves, repeats, device)
                blank = " | ".join(["—"] * (len(names) - 1))
                rows.append(
                    f"| {variant}, deterministic=False | {'×'.join(map(str, size))} | {cell} | {blank} | | "
                    f"{_ratio(ours, peers)} |"
                )
    return rows


def jvp(modules: dict, device: str, smoke: bool, repeats: int) -> list[str]:
    """Every variant's Triton JVP (output and tangent, Q moving) against torch.func.jvp of the eager math: ms, and the
    tangent's error."""
    rows = [
        "| variant | size | Triton jvp ms | torch.func.jvp of the math ms | tangent error ÷ max |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        size = SMOKE if smoke else SIZES["plain" if variant in ("plain", "causal") else "variant"][0]
        module = modules["attention" if variant in ("plain", "causal") else variant]
        ours, theirs = _jvp_runs(variant, module, size, device, torch.float32 if smoke else torch.bfloat16)
        times = [best_ms(run, repeats, device) for run in (ours, theirs)]
        got, want = ours()[1].double(), theirs()[1].double()
        error = float((got - want).abs().max() / want.abs().max())
        rows.append(f"| {variant} | {'×'.join(map(str, size))} | {times[0]:.2f} | {times[1]:.2f} | {error:.1e} |")
    return rows


def _jvp_runs(variant: str, module, size: tuple, device: str, dtype: torch.dtype) -> tuple[Callable, Callable]:
    """The Triton module's jvp and torch.func.jvp of the eager math, Q moving along a random tangent."""
    causal = variant == "causal"
    q, k, v, _, *extra = (
        x.detach() if isinstance(x, torch.Tensor) else x for x in _leaves(variant, size, causal, device, dtype)
    )
    tangent = torch.randn(*size, generator=torch.Generator(device=device).manual_seed(2), device=device, dtype=dtype)
    inputs = (q, k, *extra[:2], v, *extra[2:]) if variant == "differential" else (q, k, v, *extra[: variant == "bias"])
    inputs = (q, k) if variant == "pointer" else inputs
    keywords = {"M": extra[0]} if variant == "alibi" else {}
    math_run = _math("plain" if variant in ("plain", "causal") else variant)

    def ours():
        return module.jvp(*inputs, {"Q": tangent}, causal=causal, **keywords)

    def theirs():
        return torch.func.jvp(lambda a: math_run(a, k, v, causal, *extra), (q,), (tangent,))

    return ours, theirs


def best_ms(run: Callable, repeats: int, device: str) -> float:
    """Best milliseconds of run() over repeats calls after one warm-up (CUDA synchronised)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
