"""Product orders at the sizes a model runs at: specs written with a dimension symattn has no size for.

Gated attention softmax(X W_Q (X W_K)ᵀ/√d) X W_V ⊙ σ(X W_G) and a residual layer X + softmax(…) (X W_V)/2, with
the model width a user's own dimension g. Whether (X W_Q W_Kᵀ) Xᵀ and (P X) W_V or (X W_Q)(X W_K)ᵀ and P (X W_V)
cost less depends on g against d; at g = 256, d = 64 the first orders cost up to 4× as much. Each spec is
generated twice: without sizes (one schedule per size regime, the module choosing from the arrays' shapes) and
with ``--size`` (the sizes timed here: one schedule), and its NumPy and torch modules' forward + backward are
timed against torch eager autograd and torch.compile of the same forward, written in torch (one thread, float32,
best of --repeat rounds taking turns: ``benchmarks/gallery.py``'s harness).

    OMP_NUM_THREADS=1 python benchmarks/sizes.py [--n 1024] [--g 256] [--d 64] [--repeat 10]
"""

from __future__ import annotations

import argparse
import runpy
import types
from pathlib import Path

import numpy as np
import sympy as sp
import torch

import symattn as sa
from symattn.codegen.generate import render
from symattn.specs import dim

ROOT = Path(__file__).resolve().parents[1]


def specs() -> dict[str, tuple[sa.Spec, object]]:
    """The two specs, each with its torch forward (inputs X, W_Q, W_K, W_V[, W_G])."""
    n, g, d = dim("n"), dim("g"), dim("d")
    x = sa.matrix("X", n, g)
    w_q, w_k, w_v, w_g = (sa.matrix(f"W_{c}", g, d) for c in "QKVG")
    p = sa.softmax(x * w_q * (x * w_k).T / sp.sqrt(d))
    gated = sa.Spec(
        "gated_g", "gated attention", (x, w_q, w_k, w_v, w_g), sa.hadamard(p * x * w_v, sa.sigmoid(x * w_g))
    )
    w_q2, w_k2, w_v2 = (sa.matrix(f"W_{c}", g, g) for c in "QKV")
    p2 = sa.softmax(x * w_q2 * (x * w_k2).T / sp.sqrt(g))
    residual = sa.Spec("residual_g", "residual layer", (x, w_q2, w_k2, w_v2), x + p2 * (x * w_v2) / 2)

    def gated_torch(x, w_q, w_k, w_v, w_g):
        scores = (x @ w_q) @ (x @ w_k).mT / w_q.shape[-1] ** 0.5
        return (torch.softmax(scores, -1) @ (x @ w_v)) * torch.sigmoid(x @ w_g)

    def residual_torch(x, w_q, w_k, w_v):
        scores = (x @ w_q) @ (x @ w_k).mT / w_q.shape[-1] ** 0.5
        return x + torch.softmax(scores, -1) @ (x @ w_v) / 2

    return {"gated attention": (gated, gated_torch), "residual layer": (residual, residual_torch)}


def module(spec: sa.Spec, backend: str, sizes: dict | None) -> types.ModuleType:
    made = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(render(spec, backend, sizes=sizes, second_order=False), made.__name__, "exec"), made.__dict__)
    return made


def timed(spec: sa.Spec, forward, sizes: dict, repeat: int, interleaved) -> dict[str, float]:
    """Best seconds of forward + backward: eager autograd and torch.compile of forward, and the generated NumPy
    and torch modules without sizes and with them (each checked against eager first)."""
    rng = np.random.default_rng(0)
    shapes = [tuple(sizes[str(s)] for s in x.shape) for x in spec.inputs]
    values = [
        (rng.standard_normal(s) / (1 if i == 0 else sizes["g"] ** 0.5)).astype(np.float32) for i, s in enumerate(shapes)
    ]
    leaves = [torch.tensor(v, requires_grad=True) for v in values]
    g = torch.randn(*(sizes[str(s)] for s in spec.output.shape))
    compiled = torch.compile(forward, fullgraph=True)
    runs = {
        "eager": lambda: torch.autograd.grad(forward(*leaves), leaves, g),
        "compile": lambda: torch.autograd.grad(compiled(*leaves), leaves, g),
    }
    want = runs["eager"]()
    for label, table in (("no sizes", None), ("--size", sizes)):
        numpy_module, torch_module = module(spec, "numpy", table), module(spec, "torch", table)
        got = torch.autograd.grad(torch_module.forward(*leaves), leaves, g)
        assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(got, want)), spec.name

        def numpy_run(m=numpy_module):
            _, saved = m.forward(*values)
            return m.backward(saved, g.numpy())

        runs[f"numpy {label}"] = numpy_run
        runs[f"torch {label}"] = lambda m=torch_module: torch.autograd.grad(m.forward(*leaves), leaves, g)
    return interleaved(runs, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--g", type=int, default=256)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    interleaved = runpy.run_path(str(ROOT / "benchmarks" / "gallery.py"))["interleaved"]
    sizes = {"n": args.n, "g": args.g, "d": args.d}
    print(f"n = {args.n}, g = {args.g}, d = {args.d}; forward + backward, ratio to torch eager autograd\n")
    print("| spec | generated at | numpy ÷ eager | torch ÷ eager | torch ÷ compile | eager (ms) | compile (ms) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, (spec, forward) in specs().items():
        best = timed(spec, forward, sizes, args.repeat, interleaved)
        for label in ("no sizes", "--size"):
            print(
                f"| {name} | {label} | {best[f'numpy {label}'] / best['eager']:.2f} | "
                f"{best[f'torch {label}'] / best['eager']:.2f} | {best[f'torch {label}'] / best['compile']:.2f} | "
                f"{best['eager'] * 1e3:.1f} | {best['compile'] * 1e3:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
