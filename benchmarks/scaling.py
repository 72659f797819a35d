"""How symattn's cost grows with the depth of a spec: stacks of L layers, L = 1, 2, 4, 8, 16.

Two families, each layer with its own weights: ``prenorm`` stacks pre-LN Transformer
blocks (``symattn.specs.block.transformer_block``, H = 4, renamed per layer) and
``residual`` stacks plain residual attention layers Y ← Y + softmax(Y W_Q (Y W_K)ᵀ/√g) Y W_V.
For every stack, each in a fresh interpreter (cold start, OMP_NUM_THREADS=1), it times

- ``derive``: ``symattn derive --spec-file F`` (every gradient, printed as text),
- ``verify``: ``symattn derive --spec-file F --verify``,
- ``generate``: ``symattn generate --spec-file F --out DIR`` (NumPy, PyTorch and JAX, each with the second
  closed form and the forward mode's JVP),
- ``import``: the first import of the generated modules,

each stopped at ``--cap`` seconds. It writes scaling.json, SCALING.md (tables and the
log-log slope of time against L over L = 2…16) and scaling.svg (a log-log plot, drawn
by plot.py) next to itself; ``--quick`` (L = 1, 2, 4) writes to a temporary folder instead.
``--label`` names the run in the JSON (default: the date; runs of other labels are kept, so two checkouts
compared with ``--src`` share one file), ``--src`` puts another checkout of symattn first on the path.

    python benchmarks/scaling.py [--quick] [--cap 120] [--label NAME] [--src DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPTHS = (1, 2, 4, 8, 16)
QUICK_DEPTHS = (1, 2, 4)
PHASES = ("derive", "verify", "generate", "import")
FAMILIES = ("prenorm", "residual")

PRENORM_SPEC = '''"""{L} pre-LN Transformer blocks (H = 4), each with its own weights (by benchmarks/scaling.py)."""

from sympy import MatrixSymbol

from symattn.specs import Spec, dim

D_K, D_MODEL = dim("d_k"), dim("d_model")  # d_k = d_model / 4: the generated modules read d_model off X
from symattn.specs.block import transformer_block

RENAMED = {{"W_1": "W_up", "W_2": "W_dn", "b_1": "b_up", "b_2": "b_dn"}}


def layer_name(name: str, i: int) -> str:
    """A weight's name in layer i: W_Q → W_Q3, gamma_1 → gamma_5 (LN₁ of layer 3), W_1 → W_up3."""
    if name.startswith(("gamma_", "beta_")):
        head, k = name.split("_")
        return f"{{head}}_{{2 * (i - 1) + int(k)}}"
    return RENAMED.get(name, name) + str(i)


def per_model_width(block: Spec) -> Spec:
    """The block with d_k written as d_model / 4."""
    width = {{D_K: D_MODEL / 4}}
    return Spec(block.name, block.summary, tuple(s.xreplace(width) for s in block.inputs),
                block.output.xreplace(width), tuple((k, e.xreplace(width)) for k, e in block.intermediates),
                block.options)


def stack(layers: int):
    """The blocks chained: layer i's X is layer i − 1's Z; every input and intermediate renamed per layer."""
    inputs, named, y, x0 = [], [], None, None
    for i in range(1, layers + 1):
        block = transformer_block(num_heads=4)
        if {BY_MODEL_WIDTH}:
            block = per_model_width(block)
        x = block.inputs[0]
        renames = {{s: MatrixSymbol(layer_name(s.name, i), *s.shape) for s in block.inputs[1:]}}
        if y is None:
            x0 = x
        else:
            renames[x] = y
        inputs += [renames[s] for s in block.inputs[1:]]
        for name, expr in block.intermediates:
            head = name[:-2] if name.endswith("_h") else name
            label = head.replace("_", "") + f"_{{i}}" + ("_h" if name.endswith("_h") else "")
            named.append((label, expr.xreplace(renames)))
        y = named[-1][1]
    return Spec(f"prenorm{{layers}}", f"{{layers}} pre-LN encoder layers", (x0, *inputs), y, tuple(named),
                dict(block.options))


spec = stack({L})
'''

RESIDUAL_SPEC = '''"""{L} residual attention layers Y ← Y + softmax(Y W_Q (Y W_K)ᵀ/√g) Y W_V (by scaling.py)."""

import sympy as sp

import symattn as sa
from symattn.specs import dim

n, g = dim("n"), dim("g")
X = sa.matrix("X", n, g)  # sa.matrix's operators build each node in constant time, at any depth
Y, inputs, named = X, [X], []
for i in range(1, {L} + 1):
    W_Q, W_K, W_V = (sa.matrix(f"W_{{p}}{{i}}", g, g) for p in "QKV")
    inputs += [W_Q, W_K, W_V]
    Q, K, V = Y * W_Q, Y * W_K, Y * W_V
    S = Q * K.T
    A = S / sp.sqrt(g)
    P = sa.softmax(A)
    Y = Y + P * V
    named += [(f"{{a}}_{{i}}", e) for a, e in zip("QKVSAPY", (Q, K, V, S, A, P, Y))]
spec = sa.Spec(f"residual{L}", "{L} residual attention layers", tuple(inputs), Y, tuple(named))
'''

IMPORT_MODULES = """import importlib.util, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""


def spec_source(family: str, layers: int, by_model_width: bool = False) -> str:
    """The spec file of a stack. by_model_width writes d_k as d_model / 4, for generate: a generated module
    reads its dimensions off the inputs' shapes and 4·d_k is none (the verifier draws d_k, so it takes 4·d_k)."""
    if family == "prenorm":
        return PRENORM_SPEC.format(L=layers, BY_MODEL_WIDTH=by_model_width)
    return RESIDUAL_SPEC.format(L=layers)


def timed(command: list[str], cap: float, env: dict) -> dict:
    """Seconds a fresh interpreter takes to run command, or the failure (timeout past cap, exit status)."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=cap)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "status": f"> {cap:g} s"}
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"seconds": None, "status": f"exit {done.returncode}: {tail[0][:120]}"}
    return {"seconds": round(seconds, 3), "status": "ok"}


def run_stack(family: str, layers: int, work: Path, cap: float, env: dict, skip: frozenset = frozenset()) -> dict:
    """Every phase for one stack; phases in skip (over the cap at a smaller depth) are not run."""
    spec_file = work / f"{family}{layers}.py"
    spec_file.write_text(spec_source(family, layers))
    generate_file = work / f"{family}{layers}_generate.py"
    generate_file.write_text(spec_source(family, layers, by_model_width=True))
    out_dir = work / f"{family}{layers}_modules"
    python = [sys.executable, "-m", "symattn"]
    commands = {
        "derive": [*python, "derive", "--spec-file", str(spec_file)],
        "verify": [*python, "derive", "--spec-file", str(spec_file), "--verify"],
        "generate": [*python, "generate", "--spec-file", str(generate_file), "--out", str(out_dir)],
    }
    skipped = {"seconds": None, "status": "over the cap at a smaller L"}
    results = {p: skipped if p in skip else timed(command, cap, env) for p, command in commands.items()}
    if results["generate"]["status"] == "ok":
        results["import"] = timed([sys.executable, "-c", IMPORT_MODULES, str(out_dir)], cap, env)
    else:
        results["import"] = {"seconds": None, "status": "not generated"}
    return results


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log t against log L over L ≥ 2 (None with fewer than two points)."""
    pts = [(math.log(x), math.log(y)) for x, y in points if x >= 2 and y]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx


def series(run: dict, family: str, phase: str) -> list[tuple[int, float]]:
    return [(int(k), v[phase]["seconds"]) for k, v in sorted(run[family].items(), key=lambda kv: int(kv[0]))]


def cell(entry: dict) -> str:
    return f"{entry['seconds']:.2f}" if entry["seconds"] is not None else entry["status"]


def markdown(results: dict) -> str:
    lines = ["# Scaling with the depth of a spec", "", "<!-- written by benchmarks/scaling.py; do not edit -->", ""]
    lines += [
        "Seconds per command in a fresh interpreter (cold start, one thread), for stacks of L layers:",
        "pre-LN Transformer blocks (H = 4) and residual attention layers. `derive` prints every gradient,",
        "`verify` checks every printed equality, `generate` writes the NumPy, PyTorch and JAX modules (second",
        "closed form and forward-mode JVP included), `import`",
        "is their first import. Slope: least squares of log t against log L over L = 2…16 (finished runs).",
        "",
    ]
    for label, run in results["runs"].items():
        meta = run.get("meta", {})
        command = f"`python benchmarks/scaling.py --cap {meta.get('cap', 120):g}`"
        lines += [
            f"## {label}",
            "",
            f"{meta.get('machine', '')}, cap {meta.get('cap', '?')} s per command; {command}.",
            "",
        ]
        for family in FAMILIES:
            if family not in run:
                continue
            depths = sorted(run[family], key=int)
            lines.append(f"| {family} | " + " | ".join(f"L={d}" for d in depths) + " | slope |")
            lines.append("|---" * (len(depths) + 2) + "|")
            for phase in PHASES:
                s = slope(series(run, family, phase))
                cells = " | ".join(cell(run[family][d][phase]) for d in depths)
                lines.append(f"| {phase} | {cells} | {'' if s is None else f'{s:.2f}'} |")
            lines.append("")
    return "\n".join(lines)


def svg(results: dict) -> str:
    """The log-log plot of seconds against L, by benchmarks/plot.py (which draws every benchmark's plot)."""
    sys.path.insert(0, str(HERE))
    import plot  # benchmarks/plot.py, beside this script

    return plot.scaling(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L = 1, 2, 4 only, written to a temporary folder")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds before a command is stopped")
    parser.add_argument("--label", default=str(datetime.date.today()), help="the run's name (default: today's date)")
    parser.add_argument("--src", help="a symattn checkout to put first on the path (e.g. the code before a change)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: prenorm, residual")
    parser.add_argument("--depths", help="comma-separated layer counts (default 1,2,4,8,16)")
    parser.add_argument("--out", help="folder for the results (default: next to this script)")
    args = parser.parse_args(argv)
    depths = QUICK_DEPTHS if args.quick else DEPTHS
    if args.depths:
        depths = tuple(int(d) for d in args.depths.split(","))
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="scaling_")) if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.src).resolve()), env.get("PYTHONPATH", "")])
    json_path = out / "scaling.json"
    results = json.loads(json_path.read_text()) if json_path.exists() else {"runs": {}}
    run: dict = {"meta": {"machine": f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}", "cap": args.cap}}
    results["runs"][args.label] = run
    with tempfile.TemporaryDirectory(prefix="scaling_work_") as work:
        for family in args.families.split(","):
            run[family] = {}
            for layers in depths:
                done = run[family].values()
                skip = frozenset(p for p in PHASES for r in done if r[p]["status"].startswith(("> ", "over")))
                run[family][str(layers)] = run_stack(family, layers, Path(work), args.cap, env, skip)
                row = ", ".join(f"{p} {cell(run[family][str(layers)][p])}" for p in PHASES)
                print(f"{args.label} {family} L={layers}: {row}", flush=True)
                json_path.write_text(json.dumps(results, indent=1) + "\n")
    (out / "SCALING.md").write_text(markdown(results))
    (out / "scaling.svg").write_text(svg(results))
    print(f"wrote {out}/scaling.json, SCALING.md, scaling.svg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
