"""Low-precision error of the generated torch modules beside SDPA's (issue 40, item 2), on the CPU.

For each case (the built-in ``attention``, standard and memory-efficient, with and without a causal mask, and
``mha``) and each dtype (bfloat16, float16): inputs drawn in float32 and rounded to the dtype; the module's output
and every gradient (one backward with a random output cotangent, rounded alike) compared with a float64 run on
the same rounded values. A value's error is max |x − x₆₄| / max |x₆₄|; a run's error is the worst over the output
and the gradients. Beside it the same for ``torch.nn.functional.scaled_dot_product_attention`` on the same rounded
inputs (its CPU kernel for the dtype; for mha the same projections around it) and for SDPA's math backend.
The table gives each error as a multiple of SDPA's (≤ 1: as accurate as SDPA).

The modules are rendered in this process from the printers and runtimes as they are now (``--generated``: the
ones committed in ``generated/``), so the figures describe the current code.

    python benchmarks/precision.py [--quick] [--no-write] [--generated]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from symattn.codegen import generate as codegen

F = torch.nn.functional
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ((2, 4, 256, 64), (1, 2, 1024, 64))  # B, H, n, d
MHA = ((2, 128, 256, 4),)  # B, n, d_model, H
QUICK_ATTENTION, QUICK_MHA = ((2, 2, 64, 16),), ((2, 32, 64, 4),)
HERE = Path(__file__).resolve().parent
NUMPY_NOTE = (
    "The NumPy modules of attention given float16 arrays (forward, then backward with the same cotangent) on the "
    "same rounded inputs, against the same float64 reference, as a multiple of SDPA's error. As the torch and JAX "
    "modules, they keep a float16 run's n × m arrays (scores, P, dS) and row statistics (max, log-sum-exp, D) in "
    "float32, accumulate every product and sum over blocks of rows in float32, and round each result to float16 once."
)
JAX_NOTE = (
    "The JAX module of attention on the same rounded inputs (``jax.vjp`` with the same cotangent), and JAX's own "
    '``jax.nn.dot_product_attention`` (implementation="xla": float32 logits and softmax, P rounded before P V), '
    "against the same float64 reference, each as a multiple of SDPA's error."
)


def load(spec: str, variant: str, generated: bool = False, backend: str = "torch") -> types.ModuleType:
    """The first-order module (torch, or jax) of a built-in spec as the current code generates it, made in memory
    (generated: the module committed in ``generated/`` instead)."""
    if generated:
        import importlib

        suffix = "_memeff" if variant == "memeff" else ""
        return importlib.import_module(f"symattn.generated.{spec}_{backend}{suffix}")
    module = types.ModuleType(f"{spec}_{backend}_{variant}")
    source = codegen.render(spec, backend, variant, second_order=False)
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


def run(function: Callable, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> list[torch.Tensor]:
    """The output of function at inputs (leaves of their own dtype) and the gradient of ⟨cotangent, output⟩."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = function(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, cotangent.to(out.dtype))]


def error(values: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The worst over values of max |x − x₆₄| / max |x₆₄|."""
    return max(float((v.double() - r).abs().max() / r.abs().max()) for v, r in zip(values, reference))


def errors(ours: Callable, sdpa: Callable, inputs: list[torch.Tensor], cotangent: torch.Tensor) -> dict[str, float]:
    """The errors of ours, sdpa and sdpa's math backend on inputs (of a low dtype) against float64 on them."""
    reference = run(sdpa, [x.double() for x in inputs], cotangent.double())
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math = error(run(sdpa, inputs, cotangent), reference)
    return {
        "ours": error(run(ours, inputs, cotangent), reference),
        "sdpa": error(run(sdpa, inputs, cotangent), reference),
        "math": math,
    }


def _drawn(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    """Standard normal arrays (weights scaled by 1/√rows) rounded to dtype, on device."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=generator) / (shape[0] ** 0.5 if len(shape) == 2 else 1)).to(device, dtype)
        for shape in shapes
    ]


def attention_case(
    module: types.ModuleType,
    shape: tuple[int, ...],
    causal: bool,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, float]:
    """attention(Q, K, V) of B × H × n × d inputs against SDPA."""
    *inputs, cotangent = _drawn([shape] * 4, dtype, seed, device)

    def ours(q, k, v):
        return module.forward(q, k, v, causal=causal)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return errors(ours, sdpa, inputs, cotangent)


def jax_case(module: types.ModuleType, shape: tuple[int, ...], causal: bool, dtype: torch.dtype, seed: int = 0) -> dict:
    """attention(Q, K, V) of the JAX module (``jax.vjp``) and of ``jax.nn.dot_product_attention`` (its XLA
    implementation) on the inputs attention_case draws, against the same float64 reference; SDPA's error beside."""
    import jax
    import jax.numpy as jnp

    *inputs, cotangent = _drawn([shape] * 4, dtype, seed)
    low = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[dtype]

    def as_jax(x, order=(0, 1, 2, 3)):
        return jnp.asarray(x.float().permute(*order).numpy()).astype(low)  # exact: x holds 16-bit values

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def values(function, order):
        out, pullback = jax.vjp(function, *(as_jax(x, order) for x in inputs))
        found = [out, *pullback(as_jax(cotangent, order).astype(out.dtype))]
        return [torch.from_numpy(np.array(x.astype(jnp.float32))).permute(*order) for x in found]

    def own(q, k, v):  # B × n × H × d, as jax.nn lays attention out
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    reference = run(sdpa, [x.double() for x in inputs], cotangent.double())
    return {
        "ours": error(values(lambda q, k, v: module.forward(q, k, v, causal=causal), (0, 1, 2, 3)), reference),
        "jax": error(values(own, (0, 2, 1, 3)), reference),
        "sdpa": error(run(sdpa, inputs, cotangent), reference),
    }


def mha_case(
    module: types.ModuleType,
    size: tuple[int, ...],
    causal: bool,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, float]:
    """Self-attention of mha (X W_Q, X W_K, X W_V, heads, W_O, biases) against the same projections around SDPA.
    b_K is held constant: its gradient is exactly zero (softmax ignores a score added to a whole row)."""
    batch, n, width, heads = size
    shapes = [(batch, n, width)] + [(width, width)] * 4 + [(1, width)] * 4 + [(batch, n, width)]
    x, *weights, b_k, cotangent = _drawn(shapes, dtype, seed, device)

    def ours(x, w_q, w_k, w_v, w_o, b_q, b_v, b_o):
        bias = b_k.to(x.dtype)
        return module.forward(x, x, x, w_q, w_k, w_v, w_o, b_q, bias, b_v, b_o, num_heads=heads, causal=causal)

    def sdpa(x, w_q, w_k, w_v, w_o, b_q, b_v, b_o):
        def split(a):
            return a.reshape(batch, n, heads, width // heads).transpose(1, 2)

        q, k, v = (split(x @ w + b) for w, b in ((w_q, b_q), (w_k, b_k.to(x.dtype)), (w_v, b_v)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out.transpose(1, 2).reshape(batch, n, width) @ w_o + b_o

    return errors(ours, sdpa, [x, *weights], cotangent)


def table(quick: bool = False, generated: bool = False) -> list[dict]:
    """One row per case, dtype and size: the errors of ours, SDPA and SDPA's math backend."""
    rows = []
    for spec, sizes, case in (
        ("attention", QUICK_ATTENTION if quick else ATTENTION, attention_case),
        ("mha", QUICK_MHA if quick else MHA, mha_case),
    ):
        for variant in ("standard", "memeff"):
            module = load(spec, variant, generated)
            for causal in (False, True):
                for size in sizes:
                    for name, dtype in LOW.items():
                        found = case(module, size, causal, dtype)
                        rows.append(
                            {"spec": spec, "variant": variant, "causal": causal, "size": size, "dtype": name, **found}
                        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| module | variant | mask | size | dtype | ours ÷ SDPA | SDPA math ÷ SDPA | SDPA's error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        size = "×".join(str(s) for s in row["size"])
        lines.append(
            f"| {row['spec']} | {row['variant']} | {'causal' if row['causal'] else 'none'} | {size} | {row['dtype']} "
            f"| {row['ours'] / row['sdpa']:.2f} | {row['math'] / row['sdpa']:.2f} | {row['sdpa']:.2e} |"
        )
    worst = {}
    for row in rows:
        key = (row["variant"], row["dtype"])
        worst[key] = max(worst.get(key, 0.0), row["ours"] / row["sdpa"])
    lines += ["", "Worst ours ÷ SDPA: " + ", ".join(f"{v} {d} {r:.2f}" for (v, d), r in sorted(worst.items())) + "."]
    return "\n".join(lines)


def numpy_case(
    module: types.ModuleType, shape: tuple[int, ...], causal: bool, seed: int = 0, **options
) -> dict[str, float]:
    """attention(Q, K, V) of a NumPy module (forward with the options, such as block_size, then backward) in float16
    on the inputs attention_case draws, against the same float64 reference; SDPA's error beside (its float16 CPU
    kernel)."""
    *inputs, cotangent = _drawn([shape] * 4, torch.float16, seed)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    out, saved = module.forward(*(x.numpy() for x in inputs), causal=causal, **options)
    grads = module.backward(saved, cotangent.numpy())
    ours = [torch.from_numpy(np.asarray(x, dtype=np.float32)) for x in (out, grads["Q"], grads["K"], grads["V"])]
    reference = run(sdpa, [x.double() for x in inputs], cotangent.double())
    return {"ours": error(ours, reference), "sdpa": error(run(sdpa, inputs, cotangent), reference)}


def numpy_table(quick: bool = False, generated: bool = False) -> str:
    """The NumPy modules of attention (standard, memory-efficient) in float16, as a markdown table: each error as a
    multiple of SDPA's on the same inputs."""
    lines = [
        "| module | variant | mask | size | dtype | NumPy module ÷ SDPA | SDPA's error |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in ("standard", "memeff"):
        module = load("attention", variant, generated, "numpy")
        for causal in (False, True):
            for size in QUICK_ATTENTION if quick else ATTENTION:
                found = numpy_case(module, size, causal)
                lines.append(
                    f"| attention | {variant} | {'causal' if causal else 'none'} | {'×'.join(map(str, size))} | fp16 "
                    f"| {found['ours'] / found['sdpa']:.2f} | {found['sdpa']:.2e} |"
                )
    return "\n".join(lines)


def jax_table(quick: bool = False, generated: bool = False) -> str:
    """The JAX module of attention (its one variant) beside jax.nn.dot_product_attention, as a markdown table: each
    error as a multiple of SDPA's on the same inputs ("" where jax is not installed)."""
    try:
        import jax  # noqa: F401
    except ImportError:
        return ""
    module = load("attention", "standard", generated, "jax")
    lines = [
        "| module | mask | size | dtype | JAX module ÷ SDPA | jax.nn.dot_product_attention ÷ SDPA | SDPA's error |",
        "|---|---|---|---|---|---|---|",
    ]
    for causal in (False, True):
        for size in QUICK_ATTENTION if quick else ATTENTION:
            for name, dtype in LOW.items():
                found = jax_case(module, size, causal, dtype)
                ours, own, sdpa = found["ours"], found["jax"], found["sdpa"]
                lines.append(
                    f"| attention | {'causal' if causal else 'none'} | {'×'.join(map(str, size))} | {name} "
                    f"| {ours / sdpa:.2f} | {own / sdpa:.2f} | {sdpa:.2e} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave PRECISION.md alone")
    parser.add_argument("--generated", action="store_true", help="the modules in generated/, not rendered now")
    args = parser.parse_args(argv)
    text = markdown(table(args.quick, args.generated))
    text += "\n\n## NumPy (float16)\n\n" + NUMPY_NOTE + "\n\n" + numpy_table(args.quick, args.generated)
    jax_text = jax_table(args.quick, args.generated)
    if jax_text:
        text += "\n\n## JAX (bfloat16, float16)\n\n" + JAX_NOTE + "\n\n" + jax_text
    print(text)
    if not args.no_write:
        command = " ".join(["python benchmarks/precision.py", *(argv or [])])
        header = (
            "# Low precision beside SDPA\n\n"
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.processor() or platform.machine()} ({platform.platform()}), torch {torch.__version__}, "
            f"CPU, {torch.get_num_threads()} threads.\n"
            f"Command: `{command}`.\n\n" + __doc__.split("\n\n")[1].replace("\n", " ") + "\n\n"
        )
        (HERE / "PRECISION.md").write_text(header + text + "\n", encoding="utf-8")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
