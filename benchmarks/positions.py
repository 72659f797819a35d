"""Positions on the CPU (issue 52): the gallery's variants (docs/positions.md) as generated torch modules, beside SDPA
with the same mask or bias as a dense tensor and FlexAttention compiled with its BlockMask / score_mod; one thread.

Variants (B × H × n × d per head; s = Q Kᵀ/√d, i the query position, j the key position), the specs taken from the
guide's gallery as written there (its Python blocks run, not copied):

- relative: s − |i − j|/2;
- alibi: s − 2^(−8(h+1)/H)·|i − j| per head h (the gallery's H = 8; the module takes the heads side by side,
  B × n × H·d, folded and unfolded around each call, copies it pays);
- table: s + b[|i − j|, 0], b a learned table of n rows (its gradient too);
- window: a causal sliding window of 64 keys (0 where 0 ≤ i − j < 64, else −∞);
- documents: 0 where doc[i] = doc[j] else −∞, the ids a constant read at positions (4 documents of unequal lengths).

Timed: forward + backward (loss = ⟨G, output⟩, the gradients of Q, K, V and b) of the standard and memory-efficient
torch modules and of SDPA with the dense n × m mask (built once outside the timed calls; the table's built inside
by indexing b, so that autograd gives b's gradient); then the forward alone of the faster module, SDPA and
FlexAttention (``torch.compile(flex_attention)``; its mask_mod as a BlockMask made once, its score_mod): torch
2.13's FlexAttention refuses inputs that require grad on the CPU ("does not support backward on CPU"), so it has no
forward + backward column. Best of the rounds, the implementations taking turns; each one's largest error against
a float64 eager reference (the bias built here with torch.arange), relative to the reference's largest entry, over
the output and every gradient (FlexAttention: the output).

    python benchmarks/positions.py [--sizes 1024 2048] [--heads 4] [--d 64] [--repeats 5] [--write]
    python benchmarks/positions.py --quick      # tiny sizes, one round, no FlexAttention (its compile): a smoke run

``--write`` writes POSITIONS.md next to this script (refused with --quick); nothing is written without it. The run
fails (exit 1) when an error exceeds 1e-4 (float32).
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from positions_memeff import machine_text, module  # noqa: E402

import symattn as sa  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from fenced import fenced_blocks  # noqa: E402

# variant → the gallery spec's name in docs/positions.md
GALLERY = {
    "relative": "relative",
    "alibi": "alibi_heads",
    "table": "relative_table",
    "window": "sliding_window",
    "documents": "documents",
}
WINDOW, DOCUMENTS, TOLERANCE = 64, 4, 1e-4


def gallery_specs() -> tuple[dict[str, sa.Spec], int]:
    """The specs docs/positions.md's Python blocks make, run in order in one namespace (as its test runs them), and
    the head count H of its ALiBi spec."""
    namespace: dict = {"__name__": "positions_guide"}
    for block in fenced_blocks((ROOT / "docs" / "positions.md").read_text(encoding="utf-8"), "python"):
        exec(compile(block, "docs/positions.md", "exec"), namespace)
    made = {value.name: value for value in namespace.values() if isinstance(value, sa.Spec)}
    return {variant: made[name] for variant, name in GALLERY.items()}, namespace["H"]


def slopes(heads: int, dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's slopes 2^(−8(h+1)/H), (H,)."""
    return torch.exp2(-8 * torch.arange(1, heads + 1, dtype=torch.float64) / heads).to(dtype)


def document_ids(batch: int, n: int) -> torch.Tensor:
    """(batch, n) ids of DOCUMENTS contiguous documents, longer towards the end."""
    cuts = torch.linspace(0, 1, DOCUMENTS + 1)[1:-1] ** 1.5
    return torch.bucketize(torch.arange(n) / n, cuts, right=True).expand(batch, n)


def dense(variant: str, heads: int, ids: torch.Tensor, table: torch.Tensor | None, n: int, dtype) -> torch.Tensor:
    """The variant's additive n × n mask or bias as a tensor (broadcast over B × H): SDPA's and the reference's."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    distance = (i - j).abs()
    if variant == "relative":
        return -distance.to(dtype) / 2
    if variant == "alibi":
        return -slopes(heads, dtype)[:, None, None] * distance.to(dtype)
    if variant == "table":
        return table[distance, 0]  # indexing: autograd sums the table's gradient
    if variant == "window":
        allowed = (j <= i) & (i - j < WINDOW)
    else:  # documents: (B, 1, n, n)
        allowed = (ids[:, :, None] == ids[:, None, :])[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, -math.inf)


def flex(variant: str, heads: int, ids: torch.Tensor, table: torch.Tensor | None) -> Callable:
    """FlexAttention, compiled, with the variant as a BlockMask (masks) or a score_mod (biases); forward only."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # a fresh compile per case: past dynamo's recompile limit (8) it runs unfused, eager
    attend = torch.compile(flex_attention, dynamic=False)
    batch, n = ids.shape
    rates = slopes(heads, torch.float32)
    flat = None if table is None else table.detach().reshape(-1)
    mods = {
        "relative": lambda s, b, h, i, j: s - (i - j).abs().to(s.dtype) / 2,
        "alibi": lambda s, b, h, i, j: s - rates[h] * (i - j).abs().to(s.dtype),
        "table": lambda s, b, h, i, j: s + flat[(i - j).abs()],
    }
    masks = {
        "window": lambda b, h, i, j: (j <= i) & (i - j < WINDOW),
        "documents": lambda b, h, i, j: ids[b, i] == ids[b, j],
    }
    block = None
    if variant in masks:
        block = create_block_mask(masks[variant], batch if variant == "documents" else None, None, n, n, "cpu")

    def run(q, k, v, *_):  # (b's values are in the score_mod)
        with torch.no_grad():
            return attend(q, k, v, score_mod=mods.get(variant), block_mask=block)

    return run


def symattn_call(made, variant: str, constants: tuple) -> Callable:
    """The generated module's forward on B × H × n × d (ALiBi's heads folded side by side around the call)."""

    def call(q, k, v, *parameters):
        if variant != "alibi":
            return made.forward(q, k, v, *parameters, *constants)
        fold = lambda x: x.transpose(-3, -2).flatten(-2)  # noqa: E731
        out = made.forward(fold(q), fold(k), fold(v))
        return out.unflatten(-1, (q.shape[-3], q.shape[-1])).transpose(-3, -2)

    return call


def sdpa_call(variant: str, heads: int, ids: torch.Tensor, dtype: torch.dtype) -> Callable:
    """SDPA with the variant as a dense float mask (made once; the table's made at each call, by indexing b)."""
    cached = {}

    def call(q, k, v, *parameters):
        n = q.shape[-2]
        if variant == "table":
            mask = dense(variant, heads, ids, parameters[0], n, dtype)
        else:
            mask = cached.setdefault(n, dense(variant, heads, ids, None, n, dtype))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return call


def reference_call(variant: str, heads: int, ids: torch.Tensor) -> Callable:
    """The eager float64 math: softmax(Q Kᵀ/√d + the dense mask or bias) V."""

    def call(q, k, v, *parameters):
        table = parameters[0] if parameters else None
        scores = q @ k.mT / math.sqrt(q.shape[-1]) + dense(variant, heads, ids, table, q.shape[-2], q.dtype)
        return torch.softmax(scores, dim=-1) @ v

    return call


def with_backward(call: Callable) -> Callable:
    """leaves, G → [output, the gradient of ⟨G, output⟩ for each leaf]."""

    def step(leaves, cotangent):
        leaves = [x.detach().requires_grad_() for x in leaves]
        out = call(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, cotangent)]

    return step


def forward_only(call: Callable) -> Callable:
    def step(leaves, cotangent):
        with torch.no_grad():
            return [call(*(x.detach() for x in leaves))]

    return step


def error(got: list, wanted: list) -> float:
    """The largest error against the float64 reference, relative to its largest entry, over what got holds."""
    return max(float((a.double() - w).abs().max() / w.abs().max()) for a, w in zip(got, wanted))


def timed(steps: dict, leaves: list, cotangent, repeats: int) -> tuple[dict, dict]:
    """Each step's first result (a warm-up) and its best time of the rounds, the steps taking turns."""
    results = {name: step(leaves, cotangent) for name, step in steps.items()}
    best = dict.fromkeys(steps, math.inf)
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step(leaves, cotangent)
            best[name] = min(best[name], time.perf_counter() - start)
    return results, best


def case(variant: str, made: dict, heads: int, n: int, d: int, repeats: int, use_flex: bool) -> tuple[str, float]:
    """One row of the table (B = 1) and the largest error in it."""
    generator = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, heads, n, d, generator=generator) for _ in range(3)]
    leaves += [torch.randn(n, 1, generator=generator) / 2] if variant == "table" else []
    cotangent = torch.randn(1, heads, n, d, generator=generator)
    ids = document_ids(1, n).contiguous()
    per_head = ids[:, None, :, None].expand(1, heads, n, 1).float()  # the module's: the inputs' batch axes (B, H)
    constants = (per_head,) if variant == "documents" else ()
    calls = {name: symattn_call(made[name], variant, constants) for name in ("standard", "memeff")}
    calls["SDPA"] = sdpa_call(variant, heads, ids, torch.float32)
    results, best = timed({name: with_backward(call) for name, call in calls.items()}, leaves, cotangent, repeats)
    faster = min(("standard", "memeff"), key=best.get)
    forward = {name: forward_only(calls[name]) for name in (faster, "SDPA")}
    if use_flex:
        forward["Flex"] = forward_only(flex(variant, heads, ids, leaves[3] if variant == "table" else None))
    forward_results, forward_best = timed(forward, leaves, cotangent, repeats)
    wide = [x.double() for x in leaves]
    wanted = with_backward(reference_call(variant, heads, ids))(wide, cotangent.double())
    errors = {name: error(got, wanted) for name, got in results.items()}
    errors["Flex"] = error(forward_results["Flex"], wanted[:1]) if use_flex else None
    ms = lambda seconds: f"{seconds * 1e3:.1f}"  # noqa: E731
    peers = min(t for name, t in forward_best.items() if name != faster)
    cells = [
        variant,
        f"1×{heads}×{n}×{d}",
        *(ms(best[name]) for name in ("standard", "memeff", "SDPA")),
        f"{best[faster] / best['SDPA']:.2f}",
        f"{ms(forward_best[faster])} ({faster})",
        ms(forward_best["SDPA"]),
        ms(forward_best["Flex"]) if use_flex else "—",
        f"{forward_best[faster] / peers:.2f}",
        ", ".join("—" if e is None else f"{e:.1e}" for e in errors.values()),
    ]
    return "| " + " | ".join(cells) + " |", max(e for e in errors.values() if e is not None)


HEADER = (
    "| variant | B×H×n×d | symattn standard ms | symattn memeff ms | SDPA ms | symattn ÷ SDPA "
    "| forward: symattn ms | forward: SDPA ms | forward: Flex ms | forward: symattn ÷ best peer "
    "| error: standard, memeff, SDPA, Flex |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="sequence lengths n = m")
    parser.add_argument("--heads", type=int, default=4, help="heads (ALiBi: the gallery's H)")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=list(GALLERY), default=list(GALLERY))
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (its compile: ~20 s a case)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round, no FlexAttention")
    parser.add_argument("--write", action="store_true", help="write POSITIONS.md next to this script")
    args = parser.parse_args()
    if args.quick and args.write:
        parser.error("--quick's tiny sizes are a smoke run: it writes nothing (drop --write)")
    if args.quick:
        args.sizes, args.heads, args.d, args.repeats, args.no_flex = [24, 40], 2, 8, 1, True
    torch.set_num_threads(1)
    load = os.getloadavg()
    specs, alibi_heads = gallery_specs()
    rows, worst = [], 0.0
    for variant in args.variants:
        spec = specs[variant]
        made = {name: module(spec, "torch", name) for name in ("standard", "memeff")}
        heads = alibi_heads if variant == "alibi" else args.heads
        for n in args.sizes:
            row, largest = case(variant, made, heads, n, args.d, args.repeats, not args.no_flex)
            rows.append(row)
            worst = max(worst, largest)
            print(row, flush=True)
    header = (
        f"float32, one thread, forward + backward (forward alone in the forward columns), best of {args.repeats}; "
        f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    table = "\n".join([HEADER, "|---|---|" + "---:|" * 8 + "---|", *rows])
    verdict = "pass" if worst <= TOLERANCE else "FAIL"
    print(header)
    print(table)
    print(f"correctness: {verdict} (largest error {worst:.1e}, tolerance {TOLERANCE:.0e})")
    if args.write:
        write(header, table)
    sys.exit(0 if verdict == "pass" else 1)


def write(header: str, table: str) -> None:
    """POSITIONS.md: this run's table; its notes (from their heading on) kept."""
    path = Path(__file__).parent / "POSITIONS.md"
    heading = "## Notes"
    notes = heading + path.read_text(encoding="utf-8").split(heading, 1)[1] if path.exists() else ""
    command = "python benchmarks/positions.py " + " ".join(sys.argv[1:])
    machine = machine_text()
    text = (
        "# Positions on the CPU: the gallery's variants beside SDPA and FlexAttention\n\n"
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {machine}: `{command}`. {header}. "
        "The variants are docs/positions.md's gallery specs (relative −|i − j|/2, ALiBi per head, a learned table "
        "b[|i − j|, 0], a causal window of 64, a document mask of 4 documents), the generated torch modules "
        "against SDPA with the dense mask or bias and FlexAttention compiled (forward only: it refuses a backward "
        "on the CPU). The ratios are the faster symattn module's time over SDPA's (forward + backward) and over "
        "the faster of SDPA and FlexAttention (forward); the errors are against a float64 eager reference, "
        "relative to its largest entry, over the output and every gradient (FlexAttention: the output).\n\n"
        f"{table}\n" + (f"\n{notes}" if notes else "")
    )
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
