"""Positions on the GPU in benchmarks/gpu.py (issue 52): attention whose mask or bias is a formula of the positions
(``sa.entries``), computed in the Triton kernels' registers with the tiles a mask hides skipped, beside
FlexAttention (compiled; its ``mask_mod`` as a block mask, its ``score_mod``), SDPA with the same mask or bias as a
dense n × m tensor, and the eager math: forward + backward time and peak memory, the Triton time (memory) ÷ the
peer's (FlexAttention, or SDPA where FlexAttention is not timed), and each output's and gradient's largest error
against a float64 eager reference beside SDPA's (the precision column).

Variants (B×H×n×d, per head; s = Q Kᵀ/√d; i the query position, j the key position):

- window: a causal sliding window of 256 keys, s + W with W = 0 where 0 ≤ i − j < 256, else −∞;
- prefix: a prefix-LM mask, every query sees the first 256 keys and the keys up to itself;
- decay: a distance bias −|i − j|/64 with the causal mask (a bias in the registers, no n × m array);
- alibi: ALiBi, −2^(−8(h+1)/H)·|i − j| with the head h's slope (``sa.entries(…, heads=H)``), causal: the Triton
  module takes the heads side by side (B × n × H·d, folded and unfolded around the call, copies it pays).

On CUDA bfloat16 at 4×16×2048×64 and 1×16×8192×64. Under ``--cpu-smoke`` the kernels run under Triton's
interpreter at 1×1×32×16 in float32 and FlexAttention is left out (no backward on the CPU).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import sympy as sp
import torch
from gpu_triton import SMOKE, _cell, _loaded, _ratio

import symattn as sa
from symattn.specs import dim

WINDOW, PREFIX, DECAY = 256, 256, 64
SIZES = ((4, 16, 2048, 64), (1, 16, 8192, 64))
VARIANTS = ("window", "prefix", "decay", "alibi")


def _formula(variant: str) -> Callable:
    """The variant's entry f(i, j) (SymPy), added to the scores."""

    def hidden(allowed):
        return sp.Piecewise((0, allowed), (-sp.oo, True))

    return {
        "window": lambda i, j: hidden((j <= i) & (i - j < WINDOW)),
        "prefix": lambda i, j: hidden((j < PREFIX) | (j <= i)),
        "decay": lambda i, j: -sp.Abs(i - j) / DECAY + hidden(j <= i),
        "alibi": lambda i, j: hidden(j <= i),
    }[variant]


def _allowed(variant: str, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The keys the variant lets a query see, from position tensors (FlexAttention's mask_mod, the dense masks)."""
    if variant == "window":
        return (j <= i) & (i - j < WINDOW)
    if variant == "prefix":
        return (j < PREFIX) | (j <= i)
    return j <= i


def _spec(variant: str) -> sa.Spec:
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    out = sa.softmax(q * k.T / sp.sqrt(d) + sa.entries(n, m, _formula(variant))) * v
    return sa.Spec(f"bench_{variant}", f"attention, {variant} as positions", (q, k, v), out)


def _alibi_spec(heads: int) -> sa.Spec:
    """ALiBi over heads side by side (n × H·d inputs), the slope 2^(−8(h+1)/H) of each head h, causal."""
    n, d = dim("n"), dim("d")
    q, k, v = (sa.matrix(x, n, heads * d) for x in "QKV")
    slope = lambda h: 2 ** (-8 * (h + 1) / sp.Integer(heads))  # noqa: E731
    causal = _formula("alibi")
    bias = sa.entries(n, n, lambda i, j, h: -slope(h) * sp.Abs(i - j) + causal(i, j), heads=heads)
    scores = sa.split_heads(q, heads) @ sa.split_heads(k, heads).T / sp.sqrt(d) + bias
    out = sa.merge_heads(sa.softmax(scores) @ sa.split_heads(v, heads), heads)
    return sa.Spec(f"bench_alibi_{heads}", "ALiBi as positions", (q.expr, k.expr, v.expr), out.expr)


def modules() -> dict:
    """The variants' Triton modules, rendered from their specs (ALiBi's once for each head count it runs at)."""
    folder = Path(tempfile.mkdtemp(prefix="symattn_positions_"))
    made = {variant: _loaded(_spec(variant), folder) for variant in VARIANTS if variant != "alibi"}
    return made | {("alibi", h): _loaded(_alibi_spec(h), folder) for h in {SMOKE[1], *(s[1] for s in SIZES)}}


def _slopes(heads: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's slopes 2^(−8(h+1)/H), (H, 1, 1)."""
    exponents = -8 * torch.arange(1, heads + 1, device=device, dtype=torch.float64) / heads
    return torch.exp2(exponents).to(dtype)[:, None, None]


def _heads_side_by_side(module) -> Callable:
    """module.forward on B × n × H·d (the heads folded beside each other), its output unfolded to B × H × n × d."""

    def run(q, k, v):
        fold = lambda x: x.transpose(-3, -2).flatten(-2)  # noqa: E731
        out = module.forward(fold(q), fold(k), fold(v))
        return out.unflatten(-1, (q.shape[-3], q.shape[-1])).transpose(-3, -2)

    return run


def _dense(variant: str, n: int, m: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The variant's n × m additive mask (0, −∞ and the bias) as a tensor: SDPA's and the eager math's."""
    i = torch.arange(n, device=device).unsqueeze(-1)
    j = torch.arange(m, device=device)
    bias = -(i - j).abs().to(dtype) / DECAY if variant == "decay" else torch.zeros(n, m, device=device, dtype=dtype)
    return bias.masked_fill(~_allowed(variant, i, j), -math.inf)


def _bias(variant: str, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The variant's additive mask for q's and k's sizes: (n, m), ALiBi's (H, n, m)."""
    n, m = q.shape[-2], k.shape[-2]
    dense = _dense(variant, n, m, q.device, q.dtype)
    if variant != "alibi":
        return dense
    distance = (torch.arange(n, device=q.device)[:, None] - torch.arange(m, device=q.device)).abs().to(q.dtype)
    return dense - _slopes(q.shape[-3], q.device, q.dtype) * distance


def _flex(variant: str) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    attend, masks = torch.compile(flex_attention, dynamic=False), {}
    mods = {"decay": lambda s, b, h, i, j: s - (i - j).abs().to(s.dtype) / DECAY}

    def run(q, k, v):
        key = (q.shape[-2], k.shape[-2], q.device)
        if key not in masks:  # made once per shape, outside the timed calls after the first
            masks[key] = create_block_mask(lambda b, h, i, j: _allowed(variant, i, j), None, None, *key[:2], q.device)
        mod = mods.get(variant)
        if variant == "alibi":  # one score_mod per head count: a new function at every call would recompile
            mod = mods.setdefault(q.shape[-3], _alibi_mod(_slopes(q.shape[-3], q.device, torch.float32)[:, 0, 0]))
        return attend(q, k, v, score_mod=mod, block_mask=masks[key])

    return run


def _alibi_mod(slopes: torch.Tensor) -> Callable:
    def score_mod(s, b, h, i, j):
        return s - slopes[h] * (i - j).abs().to(s.dtype)

    return score_mod


def _sdpa(variant: str) -> Callable:
    masks = {}

    def run(q, k, v):
        key = (q.shape[-3], q.shape[-2], k.shape[-2], q.device, q.dtype)
        mask = masks.setdefault(key, _bias(variant, q, k))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return run


def _math(variant: str) -> Callable:
    def run(q, k, v):
        scores = q @ k.mT / math.sqrt(q.shape[-1]) + _bias(variant, q, k)
        return torch.softmax(scores, dim=-1) @ v

    return run


def _error(grads: list | None, reference: list) -> float | None:
    """The largest error of the gradients against the float64 reference's, relative to its largest entry."""
    if grads is None:
        return None
    return max(float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference))


def variants(device: str, smoke: bool, repeats: int, made: dict) -> list[str]:
    """The timing rows, and the errors against float64 beside SDPA's."""
    dtype = torch.float32 if smoke else torch.bfloat16
    names = ["symattn Triton", "SDPA (dense mask)", "FlexAttention", "eager math"]
    rows = ["| variant | size | " + " | ".join(f"{x} ms (MiB)" for x in names) + " | error: Triton, SDPA | ratio |"]
    rows.append("|---|---|" + "---|" * (len(names) + 2))
    for variant in VARIANTS:
        for size in (SMOKE,) if smoke else SIZES:
            generator = torch.Generator(device=device).manual_seed(0)
            leaves = [torch.randn(*size, generator=generator, device=device, dtype=dtype) for _ in range(3)]
            leaves = [x.requires_grad_() for x in leaves]
            ours = _heads_side_by_side(made[variant, size[1]]) if variant == "alibi" else made[variant].forward
            runs = [ours, _sdpa(variant), None if smoke else _flex(variant), _math(variant)]
            if size[2] > 4096:  # the eager math's n × m scores at n = 8192: memory, not speed
                runs[3] = None
            cells, grads, times = zip(*(_cell(run, leaves, repeats, device) for run in runs))
            wide = [x.detach().double().requires_grad_() for x in leaves]
            seeded = torch.Generator(device=device).manual_seed(1)  # _timed's cotangent, rounded as it rounds it
            cotangent = torch.randn(size, generator=seeded, device=device).to(dtype).double()
            reference = torch.autograd.grad(_math(variant)(*wide), wide, cotangent)
            errors = [_error(g, reference) for g in grads[:2]]
            shown = ", ".join("—" if e is None else f"{e:.1e}" for e in errors)
            ratio = _ratio(times[0], [("Flex", times[2]), ("SDPA", times[1])])
            rows.append(f"| {variant} | {'×'.join(map(str, size))} | " + " | ".join(cells) + f" | {shown} | {ratio} |")
    return rows
