"""Hessian-vector product on mha, one thread: the generated second closed form against torch.func.

f = tr(Gᵀ mha(Q, K, V, W_Q, W_K, W_V, W_O)); H v for a direction v in every input. Three ways:
- ``closed form``: ``mha_torch.hvp`` (the second closed form's forward and backward);
- ``double backward``: autograd through the generated Function (create_graph=True, then grad along v);
- ``torch.func``: ``jvp(grad(f))`` of a plain torch forward written here.
Prints the median times and the ratios to torch.func (target ≤ 1.0×), and the largest difference.

    OMP_NUM_THREADS=1 python benchmarks/second_order.py [--n 256] [--d 256] [--heads 4] [--batch 2]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import torch
from symattn.generated import mha_torch

NAMES = ("Q", "K", "V", "W_Q", "W_K", "W_V", "W_O")


def reference(Q, K, V, W_Q, W_K, W_V, W_O, heads):
    """mha in plain torch: Concat_h softmax(Q W_Q,h (K W_K,h)ᵀ / √d_k) V W_V,h, times W_O."""

    def split(x):
        return x.unflatten(-1, (heads, -1)).transpose(-3, -2)

    q, k, v = split(Q @ W_Q), split(K @ W_K), split(V @ W_V)
    p = torch.softmax(q @ k.mT / q.shape[-1] ** 0.5, dim=-1)
    return (p @ v).transpose(-3, -2).flatten(-2) @ W_O


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of repeats calls of fn, after one warm-up (timeit: the garbage collector off)."""
    fn()
    return statistics.median(timeit.repeat(fn, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, n, d, h = args.batch, args.n, args.d, args.heads
    x = {name: torch.randn(b, n, d, dtype=dtype) for name in NAMES[:3]}
    x |= {name: torch.randn(d, d, dtype=dtype) / d**0.5 for name in NAMES[3:]}
    g = torch.randn(b, n, d, dtype=dtype)
    v = {name: torch.randn_like(t) for name, t in x.items()}

    def closed_form():
        with torch.no_grad():
            return mha_torch.hvp(**x, grad_out=g, direction=v, num_heads=h)

    def double_backward():
        leaves = [t.clone().requires_grad_() for t in x.values()]
        out = mha_torch.forward(*leaves, num_heads=h)
        grads = torch.autograd.grad(out, leaves, g, create_graph=True)
        return dict(zip(NAMES, torch.autograd.grad(grads, leaves, list(v.values()))))

    def f(primals):
        return (reference(*primals, h) * g).sum()

    def functorch():
        _, hv = torch.func.jvp(torch.func.grad(f), (tuple(x.values()),), (tuple(v.values()),))
        return dict(zip(NAMES, hv))

    want = functorch()
    for name, fn in (("closed form", closed_form), ("double backward", double_backward)):
        got = fn()
        error = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in NAMES)
        print(f"{name}: largest relative difference to torch.func {error:.1e}")
    base = median_time(functorch, args.repeats)
    print(f"mha B={b} n={n} d_model={d} H={h} {args.dtype}, one thread, median of {args.repeats}")
    print(f"  torch.func jvp(grad):  {base * 1e3:8.2f} ms")
    for name, fn in (("closed form hvp", closed_form), ("double backward", double_backward)):
        t = median_time(fn, args.repeats)
        print(f"  {name:20s}  {t * 1e3:8.2f} ms  {t / base:5.2f}×")


if __name__ == "__main__":
    main()
