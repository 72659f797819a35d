"""Forward mode (a JVP: the output and its tangent along every input), one thread: the generated closed form
against the strongest peers of the same forward.

For attention (causal or not) and mha, batch × n tokens, float32 by default:
- ``numpy jvp`` / ``torch jvp``: the generated modules' ``jvp`` (the closed-form JVP);
- ``torch.func.jvp``: of the generated torch forward (its Function's jvp: the same closed form, through
  torch.func) and of a plain torch forward written here (``eager``: torch's own forward-mode rules);
- ``jax.jit(jax.jvp)``: of a jnp forward written here (when jax is installed), and of the generated
  ``forward_jvp`` (the custom_jvp whose rule is the generated JVP).
Prints the median times, the ratios to the fastest peer (target ≤ 0.8× for the generated modules), and the
largest difference from the eager torch tangent. ``--memory`` prints instead the peak extra memory of one
NumPy JVP of attention (standard and memory-efficient; inputs and tangents excluded, tracemalloc, which NumPy
reports its buffers to), output and tangent included.

    python benchmarks/forward_mode.py [--n 1024] [--batch 1] [--dtype float32] [--memory]

One thread throughout: it sets OMP_NUM_THREADS (and friends) and XLA_FLAGS itself before NumPy, torch and JAX
load, and keeps the process on one core (on Linux): a jit otherwise runs on every core, flags or not.
"""

from __future__ import annotations

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"  # before NumPy, torch and JAX start their thread pools
# JAX too: XLA's CPU runtime otherwise splits a jit's work across every core (its fusions' partitions); jax
# 0.10 runs some of them on a second core even with these flags, so the process is also kept to one core
os.environ["XLA_FLAGS"] = " ".join(
    (os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
).strip()
if hasattr(os, "sched_setaffinity"):  # (Linux) every thread of the process on one core: one thread's time
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import argparse  # noqa: E402
import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from second_order import median_time  # noqa: E402  (benchmarks/, this script's folder)
from symattn.generated import (  # noqa: E402
    attention_numpy,
    attention_numpy_memeff,
    attention_torch,
    mha_numpy,
    mha_torch,
)


def _attention(Q, K, V, mask):
    return torch.softmax(Q @ K.mT / Q.shape[-1] ** 0.5 + mask, dim=-1) @ V


def _mha(Q, K, V, W_Q, W_K, W_V, W_O, heads):
    def split(x):
        return x.unflatten(-1, (heads, -1)).transpose(-3, -2)

    o = torch.softmax(split(Q @ W_Q) @ split(K @ W_K).mT / (W_Q.shape[1] // heads) ** 0.5, dim=-1) @ split(V @ W_V)
    return o.transpose(-3, -2).flatten(-2) @ W_O


def _cases(args):
    """(name, torch inputs, generated numpy module, generated torch module, options, plain torch forward)."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, n, d = args.batch, args.n, args.d

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=dtype) * scale

    qkv = [r(b, args.heads, n, d), r(b, args.heads, n, d), r(b, args.heads, n, d)]
    zeros = torch.zeros(n, n, dtype=dtype)
    causal = torch.full((n, n), float("-inf"), dtype=dtype).triu(1)
    x = r(b, n, args.heads * d)
    e = args.heads * d
    weights = [r(e, e, scale=e**-0.5) for _ in range(4)]
    return [
        ("attention", qkv, attention_numpy, attention_torch, {}, lambda *a: _attention(*a, zeros)),
        (
            "attention causal",
            qkv,
            attention_numpy,
            attention_torch,
            {"causal": True},
            lambda *a: _attention(*a, causal),
        ),
        ("mha", [x, x, x, *weights], mha_numpy, mha_torch, {"num_heads": args.heads}, lambda *a: _mha(*a, args.heads)),
    ]


def _jax_peers(name, inputs, tangents, options, heads):
    """jax.jit(jax.jvp) of a jnp forward and of the generated forward_jvp, or {} without jax."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    from symattn.generated import attention_jax, mha_jax

    primals = tuple(jnp.asarray(t.numpy()) for t in inputs)
    directions = tuple(jnp.asarray(t.numpy()) for t in tangents)
    n = inputs[0].shape[-2]

    def plain(*a):
        if name.startswith("attention"):
            q, k, v = a
            mask = jnp.where(jnp.triu(jnp.ones((n, n), bool), 1), -jnp.inf, 0.0) if "causal" in name else 0.0
            return jax.nn.softmax(q @ k.swapaxes(-1, -2) / q.shape[-1] ** 0.5 + mask, axis=-1) @ v
        q, k, v, w_q, w_k, w_v, w_o = a

        def split(t):
            return t.reshape(*t.shape[:-1], heads, -1).swapaxes(-3, -2)

        p = jax.nn.softmax(split(q @ w_q) @ split(k @ w_k).swapaxes(-1, -2) / (w_q.shape[1] // heads) ** 0.5, -1)
        o = (p @ split(v @ w_v)).swapaxes(-3, -2)
        return o.reshape(*o.shape[:-2], -1) @ w_o

    generated = attention_jax if name.startswith("attention") else mha_jax
    peers = {}
    for label, f in (
        ("jax.jit(jax.jvp) jnp", plain),
        ("jax.jit(jax.jvp) forward_jvp", lambda *a: generated.forward_jvp(*a, **options)),
    ):
        run = jax.jit(lambda p, t, f=f: jax.jvp(f, p, t))
        peers[label] = lambda run=run: jax.block_until_ready(run(primals, directions))
    return peers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--memory", action="store_true", help="peak extra memory of the NumPy JVPs instead")
    args = parser.parse_args()
    if args.memory:
        memory(args)
        return
    torch.set_num_threads(1)
    print(f"batch {args.batch}, heads {args.heads}, n {args.n}, d_k {args.d}, {args.dtype}, one thread")
    for case in _cases(args):
        _report(case, args)


def memory(args: argparse.Namespace) -> None:
    """Peak extra memory (MiB) of one NumPy JVP of attention, causal and not, standard and memory-efficient."""
    rng = np.random.default_rng(0)
    dtype = np.dtype(args.dtype)
    shape = (args.batch, args.heads, args.n, args.d)
    inputs = [rng.standard_normal(shape).astype(dtype) for _ in range(3)]
    tangents = dict(zip("QKV", (rng.standard_normal(shape).astype(dtype) for _ in range(3))))
    n_d = args.batch * args.heads * args.n * args.d * dtype.itemsize / 2**20
    print(
        f"batch {args.batch}, heads {args.heads}, n {args.n}, d_k {args.d}, {args.dtype}: one n × d array "
        f"{n_d:.1f} MiB, one n × n array {n_d * args.n / args.d:.0f} MiB"
    )
    for causal in (False, True):
        for label, module in (("standard", attention_numpy), ("memeff", attention_numpy_memeff)):
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                module.jvp(*inputs, tangents, causal=causal)
                peak = tracemalloc.get_traced_memory()[1] - base
            finally:
                tracemalloc.stop()
            print(f"  {'causal' if causal else 'no mask':8s} {label:9s} peak extra {peak / 2**20:8.1f} MiB")


def _report(case: tuple, args: argparse.Namespace) -> None:
    """Time one case's JVPs, print the times, the ratios to the fastest peer and the differences."""
    name, inputs, numpy_module, torch_module, options, plain = case
    tangents = [torch.randn_like(t) for t in inputs]
    names = [k for k in numpy_module.SHAPES if k not in numpy_module.OPTIONAL][: len(inputs)]
    as_numpy = [t.numpy() for t in inputs]
    tangent_dict = dict(zip(names, tangents))
    numpy_dict = {k: v.numpy() for k, v in tangent_dict.items()}

    def generated_forward(*a):
        return torch_module.forward(*a, **options)

    with torch.no_grad():
        want = torch.func.jvp(plain, tuple(inputs), tuple(tangents))[1]
    runs = {
        "numpy jvp": lambda: numpy_module.jvp(*as_numpy, numpy_dict, **options),
        "torch jvp": lambda: torch_module.jvp(*inputs, tangent_dict, **options),
        "torch.func.jvp generated": lambda: torch.func.jvp(generated_forward, tuple(inputs), tuple(tangents)),
        "torch.func.jvp eager": lambda: torch.func.jvp(plain, tuple(inputs), tuple(tangents)),
        **_jax_peers(name, inputs, tangents, options, args.heads),
    }
    with torch.no_grad():
        times = {label: median_time(run, args.repeats) for label, run in runs.items()}
        errors = {
            "numpy jvp": float(np.abs(runs["numpy jvp"]()[1] - want.numpy()).max()),
            "torch jvp": float((runs["torch jvp"]()[1] - want).abs().max()),
        }
    peers = {k: v for k, v in times.items() if "eager" in k or "jnp" in k}
    best = min(peers, key=peers.get)
    print(f"\n{name}: fastest peer {best}, {1000 * peers[best]:.1f} ms")
    for label, seconds in times.items():
        print(f"  {label:32s} {1000 * seconds:8.1f} ms  {seconds / peers[best]:5.2f}×")
    print(f"  largest difference from the eager torch tangent: {errors}")


if __name__ == "__main__":
    main()
