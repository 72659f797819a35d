"""A deep stack's generated modules against torch: L pre-LN Transformer blocks (H = 4), each its own weights.

The stack is ``benchmarks/scaling.py``'s spec file (``prenorm``, L layers), generated with
``symattn generate --spec-file`` (NumPy and PyTorch). For it, this script

- checks the output and every gradient of both generated stacks, in float64, against torch
  autograd of an independently written stack: L ``torch.nn.TransformerEncoderLayer(norm_first=True,
  activation="gelu", dropout=0.0, batch_first=True)`` in an ``nn.Sequential``, the weights mapped
  onto symattn's layout (W_Q = ``in_proj_weight[:E]``ᵀ, b_Q = ``in_proj_bias[:E]`` as a row, γ₁ =
  ``norm1.weight``, W_up = ``linear1.weight``ᵀ, …);
- times forward+backward in float32, one thread (median of ``--repeats``): the generated stack, the
  same L blocks run one after another through the built-in ``transformer_block`` module (the sum of
  L single-block modules; ratio stack / blocks, target ≤ 1.1), both backends, and torch autograd of
  the nn stack.

    python benchmarks/deep_stack.py [--layers 12] [--batch 2] [--n 128] [--d-model 256] [--repeats 7]

It writes DEEP_STACK.md and deep_stack.json next to itself; ``--quick`` (2 layers, small sizes) writes
to a temporary folder instead.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402 (after the thread settings: NumPy reads them on import)
import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
HEADS = 4
EPS = 1e-5
# a block's inputs after X, in the spec's order; the stack's layer i renames them (scaling.layer_name)
BLOCK = "W_Q W_K W_V W_O gamma_1 beta_1 gamma_2 beta_2 W_1 W_2 b_Q b_K b_V b_O b_1 b_2".split()
BIASES = ("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate_stack(layers: int, out: Path, order: int = 2) -> tuple[object, object]:
    """The generated (numpy, torch) modules of the L-layer stack, written under out."""
    from symattn.codegen.generate import generate
    from symattn.specs.files import load_spec_file

    scaling = _load(HERE / "scaling.py")
    spec_file = out / f"prenorm{layers}.py"
    spec_file.write_text(scaling.spec_source("prenorm", layers, by_model_width=True))
    generate([load_spec_file(spec_file)], ["numpy", "torch"], out=out, order=order)
    return _load(out / f"prenorm{layers}_numpy.py"), _load(out / f"prenorm{layers}_torch.py")


def reference_stack(layers: int, d_model: int, dtype: torch.dtype, seed: int = 0) -> torch.nn.Sequential:
    """L torch encoder layers (pre-LN, exact GELU, no dropout) with random weights of the usual scale."""
    torch.manual_seed(seed)
    stack = torch.nn.Sequential(
        *(
            torch.nn.TransformerEncoderLayer(
                d_model,
                HEADS,
                4 * d_model,
                dropout=0.0,
                activation="gelu",
                layer_norm_eps=EPS,
                batch_first=True,
                norm_first=True,
                dtype=dtype,
            )
            for _ in range(layers)
        )
    )
    with torch.no_grad():  # biases and LayerNorm parameters away from their 0 and 1, so each is tested
        for name, p in stack.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return stack.eval()


def symattn_weights(layer: torch.nn.TransformerEncoderLayer) -> dict[str, torch.Tensor]:
    """One torch layer's parameters in symattn's layout (math convention: rows are tokens), by block name."""
    attn = layer.self_attn
    w_q, w_k, w_v = attn.in_proj_weight.detach().chunk(3)
    b_q, b_k, b_v = attn.in_proj_bias.detach().chunk(3)
    row = lambda t: t.detach()[None]  # noqa: E731
    return {
        "W_Q": w_q.T, "W_K": w_k.T, "W_V": w_v.T, "W_O": attn.out_proj.weight.detach().T,
        "b_Q": b_q[None], "b_K": b_k[None], "b_V": b_v[None], "b_O": row(attn.out_proj.bias),
        "gamma_1": row(layer.norm1.weight), "beta_1": row(layer.norm1.bias),
        "gamma_2": row(layer.norm2.weight), "beta_2": row(layer.norm2.bias),
        "W_1": layer.linear1.weight.detach().T, "b_1": row(layer.linear1.bias),
        "W_2": layer.linear2.weight.detach().T, "b_2": row(layer.linear2.bias),
    }  # fmt: skip


def symattn_gradients(layer: torch.nn.TransformerEncoderLayer) -> dict[str, torch.Tensor]:
    """The torch layer's parameter gradients in symattn's layout, by block name."""
    attn = layer.self_attn
    g_q, g_k, g_v = attn.in_proj_weight.grad.chunk(3)
    c_q, c_k, c_v = attn.in_proj_bias.grad.chunk(3)
    return {
        "W_Q": g_q.T, "W_K": g_k.T, "W_V": g_v.T, "W_O": attn.out_proj.weight.grad.T,
        "b_Q": c_q[None], "b_K": c_k[None], "b_V": c_v[None], "b_O": attn.out_proj.bias.grad[None],
        "gamma_1": layer.norm1.weight.grad[None], "beta_1": layer.norm1.bias.grad[None],
        "gamma_2": layer.norm2.weight.grad[None], "beta_2": layer.norm2.bias.grad[None],
        "W_1": layer.linear1.weight.grad.T, "b_1": layer.linear1.bias.grad[None],
        "W_2": layer.linear2.weight.grad.T, "b_2": layer.linear2.bias.grad[None],
    }  # fmt: skip


def stack_name(name: str, i: int) -> str:
    """A block input's name in layer i of the stack (as benchmarks/scaling.py writes it)."""
    if name.startswith(("gamma_", "beta_")):
        head, k = name.split("_")
        return f"{head}_{2 * (i - 1) + int(k)}"
    return {"W_1": "W_up", "W_2": "W_dn", "b_1": "b_up", "b_2": "b_dn"}.get(name, name) + str(i)


class Runs:
    """Forward+backward of one stack four ways, on the same inputs: each returns (output, {name: gradient})
    with the stack's input names (X, W_Q1, …)."""

    def __init__(self, stack: torch.nn.Sequential, x: torch.Tensor, g: torch.Tensor, modules: dict):
        self.stack, self.x, self.g, self.m = stack, x, g, modules
        self.layers = [symattn_weights(layer) for layer in stack]
        self.names = ["X"] + [stack_name(k, i) for i in range(1, len(stack) + 1) for k in BLOCK]
        self.values = [x] + [w[k] for w in self.layers for k in BLOCK]

    def torch_autograd(self) -> tuple[torch.Tensor, dict]:
        self.stack.zero_grad(set_to_none=True)
        x = self.x.detach().requires_grad_()
        out = self.stack(x)
        out.backward(self.g)
        grads = {"X": x.grad}
        for i, layer in enumerate(self.stack, 1):
            grads |= {stack_name(k, i): v for k, v in symattn_gradients(layer).items()}
        return out.detach(), grads

    def _leaves(self) -> list[torch.Tensor]:
        return [v.detach().clone().requires_grad_() for v in self.values]

    def torch_stack(self) -> tuple[torch.Tensor, dict]:
        leaves = self._leaves()
        out = self.m["torch_stack"].forward(*leaves)
        out.backward(self.g)
        return out.detach(), {n: v.grad for n, v in zip(self.names, leaves)}

    def torch_blocks(self) -> tuple[torch.Tensor, dict]:
        leaves = self._leaves()
        y, block = leaves[0], self.m["torch_block"]
        for i in range(len(self.layers)):
            w = dict(zip(BLOCK, leaves[1 + 16 * i : 17 + 16 * i]))
            biases = {k: w.pop(k) for k in BIASES}
            y = block.forward(y, *w.values(), num_heads=HEADS, eps=EPS, **biases)
        y.backward(self.g)
        return y.detach(), {n: v.grad for n, v in zip(self.names, leaves)}

    def numpy_stack(self) -> tuple[np.ndarray, dict]:
        values = [v.detach().numpy() for v in self.values]
        out, saved = self.m["numpy_stack"].forward(*values)
        return out, self.m["numpy_stack"].backward(saved, self.g.numpy())

    def numpy_blocks(self) -> tuple[np.ndarray, dict]:
        block, y, tapes = self.m["numpy_block"], self.x.numpy(), []
        for weights in self.layers:
            w = {k: v.numpy() for k, v in weights.items()}
            biases = {k: w.pop(k) for k in BIASES}
            y, saved = block.forward(y, *w.values(), num_heads=HEADS, eps=EPS, **biases)
            tapes.append(saved)
        grads, g = {}, self.g.numpy()
        for i in range(len(self.layers), 0, -1):
            got = block.backward(tapes[i - 1], g)
            g = got.pop("X")
            grads |= {stack_name(k, i): v for k, v in got.items()}
        return y, grads | {"X": g}


def relative_error(got: dict, want: dict) -> float:
    """The largest over every gradient of max |got − want| / max(max |want|, 1): relative, and absolute for a
    gradient that is zero up to rounding (b_K's: a key bias shifts each row of scores by a constant)."""
    worst = 0.0
    for name, w in want.items():
        w = np.asarray(w.detach() if isinstance(w, torch.Tensor) else w, dtype=np.float64)
        v = got[name]
        v = np.asarray(v.detach() if isinstance(v, torch.Tensor) else v, dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(v - w)) / max(np.max(np.abs(w)), 1.0)))
    return worst


def setup(layers: int, batch: int, n: int, d_model: int, dtype: torch.dtype, modules: dict) -> Runs:
    stack = reference_stack(layers, d_model, dtype)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, n, d_model, dtype=dtype, generator=generator)
    g = torch.randn(batch, n, d_model, dtype=dtype, generator=generator)
    return Runs(stack, x, g, modules)


IMPLEMENTATIONS = ("torch_stack", "torch_blocks", "numpy_stack", "numpy_blocks")


def errors(runs: Runs) -> dict[str, float]:
    """Each implementation's largest relative error against torch autograd, output and every gradient."""
    out, grads = runs.torch_autograd()
    want = {"output": out, **grads}
    found = {}
    for name in IMPLEMENTATIONS:
        y, got = getattr(runs, name)()
        found[name] = relative_error({"output": y, **got}, want)
    return found


def seconds(runs: dict, repeats: int) -> dict[str, float]:
    """Each run's median time over repeats, after one warm-up call; the runs interleaved, so that a machine
    whose speed drifts (a shared virtual CPU) biases none of them."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def modules_for(layers: int, out: Path, order: int = 2) -> dict:
    from symattn.generated import transformer_block_numpy, transformer_block_torch

    numpy_stack, torch_stack = generate_stack(layers, out, order)
    return {
        "numpy_stack": numpy_stack,
        "torch_stack": torch_stack,
        "numpy_block": transformer_block_numpy,
        "torch_block": transformer_block_torch,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 layers, small sizes, results to a temp folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.batch, args.n, args.d_model, args.repeats = 2, 2, 16, 32, 2
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="deep_stack_"))
    start = time.perf_counter()
    modules = modules_for(args.layers, work)
    generate_s = time.perf_counter() - start
    checked = errors(setup(args.layers, args.batch, min(args.n, 32), min(args.d_model, 64), torch.float64, modules))
    runs = setup(args.layers, args.batch, args.n, args.d_model, torch.float32, modules)
    timed = seconds({name: getattr(runs, name) for name in ("torch_autograd", *IMPLEMENTATIONS)}, args.repeats)
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
        },
        "date": time.strftime("%Y-%m-%d"),
        "sizes": {"layers": args.layers, "batch": args.batch, "n": args.n, "d_model": args.d_model, "heads": HEADS},
        "generate_s": generate_s,
        "float64_max_rel_error": checked,
        "float32_seconds": timed,
        "ratios": {
            "torch stack / torch blocks": timed["torch_stack"] / timed["torch_blocks"],
            "numpy stack / numpy blocks": timed["numpy_stack"] / timed["numpy_blocks"],
            "torch stack / torch autograd": timed["torch_stack"] / timed["torch_autograd"],
            "numpy stack / torch autograd": timed["numpy_stack"] / timed["torch_autograd"],
        },
    }
    where = work if args.quick else HERE
    (where / "deep_stack.json").write_text(json.dumps(result, indent=2) + "\n")
    (where / "DEEP_STACK.md").write_text(markdown(result))
    sys.stdout.write(markdown(result))
    return 0


def markdown(r: dict) -> str:
    s = r["sizes"]
    lines = [
        "# A deep stack, generated (benchmarks/deep_stack.py)",
        "",
        "Written by `python benchmarks/deep_stack.py`"
        + (
            f" ({r['date']}; {r['machine']['cpu']}, {r['machine']['logical_cpus']} logical CPUs)."
            if "date" in r
            else "."
        ),
        "",
        f"{s['layers']} pre-LN Transformer blocks, H = {s['heads']}, batch {s['batch']}, n = {s['n']}, "
        f"d_model = {s['d_model']}, d_ff = 4·d_model; one thread; Python {r['machine']['python']}, "
        f"NumPy {r['machine']['numpy']}, torch {r['machine']['torch']}. Generating both modules took "
        f"{r['generate_s']:.1f} s.",
        "",
        "| implementation | float64 max rel. error vs torch autograd | float32 forward+backward (s) |",
        "|---|---|---|",
        f"| torch autograd of nn.TransformerEncoderLayer × {s['layers']} | (reference) | "
        f"{r['float32_seconds']['torch_autograd']:.4f} |",
    ]
    for name in IMPLEMENTATIONS:
        label = name.replace("_", " ") + ("" if name.endswith("stack") else f" (built-in block × {s['layers']})")
        lines.append(f"| {label} | {r['float64_max_rel_error'][name]:.1e} | {r['float32_seconds'][name]:.4f} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in r["ratios"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
