"""torch.compile of the generated torch modules against the same modules eager, and torch's SDPA, one thread.

One step is forward + backward, loss = ⟨G, output⟩, float32: ``attention_torch.forward`` (B × H × n × d
queries, keys and values, with and without ``causal``) and the own-layout ``mha_torch.MultiHeadAttention``
(self-attention, one tensor as query, key and value), and their memeff variants (``attention_torch_memeff``,
``mha_torch_memeff``: blocks of 128 query rows) on one size each. Each is run eager and as
``torch.compile(fullgraph=True)`` (inductor; compiled once before timing), beside
``F.scaled_dot_product_attention`` (attention) or ``nn.MultiheadAttention(need_weights=False)`` (mha),
which call torch's fused SDPA kernel. Time: the best of ``--repeats`` rounds, the runs taking turns in each.
Issue 28's target: compiled no slower than eager. Prints a Markdown table.

    OMP_NUM_THREADS=1 python benchmarks/compiled.py [--repeats 15] [--quick]
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import runpy  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from symattn.generated import attention_torch, attention_torch_memeff, mha_torch, mha_torch_memeff  # noqa: E402

torch.set_num_threads(1)
# best seconds of each run, the runs taking turns in every round: the gallery benchmark's harness
interleaved = runpy.run_path(str(Path(__file__).resolve().parent / "gallery.py"))["interleaved"]
ATTENTION = ((1, 8, 1024, 64), (1, 2, 4096, 64), (4, 8, 512, 64))  # B, H, n, d
MHA = ((4, 256, 512, 8), (1, 1024, 256, 4))  # B, n, d_model, H
QUICK_ATTENTION, QUICK_MHA = ((1, 2, 64, 16),), ((2, 32, 32, 4),)
MEMEFF_ATTENTION, MEMEFF_MHA = ((1, 8, 1024, 64),), ((1, 1024, 256, 4),)  # the memeff variants' sizes


def _step(function, leaves, seed):
    """A function of the leaves: one forward and backward, the gradients returned."""

    def run():
        out = function(*leaves)
        return torch.autograd.grad(out, leaves, seed)

    return run


def attention_row(batch, heads, n, d, causal, repeats, module=attention_torch) -> dict:
    torch.manual_seed(0)
    leaves = [torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3)]
    seed = torch.randn(batch, heads, n, d)

    def ours(q, k, v):
        return module.forward(q, k, v, causal=causal)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    runs = {"eager": _step(ours, leaves, seed), "compiled": _step(compiled, leaves, seed)}
    runs["sdpa"] = _step(sdpa, leaves, seed)
    error = max(float((a - b).abs().max()) for a, b in zip(runs["eager"](), runs["compiled"]()))
    times = interleaved(runs, repeats)
    case = f"attention{' memeff' * (module is attention_torch_memeff)} {batch}×{heads}×{n}, d={d}"
    return {"case": case + (", causal" if causal else ""), "error": error} | times


def mha_row(batch, n, d_model, heads, repeats, memeff=False) -> dict:
    torch.manual_seed(0)
    ours = mha_torch.MultiHeadAttention(d_model, num_heads=heads)
    ref = torch.nn.MultiheadAttention(d_model, heads, batch_first=True, bias=False)
    x = torch.randn(batch, n, d_model, requires_grad=True)
    seed = torch.randn(batch, n, d_model)
    leaves = [x, *ours.parameters()]

    def eager(t, *_):
        if memeff:  # the same weights, through the memeff variant's function
            return mha_torch_memeff.forward(t, t, t, ours.W_Q, ours.W_K, ours.W_V, ours.W_O, num_heads=heads)
        return ours(t, t, t)

    def torch_mha(t, *_):
        return ref(t, t, t, need_weights=False)[0]

    torch._dynamo.reset()
    compiled = torch.compile(eager, fullgraph=True)
    runs = {"eager": _step(eager, leaves, seed), "compiled": _step(compiled, leaves, seed)}
    runs["sdpa"] = _step(torch_mha, [x, *ref.parameters()], seed)
    error = max(float((a - b).abs().max()) for a, b in zip(runs["eager"](), runs["compiled"]()))
    times = interleaved(runs, repeats)
    return {"case": f"mha{' memeff' * memeff} B={batch} n={n} d_model={d_model} H={heads}", "error": error} | times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args()
    attention, mha = (QUICK_ATTENTION, QUICK_MHA) if args.quick else (ATTENTION, MHA)
    memeff_attention, memeff_mha = (QUICK_ATTENTION, QUICK_MHA) if args.quick else (MEMEFF_ATTENTION, MEMEFF_MHA)
    print("| case | eager (ms) | compiled ÷ eager | SDPA ÷ eager | largest difference compiled vs eager |")
    print("|---|---:|---:|---:|---:|")
    rows = [attention_row(*case, causal, args.repeats) for case in attention for causal in (False, True)]
    rows += [
        attention_row(*case, causal, args.repeats, attention_torch_memeff)
        for case in memeff_attention
        for causal in (False, True)
    ]
    rows += [mha_row(*case, args.repeats) for case in mha]
    rows += [mha_row(*case, args.repeats, memeff=True) for case in memeff_mha]
    for row in rows:
        eager = row["eager"]
        print(
            f"| {row['case']} | {eager * 1e3:.1f} | {row['compiled'] / eager:.2f} | {row['sdpa'] / eager:.2f} | "
            f"{row['error']:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
