"""Side by side (issue 27): symattn's attention modules against SDPA, torch.compile and JAX jit, one thread.

One step is forward + backward of attention with queries, keys and values of shape B × H × n × d (one head
per B × H slice, d = 64), loss = ⟨G, output⟩, with and without a causal mask:

- ``sdpa``: ``F.scaled_dot_product_attention(is_causal=…)``, torch's fused kernel (the yardstick);
- ``compile``: ``torch.compile(fullgraph=True)`` of a plain torch forward softmax(Q Kᵀ / √d + M) V
  (compiled once per case, before timing);
- ``jax``: ``jax.jit`` of ``jax.vjp`` of the same forward in jnp;
- ``numpy``, ``torch``, ``numpy_memeff``, ``torch_memeff``: ``symattn.generated.attention_<backend>[_memeff]``
  with ``causal=…`` (NumPy: ``forward`` then ``backward(saved, G)``; torch: autograd through the Function).

Time: the best of ``--repeats`` rounds, the runs taking turns in each (the gallery benchmark's harness),
reported as ms for SDPA and as a ratio to SDPA for the others. Extra memory of one step, inputs excluded
(output and gradients included): ``tracemalloc`` for NumPy, the torch profiler's memory events for torch
(both as benchmarks/run.py measures them), XLA's buffer assignment (temporaries and outputs) for JAX.
Correctness, once per case: every output and gradient against SDPA's in the same dtype, the largest
relative error printed; the exit status is 1 when one is over the dtype's tolerance.

``--gallery`` adds a second table: every spec of examples/specs/ (benchmarks/gallery.py's inputs, forwards
and ``bench``, one sequence, float32, n = 1024 and 4096) with its generated NumPy and torch modules and eager
autograd as a ratio to ``torch.compile`` of its own forward; each spec with a softmax also with the causal mask
(``sa.with_mask``, the modules called with ``causal=True``).

    python benchmarks/attention_grid.py [--dtype float32|float64|both] [--only 1x8x1024] [--repeats 5]
                                        [--gallery] [--quick] [--write]

``--write`` writes ATTENTION_GRID.md and attention_grid.json next to this file; without it nothing is written.
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"  # before NumPy, torch and JAX start their thread pools
os.environ["XLA_FLAGS"] = " ".join(
    (os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from symattn.generated import (  # noqa: E402
    attention_numpy,
    attention_numpy_memeff,
    attention_torch,
    attention_torch_memeff,
)

from symattn.specs.files import load_spec_file  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import implementations as impl  # noqa: E402  (benchmarks/: the runners and how they measure memory)

torch.set_num_threads(1)
# the gallery benchmark: its harness (best seconds of each run, the runs taking turns in every round), its specs
GALLERY = runpy.run_path(str(HERE / "gallery.py"))
interleaved = GALLERY["interleaved"]
machine = runpy.run_path(str(HERE / "run.py"))["machine"]  # CPU, versions, threads

try:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # float64 cases; float32 inputs stay float32
except ImportError:  # the other implementations are still timed
    jax = jnp = None

SHAPES = ((1, 8, 1024, 64), (1, 2, 4096, 64), (4, 8, 512, 64), (1, 1, 8192, 64))  # B, H, n, d
QUICK_SHAPES = ((1, 2, 64, 16),)
GALLERY_SIZES, QUICK_GALLERY_SIZES = ((1024, 64), (4096, 64)), ((64, 16),)  # n, d = d_model = d_k = d_v
IMPLEMENTATIONS = ("sdpa", "compile", "jax", "numpy", "torch", "numpy_memeff", "torch_memeff")
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}  # largest error relative to the largest entry of SDPA's
# gallery, float32 against float64 autograd: a scalar's gradient sums n² terms (float32 autograd's own error
# on temperature_attention's tau is 9e-5 at n = 4096)
GALLERY_TOLERANCE = 1e-3


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    n: int
    d: int
    causal: bool
    dtype: str

    @property
    def shape(self) -> str:
        return f"{self.batch}×{self.heads}×{self.n}"

    @property
    def name(self) -> str:
        """What --only matches: e.g. ``1x8x1024 causal float32`` (× or x)."""
        return f"{self.batch}x{self.heads}x{self.n} {'causal' if self.causal else 'no mask'} {self.dtype}"


def plain_torch_forward(causal: bool):
    """softmax(Q Kᵀ / √d + M) V, M = −∞ above the diagonal when causal (else 0), written directly in torch."""

    def forward(q, k, v):
        scores = q @ k.mT / math.sqrt(q.shape[-1])
        if causal:
            n, m = scores.shape[-2:]
            scores = scores + torch.full((n, m), float("-inf"), dtype=q.dtype).triu(1)
        return torch.softmax(scores, dim=-1) @ v

    return forward


def plain_jax_forward(causal: bool):
    """The same forward in jnp."""

    def forward(q, k, v):
        scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            n, m = scores.shape[-2:]
            scores = scores + jnp.where(jnp.triu(jnp.ones((n, m), bool), 1), -jnp.inf, 0.0).astype(q.dtype)
        return jax.nn.softmax(scores, axis=-1) @ v

    return forward


class JaxRunner:
    """jax.jit of jax.vjp of a jnp forward: one call gives the output and the gradients for G."""

    def __init__(self, forward, data: dict) -> None:
        def step(q, k, v, g):
            out, pullback = jax.vjp(forward, q, k, v)
            return out, *pullback(g)

        self.args = [jnp.asarray(data[k]) for k in ("Q", "K", "V", "G")]
        self.compiled = jax.jit(step).lower(*self.args).compile()  # compiled once, before timing

    def step(self) -> None:
        jax.block_until_ready(self.compiled(*self.args))

    def result(self) -> dict[str, np.ndarray]:
        out, *grads = self.compiled(*self.args)
        return {"out": np.asarray(out, np.float64), **{k: np.asarray(g, np.float64) for k, g in zip("QKV", grads)}}

    def peak_memory(self) -> int | None:
        """XLA's buffer assignment: temporaries plus outputs (the inputs are excluded, as for the others)."""
        analysis = self.compiled.memory_analysis()
        return None if analysis is None else analysis.temp_size_in_bytes + analysis.output_size_in_bytes


def make_data(case: Case) -> dict[str, np.ndarray]:
    """Q, K, V and the cotangent G, standard normal, drawn once per case."""
    rng = np.random.default_rng(20261126)
    shape = (case.batch, case.heads, case.n, case.d)
    return {k: rng.standard_normal(shape).astype(case.dtype) for k in ("Q", "K", "V", "G")}


def runners(case: Case, data: dict) -> dict:
    """Each implementation's runner (step, result, peak_memory), in IMPLEMENTATIONS' order, jax left out if absent."""

    def torch_runner(forward):
        leaves = {k: torch.from_numpy(data[k]).requires_grad_(True) for k in ("Q", "K", "V")}
        return impl.TorchRunner(forward, leaves, torch.from_numpy(data["G"]))

    def numpy_runner(module):
        runner = impl.NumPyRunner(module, impl_case, data)
        runner.options = {"causal": case.causal}
        return runner

    def generated_torch(module):
        return torch_runner(lambda q, k, v: module.forward(q, k, v, causal=case.causal))

    impl_case = types.SimpleNamespace(heads=0)  # NumPyRunner's view of a case: inputs Q, K, V, no heads
    torch._dynamo.reset()  # a fresh compile for each case's shape and dtype
    made = {
        "sdpa": torch_runner(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)),
        "compile": torch_runner(torch.compile(plain_torch_forward(case.causal), fullgraph=True)),
        "jax": JaxRunner(plain_jax_forward(case.causal), data) if jax is not None else None,
        "numpy": numpy_runner(attention_numpy),
        "torch": generated_torch(attention_torch),
        "numpy_memeff": numpy_runner(attention_numpy_memeff),
        "torch_memeff": generated_torch(attention_torch_memeff),
    }
    return {name: runner for name, runner in made.items() if runner is not None}


def run_case(case: Case, repeats: int) -> dict:
    """Errors against SDPA (which also compiles and warms every run), best times, peak extra memory."""
    data = make_data(case)
    made = runners(case, data)
    reference = made["sdpa"].result()
    errors = {name: impl.max_relative_error(runner.result(), reference) for name, runner in made.items()}
    times = interleaved({name: runner.step for name, runner in made.items()}, repeats)
    memory = {name: runner.peak_memory() for name, runner in made.items()}
    results = {
        name: {
            "time_s": times[name],
            "ratio": times[name] / times["sdpa"],
            "peak_extra_mib": None if memory[name] is None else memory[name] / 2**20,
            "max_rel_error": errors[name],
        }
        for name in made
    }
    worst = max(e for name, e in errors.items() if name != "sdpa")
    return {**asdict(case), "results": results, "max_rel_error": worst, "ok": worst <= TOLERANCE[case.dtype]}


def _cell(row: dict, name: str, field: str, spec: str) -> str:
    value = row["results"].get(name, {}).get(field)
    return "–" if value is None else format(value, spec)


def time_header(names) -> list[str]:
    columns = " | ".join(names[1:])
    rule = "---:|" * len(names)
    return [f"| B×H×n | causal | dtype | SDPA (ms) | {columns} | largest error |", f"|---|---|---|{rule}---:|"]


def time_line(row: dict, names) -> str:
    ratios = " | ".join(_cell(row, name, "ratio", ".2f") for name in names[1:])
    case = Case(*(row[k] for k in ("batch", "heads", "n", "d", "causal", "dtype")))
    sdpa = row["results"]["sdpa"]["time_s"] * 1e3
    flag = "" if row["ok"] else " (over tolerance)"
    return (
        f"| {case.shape} | {'yes' if case.causal else 'no'} | {case.dtype} | {sdpa:.1f} | {ratios} | "
        f"{row['max_rel_error']:.1e}{flag} |"
    )


def memory_lines(rows: list[dict], names) -> list[str]:
    lines = [
        f"| B×H×n | causal | dtype | {' | '.join(names)} |",
        "|---|---|---|" + "---:|" * len(names),
    ]
    for row in rows:
        case = Case(*(row[k] for k in ("batch", "heads", "n", "d", "causal", "dtype")))
        cells = " | ".join(_cell(row, name, "peak_extra_mib", ".1f") for name in names)
        lines.append(f"| {case.shape} | {'yes' if case.causal else 'no'} | {case.dtype} | {cells} |")
    return lines


GALLERY_HEADER = [
    "| spec | n | causal | compile (ms) | numpy | torch | autograd | largest error |",
    "|---|---:|---|---:|---:|---:|---:|---:|",
]


def gallery_line(row: dict) -> str:
    """One gallery spec at one n: torch.compile's ms, the others' time as a ratio to it."""
    ratios = " | ".join(f"{row[k] / row['compile']:.2f}" for k in ("numpy", "torch"))
    compiled_ms = row["autograd_ms"] * row["compile"]
    causal = "yes" if row["causal"] else "no"
    return (
        f"| {row['spec']} | {row['n']} | {causal} | {compiled_ms:.1f} | {ratios} | {1 / row['compile']:.2f} "
        f"| {row['error']:.1e} |"
    )


def gallery_cases(args: argparse.Namespace) -> list[tuple[str, int, int, bool]]:
    """(spec, n, d, causal) for every gallery spec at every size, causal too where the spec has a softmax
    (``sa.with_mask``), whose name (e.g. 'sigmoid_attention n=1024', 'softcap_attention n=4096 causal') --only
    takes."""
    sizes = QUICK_GALLERY_SIZES if args.quick else GALLERY_SIZES
    names = sorted(GALLERY["TESTS"]["REFERENCES"])
    maskable = {name: GALLERY["maskable"](load_spec_file(ROOT / "examples" / "specs" / f"{name}.py")) for name in names}
    every = [(name, n, d, c) for n, d in sizes for name in names for c in (False, True) if maskable[name] or not c]
    return [case for case in every if (args.only or "") in _gallery_name(*case)]


def _gallery_name(name: str, n: int, d: int, causal: bool) -> str:
    return f"{name} n={n}" + " causal" * causal


def markdown(rows: list[dict], gallery_rows: list[dict], names, about: dict, args, seconds: float) -> str:
    """ATTENTION_GRID.md: how it was run, the grid's times and memory, the gallery's times."""
    m = about["machine"]
    flags = [f"--dtype {args.dtype}"] * (args.dtype != "both") + ["--gallery"] * args.gallery
    flags += [f"--only '{args.only}'"] * bool(args.only) + ["--quick"] * args.quick
    lines = [
        "# Attention side by side: symattn against SDPA, torch.compile and JAX (one thread)",
        "",
        f"Written by `{' '.join(['python benchmarks/attention_grid.py --write', *flags])}` ({about['date']}, "
        f"{seconds / 60:.1f} min; best of {args.repeats} rounds, the runs taking turns).",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, one thread; Python {m['python']}, "
        f"NumPy {m['numpy']}, torch {m['torch']}, JAX {about['jax']}.",
    ]
    if rows:
        lines += [
            "",
            "Forward + backward of attention on B × H × n × d inputs (d = 64), loss = ⟨G, output⟩. sdpa:",
            "`F.scaled_dot_product_attention`; compile: `torch.compile(fullgraph=True)` of softmax(Q Kᵀ / √d + M) V;",
            "jax: `jax.jit` of `jax.vjp` of the same forward in jnp; numpy, torch and their memeff variants:",
            "`symattn.generated.attention_*` with `causal`. Time: ms for SDPA, a ratio to SDPA for the others",
            "(< 1: faster). Largest error: output and gradients against SDPA's, relative to the largest entry.",
            "",
            *time_header(names),
            *(time_line(row, names) for row in rows),
            "",
            "Peak extra memory of one step (MiB), inputs excluded, output and gradients included: tracemalloc",
            "(NumPy), the torch profiler's memory events (torch), XLA's temporaries and outputs (JAX).",
            "",
            *memory_lines(rows, names),
        ]
    if gallery_rows:
        lines += [
            "",
            "## Gallery",
            "",
            "Every spec of examples/specs/ (benchmarks/gallery.py's inputs and forwards: one sequence, float32,",
            f"d = d_model = d_k = d_v = {gallery_rows[0]['d']}): the generated NumPy and torch modules and eager "
            "torch autograd, as a",
            "ratio to `torch.compile(fullgraph=True)` of the same forward. Causal rows: the spec with a mask",
            "(`sa.with_mask`), the modules called with `causal=True`, the forward with the causal mask added to its",
            "softmaxes' scores. Largest error: every output and gradient against float64 autograd.",
            "",
            *GALLERY_HEADER,
            *(gallery_line(row) for row in gallery_rows),
        ]
    return "\n".join(lines) + "\n"


def cases(args: argparse.Namespace) -> list[Case]:
    dtypes = ("float32", "float64") if args.dtype == "both" else (args.dtype,)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    every = [Case(*shape, causal, dtype) for dtype in dtypes for shape in shapes for causal in (False, True)]
    wanted = (args.only or "").replace("×", "x")
    return [case for case in every if wanted in case.name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "float64", "both"), default="both")
    parser.add_argument(
        "--only", help="the cases whose name ('1x8x1024 causal float32', 'sigmoid_attention n=1024') contains this"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 5; 2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--gallery", action="store_true", help="also every gallery spec against torch.compile")
    parser.add_argument("--write", action="store_true", help="write ATTENTION_GRID.md and attention_grid.json")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    chosen, gallery = cases(args), gallery_cases(args) if args.gallery else []
    if not chosen and not gallery:
        parser.error(f"no case matches --only {args.only!r}")
    names = [name for name in IMPLEMENTATIONS if name != "jax" or jax is not None]
    start = time.perf_counter()
    rows, gallery_rows, failed = [], [], []
    if chosen:
        print("\n".join(time_header(names)), flush=True)
    for case in chosen:
        rows.append(run_case(case, args.repeats))
        print(time_line(rows[-1], names), flush=True)
        failed += [] if rows[-1]["ok"] else [case.name]
    if rows:
        print("\nPeak extra memory (MiB), inputs excluded:\n" + "\n".join(memory_lines(rows, names)))
    if gallery:
        print("\nGallery, float32, one sequence: time as a ratio to torch.compile of the same forward", flush=True)
        print("\n".join(GALLERY_HEADER), flush=True)
    for name, n, d, causal in gallery:
        timed = GALLERY["bench"](name, n, d, args.repeats, compiled=True, causal=causal)
        gallery_rows.append({"n": n, "d": d, "causal": causal, **timed})
        print(gallery_line(gallery_rows[-1]), flush=True)
        failed += [] if gallery_rows[-1]["error"] <= GALLERY_TOLERANCE else [_gallery_name(name, n, d, causal)]
    seconds = time.perf_counter() - start
    worst = max([row["max_rel_error"] for row in rows] + [row["error"] for row in gallery_rows])
    verdict = f"over tolerance: {', '.join(failed)}" if failed else "every implementation within tolerance"
    print(f"\ncorrectness: {verdict} (largest relative error {worst:.1e})")
    print(f"{len(rows) + len(gallery_rows)} cases in {seconds:.0f} s")
    about = {"machine": machine(), "jax": getattr(jax, "__version__", None), "date": time.strftime("%Y-%m-%d")}
    if args.write:
        (HERE / "ATTENTION_GRID.md").write_text(markdown(rows, gallery_rows, names, about, args, seconds))
        record = {**about, "repeats": args.repeats, "quick": args.quick, "seconds": seconds}
        record |= {"cases": rows, "gallery": gallery_rows}
        (HERE / "attention_grid.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {HERE / 'ATTENTION_GRID.md'} and {HERE / 'attention_grid.json'}")
    else:
        print("nothing written (add --write to write ATTENTION_GRID.md and attention_grid.json)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
