"""Gallery benchmark: every spec of examples/specs, generated (NumPy and torch), against torch autograd
of the independently written forward of tests/integration/test_gallery.py, in the same run.

    OMP_NUM_THREADS=1 python benchmarks/gallery.py [--n 1024] [--d 64] [--d-model 256] [--compile] [--repeat 25]
        [--only NAME]

One thread, float32, one sequence (no batch), n tokens, d = d_model = d_k = d_v. For each spec it
prints the largest error of output and gradients against autograd (relative to the largest entry)
and forward+backward time as a ratio to autograd's (best of --repeat rounds, the three taking turns in
each), and writes the table to benchmarks/GALLERY.md (not with --only, which times one spec).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from symattn.codegen.generate import render
from symattn.specs.files import load_spec_file
from symattn.specs.masking import with_mask

ROOT = Path(__file__).resolve().parents[1]
# the gallery's references and the masked forward: real modules, whose functions torch.compile traces
sys.path.insert(0, str(ROOT / "tests" / "integration"))
import test_gallery  # noqa: E402
from masked_reference import causal_forward, maskable  # noqa: E402, F401 (maskable: attention_grid reads it here)

TESTS = vars(test_gallery)


def sizes(n: int, d: int, d_model: int | None = None) -> dict[int, int]:
    """The test's small sizes (B, N, D_MODEL, D_K, D_V) mapped to the benchmark's (no batch); the model width
    d_model is d unless given."""
    width = d if d_model is None else d_model
    return {TESTS["B"]: None, TESTS["N"]: n, TESTS["D_MODEL"]: width, TESTS["D_K"]: d, TESTS["D_V"]: d, 1: 1}


def interleaved(runs: dict, repeat: int) -> dict[str, float]:
    """Best seconds of each run over ``repeat`` rounds (after one warm-up round), the runs taking turns in
    each round, so that load from elsewhere falls on all of them alike."""
    best = {name: float("inf") for name in runs}
    for round_ in range(repeat + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the largest finite entry of want (at least 1); equal entries differ by 0
    (−inf log-probabilities of keys a mask hides), and a NaN where want has none gives inf."""
    difference = np.where(got == want, 0.0, np.abs(got.astype(np.float64) - want))
    largest = float(np.max(difference, initial=0.0))
    return (np.inf if np.isnan(largest) else largest) / max(float(np.abs(want[np.isfinite(want)]).max(initial=0)), 1.0)


def bench(
    name: str,
    n: int,
    d: int,
    repeat: int,
    spec=None,
    compiled: bool = False,
    causal: bool = False,
    d_model: int | None = None,
) -> dict:
    """Errors and times of the gallery spec called name (or of spec, a respelling of it: same inputs);
    compiled: also torch.compile(fullgraph=True) of the same forward (compiled before timing); causal: the spec
    with_mask, the generated modules called with causal=True, the reference with the causal mask added to its
    softmaxes' scores (MaskedSoftmax)."""
    shapes, reference = TESTS["REFERENCES"][name]
    options = {"causal": True} if causal else {}
    if causal:
        reference = causal_forward(reference, n)
    table = sizes(n, d, d_model)
    rng = np.random.default_rng(0)
    values = {}
    for k, shape in shapes.items():
        shape = tuple(table[s] for s in shape if table[s] is not None)
        scale = 1.0 if k == "X" or k.startswith(("gamma", "beta")) else 0.5 / d**0.25
        values[k] = np.asarray(rng.standard_normal(shape) * scale + (0.8 if not shape else 0.0), dtype=np.float32)
    spec = spec or load_spec_file(ROOT / "examples" / "specs" / f"{name}.py")
    spec = with_mask(spec) if causal else spec
    modules = {}
    for backend in ("numpy", "torch"):
        made = types.ModuleType(f"{name}_{backend}")
        exec(compile(render(spec, backend), made.__name__, "exec"), made.__dict__)
        modules[backend] = made
    leaves = [torch.tensor(v, requires_grad=True) for v in values.values()]
    out = reference(*leaves)
    g = torch.tensor(rng.standard_normal(tuple(out.shape)).astype(np.float32))

    def autograd():
        return torch.autograd.grad(reference(*leaves), leaves, g)

    def generated_torch():
        return torch.autograd.grad(modules["torch"].forward(*leaves, **options), leaves, g)

    def generated_numpy():
        y, saved = modules["numpy"].forward(*values.values(), **options)
        return y, modules["numpy"].backward(saved, g.numpy())

    # errors in float64 against float64 autograd
    wide = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values.values()]
    want_out = reference(*wide)
    want = torch.autograd.grad(want_out, wide, g.double())
    y, grads = generated_numpy()
    got_t = generated_torch()
    error = relative(y, want_out.detach().numpy())
    for i, k in enumerate(values):
        error = max(error, relative(grads[k], want[i].numpy()), relative(got_t[i].numpy(), want[i].numpy()))
    runs = {"autograd": autograd, "numpy": generated_numpy, "torch": generated_torch}
    if compiled:  # torch.compile of the same forward, compiled and checked before timing
        torch._dynamo.reset()  # a fresh compile for this spec and size
        fast = torch.compile(reference, fullgraph=True)

        def compiled_forward():
            out = fast(*leaves)
            return out, torch.autograd.grad(out, leaves, g)

        runs["compile"] = compiled_forward
        out, got = compiled_forward()
        for value, ref in zip((out, *got), (want_out, *want)):
            error = max(error, relative(value.detach().numpy(), ref.detach().numpy()))
    times = interleaved(runs, repeat)
    base = times["autograd"]
    return {
        "spec": name,
        "error": error,
        **{k: times[k] / base for k in runs if k != "autograd"},
        "autograd_ms": base * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=25)
    parser.add_argument("--d-model", type=int, help="the model width (default: d); with it, no table is written")
    parser.add_argument("--compile", action="store_true", help="also torch.compile(fullgraph=True) of the forward")
    parser.add_argument("--only", action="append", help="time only this spec (repeatable); writes no table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.only or sorted(TESTS["REFERENCES"])
    rows = [bench(name, args.n, args.d, args.repeat, compiled=args.compile, d_model=args.d_model) for name in names]
    lines = [
        f"# Gallery: generated vs torch autograd (n={args.n}, d={args.d}, d_model={args.d_model or args.d}, float32,"
        " one thread)",
        "",
        f"Written by `OMP_NUM_THREADS=1 python benchmarks/gallery.py` ({time.strftime('%Y-%m-%d')}; "
        f"{platform.processor() or platform.machine()}; Python {platform.python_version()}, NumPy {np.__version__}, "
        f"torch {torch.__version__}).",
        "",
        "Error: largest difference of output and",
        "gradients (both backends, float32) from float64 autograd, relative to the largest entry. Time: forward +",
        f"backward, best of {args.repeat} rounds (autograd, NumPy and torch taking turns), as a ratio to torch",
        "autograd's in the same run (< 1: faster).",
        "",
        "| spec | largest error | numpy / autograd | torch / autograd | autograd (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['spec']} | {r['error']:.1e} | {r['numpy']:.2f} | {r['torch']:.2f} | {r['autograd_ms']:.0f} |"
        )
    if args.compile:
        lines += ["", "| spec | numpy / compile | torch / compile |", "|---|---|---|"]
        lines += [f"| {r['spec']} | {r['numpy'] / r['compile']:.2f} | {r['torch'] / r['compile']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if not (args.only or args.d_model or args.compile):
        (ROOT / "benchmarks" / "GALLERY.md").write_text(text)


if __name__ == "__main__":
    main()
