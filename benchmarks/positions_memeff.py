"""A causal sliding window written as positions (``sa.entries``), memory-efficient modules: forward + backward against
plain attention, one thread.

The spec: softmax(Q Kᵀ/√d + W) V, W = [0 if 0 ≤ i − j < w else −∞] (``sa.entries``). Its memory-efficient torch and
NumPy modules compute each block of W from the block's positions and read only the keys its structure leaves the
block (``optimize.mask_structure``: rows r₀ … r₁ − 1 read keys r₀ − w + 1 … r₁ − 1). Timed against the standard
module of plain attention (``symattn.generated.attention_torch``/``_numpy``, no mask) and the window spec's
standard module (W made whole, n × m); and causal written as positions against the memory-efficient module's
causal=True. loss = ⟨G, output⟩; best of the rounds, the implementations taking turns. Target: window memeff
÷ plain ≤ 0.2 (torch, float32, n = 2048, w = 64). The error is against torch autograd of a float64 forward written
here.

    python benchmarks/positions_memeff.py [--n 2048] [--window 64] [--heads 4] [--d 64] [--repeats 5] [--write]

With ``--documents D`` instead: a document mask [0 if doc[i] = doc[j] else −∞] of D contiguous documents of unequal
lengths (ids per sequence, a constant read at positions: no analytic structure), the memory-efficient modules with
their block map per call (``optimize.block_tests``: the key blocks wholly masked skipped, the mask not looked up on
wholly open ones) and without it (the module's block_map replaced by an empty map: every block computed with the
mask), against plain attention; ``--write`` then writes that table into POSITIONS_MEMEFF.md's document section.

    python benchmarks/positions_memeff.py --documents 8 --n 4096 [--heads 4] [--d 64] [--repeats 3] [--write]
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import sympy as sp  # noqa: E402
import torch  # noqa: E402
from symattn.generated import attention_numpy, attention_torch, attention_torch_memeff  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.codegen import generate as codegen  # noqa: E402
from symattn.specs import dim  # noqa: E402


def window_spec(width: int | None) -> sa.Spec:
    """The causal window of width keys (None: every key up to the query's, causal)."""
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    seen = (lambda i, j: j <= i) if width is None else (lambda i, j: (j <= i) & (i - j < width))
    window = sa.entries(n, m, lambda i, j: sp.Piecewise((0, seen(i, j)), (-sp.oo, True)))
    output = sa.softmax(q * k.T / sp.sqrt(d) + window.expr) * v
    return sa.Spec(name="sliding_window", summary="a causal sliding window", inputs=(q, k, v), output=output)


def document_spec() -> sa.Spec:
    """softmax(Q Kᵀ/√d + [0 if doc[i, 0] = doc[j, 0] else −∞]) V, doc a constant (per sequence)."""
    n, d = dim("n"), dim("d")
    q, k, v, doc = (sp.MatrixSymbol(x, n, c) for x, c in (("Q", d), ("K", d), ("V", d), ("doc", 1)))
    same = sa.entries(n, n, lambda i, j: sp.Piecewise((0, sp.Eq(doc[i, 0], doc[j, 0])), (-sp.oo, True)))
    output = sa.softmax(q * k.T / sp.sqrt(d) + same.expr) * v
    return sa.Spec(name="documents", summary="a document mask", inputs=(q, k, v), output=output, constants=(doc,))


def module(spec: sa.Spec, backend: str, variant: str) -> types.ModuleType:
    made = types.ModuleType(f"{spec.name}_{backend}_{variant}")
    source = codegen.render(spec, backend, variant=variant, second_order=False)
    exec(compile(source, made.__name__, "exec"), made.__dict__)
    return made


def reference(q, k, v, width):
    """torch autograd of a plain forward: the window as a boolean mask (width None: causal)."""
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])[None, :]
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    seen = (j <= i) if width is None else (j <= i) & (i - j < width)
    return torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1) @ v


def torch_step(forward, extra):
    def step(q, k, v, g):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = forward(*leaves, **extra)
        return (out.detach(), *torch.autograd.grad(out, leaves, g))

    return step


def numpy_step(made, extra):
    def step(q, k, v, g):
        out, saved = made.forward(q.numpy(), k.numpy(), v.numpy(), **extra)
        grads = made.backward(saved, g.numpy())
        return tuple(torch.from_numpy(np.asarray(x)) for x in (out, grads["Q"], grads["K"], grads["V"]))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--documents", type=int, default=0, help="time a document mask of this many documents")
    parser.add_argument("--write", action="store_true", help="write POSITIONS_MEMEFF.md next to this script")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.documents:
        documents(args)
        return
    spec = window_spec(args.window)
    q, k, v, g = (torch.randn(args.heads, args.n, args.d) for _ in range(4))
    wanted = [x.detach() for x in _reference_grads(q, k, v, g, args.window)]
    causal = [x.detach() for x in _reference_grads(q, k, v, g, None)]
    memeff_torch, memeff_numpy = module(spec, "torch", "memeff"), module(spec, "numpy", "memeff")
    causal_torch = module(window_spec(None), "torch", "memeff")
    blocks = re.search(r"Option block_size \(default (\d+)\)", memeff_torch.__doc__).group(1)  # its header's
    cases = {
        "plain attention, torch standard (no mask)": torch_step(attention_torch.forward, {}),
        f"window, torch memeff (default block: {blocks} rows)": torch_step(memeff_torch.forward, {}),
        "window, torch memeff (block 128)": torch_step(memeff_torch.forward, {"block_size": 128}),
        "window, torch standard (W whole)": torch_step(module(spec, "torch", "standard").forward, {}),
        "plain attention, NumPy standard (no mask)": numpy_step(attention_numpy, {}),
        f"window, NumPy memeff (default block: {blocks} rows)": numpy_step(memeff_numpy, {}),
        "window, NumPy memeff (block 128)": numpy_step(memeff_numpy, {"block_size": 128}),
        "causal as positions, torch memeff": torch_step(causal_torch.forward, {}),
        "causal=True, torch memeff (the mask argument)": torch_step(attention_torch_memeff.forward, {"causal": True}),
    }
    best = dict.fromkeys(cases, math.inf)
    errors = {}
    for name, step in cases.items():  # a warm-up, and the error against the float64 reference
        got, want = step(q, k, v, g), causal if "causal" in name else wanted
        errors[name] = max(float((a.double() - w).abs().max() / w.abs().max()) for a, w in zip(got, want))
    for _ in range(args.repeats):
        for name, step in cases.items():
            start = time.perf_counter()
            step(q, k, v, g)
            best[name] = min(best[name], time.perf_counter() - start)
    rows = []
    for name in cases:
        plain = "plain attention, torch" if "torch" in name else "plain attention, NumPy"
        base = next(t for n, t in best.items() if n.startswith(plain))
        window = "—" if name.startswith("plain") else f"{errors[name]:.1e}"
        rows.append(f"| {name} | {best[name] * 1e3:.1f} | {best[name] / base:.3f} | {window} |")
    header = (
        f"{args.heads} heads × n = m = {args.n}, d = {args.d}, causal window w = {args.window}, float32, one thread; "
        f"forward + backward, best of {args.repeats}"
    )
    table = "\n".join(
        ["| case | ms | ÷ plain (same library) | largest relative error vs float64 |", "|---|---:|---:|---:|", *rows]
    )
    print(header)
    print(table)
    if args.write:
        _write(args, header, table)


def documents(args) -> None:
    """The document mask's table: the memory-efficient modules with and without their block map, plain attention."""
    cuts = torch.linspace(0, 1, args.documents + 1)[1:-1] ** 1.5  # unequal lengths, longer towards the end
    ids = torch.bucketize(torch.arange(args.n) / args.n, cuts, right=True).float()[:, None]
    q, k, v, g = (torch.randn(args.heads, args.n, args.d) for _ in range(4))
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    scores = leaves[0] @ leaves[1].mT / math.sqrt(args.d)
    out = torch.softmax(scores.masked_fill(ids != ids.mT, -math.inf), dim=-1) @ leaves[2]
    wanted = [out.detach(), *torch.autograd.grad(out, leaves, g.double())]
    del scores, out
    spec, docs = document_spec(), ids.expand(args.heads, -1, -1)  # (the ids of each sequence: the same here)
    made = {backend: module(spec, backend, "memeff") for backend in ("torch", "numpy")}
    unmapped = {backend: module(spec, backend, "memeff") for backend in ("torch", "numpy")}
    for each in unmapped.values():  # an empty map: every block computed, the mask looked up everywhere
        each.block_map = lambda test, reads, n, m, size, *rest: (size, [])
    cases = {
        "plain attention, torch standard (no mask)": torch_step(attention_torch.forward, {}),
        "documents, torch memeff, block map": torch_step(lambda *x: made["torch"].forward(*x, docs), {}),
        "documents, torch memeff, no block map": torch_step(lambda *x: unmapped["torch"].forward(*x, docs), {}),
        "plain attention, NumPy standard (no mask)": numpy_step(attention_numpy, {}),
        "documents, NumPy memeff, block map": _numpy_documents(made["numpy"], docs),
        "documents, NumPy memeff, no block map": _numpy_documents(unmapped["numpy"], docs),
    }
    best, errors = dict.fromkeys(cases, math.inf), {}
    for name, step in cases.items():  # a warm-up, and the error against the float64 reference
        if not name.startswith("plain"):
            got = step(q, k, v, g)
            errors[name] = max(float((a.double() - w).abs().max() / w.abs().max()) for a, w in zip(got, wanted))
        else:
            step(q, k, v, g)
    for _ in range(args.repeats):
        for name, step in cases.items():
            start = time.perf_counter()
            step(q, k, v, g)
            best[name] = min(best[name], time.perf_counter() - start)
    rows = []
    for name in cases:
        base = best[
            "plain attention, torch standard (no mask)"
            if "torch" in name
            else "plain attention, NumPy standard (no mask)"
        ]
        error = f"{errors[name]:.1e}" if name in errors else "—"
        rows.append(f"| {name} | {best[name] * 1e3:.1f} | {best[name] / base:.3f} | {error} |")
    lengths = torch.bincount(ids[:, 0].long()).tolist()
    header = (
        f"{args.heads} heads × n = m = {args.n}, d = {args.d}, {args.documents} documents of {lengths} tokens, "
        f"float32, one thread, default block (128 rows); forward + backward, best of {args.repeats}"
    )
    table = "\n".join(
        ["| case | ms | ÷ plain (same library) | largest relative error vs float64 |", "|---|---:|---:|---:|", *rows]
    )
    print(header)
    print(table)
    if args.write:
        _write_documents(header, table)


def _numpy_documents(made, ids):
    def step(q, k, v, g):
        out, saved = made.forward(q.numpy(), k.numpy(), v.numpy(), ids.numpy())
        grads = made.backward(saved, g.numpy())
        return tuple(torch.from_numpy(np.asarray(x)) for x in (out, grads["Q"], grads["K"], grads["V"]))

    return step


def machine_text() -> str:
    """The machine as the positions benchmarks' pages name it: its CPU, CPU count and torch build."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} CPU"


def _write_documents(header: str, table: str) -> None:
    """POSITIONS_MEMEFF.md with its document section (from its heading on) replaced by this run's."""
    path = Path(__file__).parent / "POSITIONS_MEMEFF.md"
    heading = "## A document mask: the block map per call"
    kept = path.read_text(encoding="utf-8").split(heading)[0].rstrip()
    command = "python benchmarks/positions_memeff.py " + " ".join(sys.argv[1:])
    machine = machine_text()
    text = (
        f"{kept}\n\n{heading}\n\n{datetime.date.today()}, {machine}: `{command}`. {header}. The ids are a constant "
        "read at positions, so the mask has no structure until they are read: the memory-efficient modules compute "
        "per call a block map from each block's least and greatest id (`symattn/optimize/block_tests.py`), read only "
        "the keys from a block of rows' first to its last key block not wholly masked, and look the mask up only "
        'outside the wholly open key blocks; "no block map" is the same module with an empty map.\n\n'
        f"{table}\n"
    )
    path.write_text(text, encoding="utf-8")


def _reference_grads(q, k, v, g, width):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out = reference(*leaves, width)
    return (out, *torch.autograd.grad(out, leaves, g.double()))


def _write(args, header: str, table: str) -> None:
    command = "python benchmarks/positions_memeff.py " + " ".join(sys.argv[1:])
    machine = machine_text()
    text = (
        "# Positions in the memory-efficient modules: a sliding window\n\n"
        f"{datetime.date.today()}, {machine}: `{command}`. {header}. The window W = [0 if 0 ≤ i − j < w else −∞] "
        "is `sa.entries`; the memory-efficient modules compute each block of W from its positions and read only "
        "the keys r₀ − w + 1 … r₁ − 1 its structure leaves a block of rows r₀ … r₁ − 1 "
        "(`symattn/optimize/mask_structure.py`). Target: torch window memeff ÷ plain ≤ 0.2.\n\n"
        f"{table}\n"
    )
    (Path(__file__).parent / "POSITIONS_MEMEFF.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
