"""Attention with dropout 0.1 on the weights against the same without, forward + backward, one thread (CPU).

The specs: softmax(Q Kᵀ/√d) V and sa.dropout(softmax(Q Kᵀ/√d), 0.1) V, their generated torch modules: the standard
variant (the mask drawn from torch's generator once, saved for the backward) and the memory-efficient one (blocks of
128 rows, each block's mask drawn from a per-call seed in the forward and drawn again in the backward). Beside them,
torch's own eager attention with F.dropout on the weights and SDPA with dropout_p, each against itself without
dropout. loss = ⟨G, output⟩; best of the rounds, the implementations taking turns. Issue 57's CPU target: with ÷
without ≤ 1.2.

    python benchmarks/dropout.py [--n 1024] [--heads 4] [--d 64] [--repeats 5] [--write]
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import sympy as sp  # noqa: E402
import torch  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.codegen import generate as codegen  # noqa: E402
from symattn.specs import dim  # noqa: E402

P = 0.1


def attention_module(p: float, variant: str = "standard") -> types.ModuleType:
    """The generated torch module (variant) of attention with dropout p on the weights (p = 0: none)."""
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    output = sa.dropout(sa.softmax(q * k.T / sp.sqrt(d)), p) * v
    spec = sa.Spec(name=f"attention_dropout_{int(p * 100)}", summary="attention", inputs=(q, k, v), output=output)
    made = types.ModuleType(spec.name)
    exec(compile(codegen.render(spec, "torch", variant, second_order=False), made.__name__, "exec"), made.__dict__)
    return made


def eager(p: float):
    def attention(q, k, v):
        weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
        return torch.nn.functional.dropout(weights, p, True) @ v

    return attention


def sdpa(p: float):
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)


def timed(fn, inputs, cotangent) -> float:
    leaves = [x.detach().requires_grad_() for x in inputs]
    start = time.perf_counter()
    torch.autograd.grad(fn(*leaves), leaves, cotangent)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write benchmarks/DROPOUT.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shape = (args.heads, args.n, args.d)
    inputs = [torch.randn(shape, generator=g) for _ in range(3)]
    cotangent = torch.randn(shape, generator=g)
    with_dropout, without = attention_module(P), attention_module(0)
    blocked, blocked_without = attention_module(P, "memeff"), attention_module(0, "memeff")
    pairs = {
        "symattn torch module": (with_dropout.forward, without.forward),
        "symattn torch module, memory-efficient variant": (blocked.forward, blocked_without.forward),
        "torch eager, F.dropout on the weights": (eager(P), eager(0.0)),
        "torch SDPA, dropout_p": (sdpa(P), sdpa(0.0)),
    }
    best = {(name, which): math.inf for name in pairs for which in (0, 1)}
    for _ in range(args.repeats):
        for name, fns in pairs.items():
            for which, fn in enumerate(fns):
                best[name, which] = min(best[name, which], timed(fn, inputs, cotangent))
    rows = [
        f"| {name} | {1e3 * best[name, 1]:.1f} | {1e3 * best[name, 0]:.1f} | {best[name, 0] / best[name, 1]:.3f} |"
        for name in pairs
    ]
    table = "\n".join(
        ["| implementation | ms without | ms with p = 0.1 | with ÷ without |", "|---|---:|---:|---:|", *rows]
    )
    header = (
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} CPU: "
        f"`python benchmarks/dropout.py --n {args.n} --heads {args.heads} --d {args.d} --repeats {args.repeats}"
        f"{' --write' if args.write else ''}`. {args.heads} heads × n = m = {args.n}, d = {args.d}, float32, one "
        f"thread; forward + backward, best of {args.repeats}. Target (issue 57, CPU): with ÷ without ≤ 1.2."
    )
    print(header, table, sep="\n\n")
    if args.write:
        text = f"# Attention with dropout on the weights\n\n{header}\n\n{table}\n"
        Path(__file__).with_name("DROPOUT.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
