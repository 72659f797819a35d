"""Time the drop-in ``mha_torch.MultiheadAttention`` against ``torch.nn.MultiheadAttention``, one thread.

One step is forward + backward of self-attention (query, key and value the same tensor, which
requires a gradient, as inside a network) with the same weights in both, loss = ⟨G, output⟩; with
``need_weights`` True (torch's default: the averaged weights are returned) and False. Time: the best of
``--repeats`` rounds, the two modules taking turns in each so that load from elsewhere falls on both.
Prints a Markdown table (ratio = drop-in / torch; issue 13's targets: ≤ 1.0 in float32, ≤ 0.85 in
float64) and, with ``--out FILE``, writes the figures as JSON.

    OMP_NUM_THREADS=1 python benchmarks/dropin.py [--quick] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from symattn.generated import mha_torch  # noqa: E402

torch.set_num_threads(1)
CASES = ((4, 256, 512, 8), (1, 1024, 256, 4))  # batch, tokens, embed_dim, heads
QUICK = ((2, 16, 32, 4),)


def _step(module, x, seed, need_weights):
    """One forward + backward; the gradients land in x.grad and the parameters' .grad."""
    out, _ = module(x, x, x, need_weights=need_weights)
    out.backward(seed)


def _time(module, x, seed, need_weights):
    module.zero_grad(set_to_none=True)
    x.grad = None
    start = time.perf_counter()
    _step(module, x, seed, need_weights)
    return time.perf_counter() - start


def measure(batch, n, embed_dim, heads, dtype, need_weights, repeats):
    """Best seconds of one step for torch and the drop-in, and the largest gradient difference between them."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True, dtype=dtype)
    ours = mha_torch.MultiheadAttention(embed_dim, heads, batch_first=True, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(batch, n, embed_dim, dtype=dtype, requires_grad=True)
    seed = torch.randn(batch, n, embed_dim, dtype=dtype)
    best = {"torch": float("inf"), "dropin": float("inf")}
    for _ in range(repeats + 1):  # the first round warms up both (and is kept only if it is the best)
        for name, module in (("torch", ref), ("dropin", ours)):
            best[name] = min(best[name], _time(module, x, seed, need_weights))
    grads = []
    for module in (ref, ours):
        module.zero_grad(set_to_none=True)
        x.grad = None
        _step(module, x, seed, need_weights)
        grads.append([x.grad.clone(), *(p.grad.clone() for p in module.parameters())])
    error = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in zip(*grads))
    return {**best, "ratio": best["dropin"] / best["torch"], "relative_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    rows = []
    print("| B | n | E | H | dtype | need_weights | torch ms | drop-in ms | ratio | grad rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, n, embed_dim, heads in QUICK if args.quick else CASES:
        for dtype in (torch.float32, torch.float64):
            for need_weights in (True, False):
                r = measure(batch, n, embed_dim, heads, dtype, need_weights, 1 if args.quick else args.repeats)
                rows.append({"B": batch, "n": n, "E": embed_dim, "H": heads, "dtype": str(dtype)[6:]} | r)
                rows[-1]["need_weights"] = need_weights
                print(
                    f"| {batch} | {n} | {embed_dim} | {heads} | {str(dtype)[6:]} | {need_weights} | "
                    f"{1e3 * r['torch']:.2f} | {1e3 * r['dropin']:.2f} | {r['ratio']:.2f} | "
                    f"{r['relative_error']:.1e} |",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"torch": torch.__version__, "threads": 1, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
