"""The elementwise passes of attention's forward and backward over the n × m arrays (issue 27, item 2).

    python benchmarks/elementwise.py [--quick]

One thread (the thread-count variables are set before NumPy loads). Prints four tables, best of a few runs
in ms, B × H × n × n = 1 × 8 × 1024 × 1024 and 4 × 8 × 512 × 512 (the same 8 Mi entries), d = 64, float32:

1. each NumPy pass of the softmax (max, subtract, exp, sum, divide) and of the backward chain (D = rowsum(dO ⊙ O),
   dP − D, ⊙ P) over the whole array, and over blocks of rows (32 … 256 rows of every head at a time: a block
   of 32 rows is 1 MiB, the L2; of 256, 8 MiB, within the L3);
2. fused kernels that sweep each row once: numba with its own np.exp (a libm call per entry), the one the
   generated modules use (fused_row_softmax: a polynomial exp that vectorizes), float32 and float64, and
   dA = P ⊙ (dP − D) in one numba sweep; the pure NumPy chains beside them;
3. the forward's GEMMs with the softmax between them, block by block of rows (the softmax while the block is
   in cache) against the whole array at once;
4. forward + backward of the generated attention_numpy, with the fused kernel and without (SYMATTN_NUMBA=0's
   path), and torch's scaled_dot_product_attention forward + backward (when torch is installed), in one process;
5. the entrywise σ and softplus of the generated NumPy modules (numpy_runtime.sigmoid, softplus) over the same
   array, float32 and float64: their compiled kernels against NumPy's passes (1 / (1 + exp(−x)), np.logaddexp).

Without numba installed, the rows that need it are left out.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
from symattn.generated import attention_numpy  # noqa: E402

try:
    import numba
except ImportError:  # the rows that need it are left out
    numba = None

BLOCKS = (32, 64, 128, 256)


def best(f: Callable[[], object], repeat: int = 5) -> float:
    """The best of repeat runs of f(), in ms, after one warm-up (timeit: the garbage collector off)."""
    f()
    return 1e3 * min(timeit.repeat(f, number=1, repeat=repeat))


def by_blocks(step, n, b):
    """step(rows) for each block of b rows (every head and batch element at once)."""

    def run():
        for start in range(0, n, b):
            step(slice(start, start + b))

    return run


def numpy_passes(shape, dtype, repeat):
    """Table 1: ms of each NumPy pass, whole and by blocks of rows."""
    rng = np.random.default_rng(0)
    A = (3 * rng.standard_normal(shape)).astype(dtype)
    work = np.empty_like(A)
    P = rng.random(shape, dtype=np.float64).astype(dtype)
    dP = rng.standard_normal(shape).astype(dtype)
    out = rng.standard_normal((*shape[:-1], 64)).astype(dtype)
    d_out = rng.standard_normal(out.shape).astype(dtype)
    top = A.max(axis=-1, keepdims=True)
    total = np.exp(A - top).sum(axis=-1, keepdims=True)
    D = (out * d_out).sum(axis=-1, keepdims=True)
    shifted, exps, diff = A - top, np.exp(A - top), dP - D  # each pass's input: passes write into work only
    passes = {
        "max": lambda r: A[..., r, :].max(axis=-1, keepdims=True),
        "subtract": lambda r: np.subtract(A[..., r, :], top[..., r, :], out=work[..., r, :]),
        "exp": lambda r: np.exp(shifted[..., r, :], out=work[..., r, :]),
        "sum": lambda r: exps[..., r, :].sum(axis=-1, keepdims=True),
        "divide": lambda r: np.divide(exps[..., r, :], total[..., r, :], out=work[..., r, :]),
        "D = rowsum(dO ⊙ O)": lambda r: (out[..., r, :] * d_out[..., r, :]).sum(axis=-1, keepdims=True),
        "dP − D": lambda r: np.subtract(dP[..., r, :], D[..., r, :], out=work[..., r, :]),
        "⊙ P": lambda r: np.multiply(diff[..., r, :], P[..., r, :], out=work[..., r, :]),
    }
    n = shape[-2]
    table = {}
    for name, step in passes.items():
        table[name] = [best(lambda step=step: step(slice(None)), repeat)]
        table[name] += [best(by_blocks(step, n, b), repeat) for b in BLOCKS]
    return table


def softmax_numpy(a):
    """The generated modules' NumPy row softmax, in place."""
    np.subtract(a, a.max(axis=-1, keepdims=True), out=a)
    np.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    return a


def numba_kernels():
    """numba kernels with numba's own np.exp (softmax in one sweep per row) and dA = P ⊙ (dP − D) in one sweep."""

    @numba.njit(fastmath=True)
    def softmax_libm(a):
        for i in range(a.shape[0]):
            top = a[i, 0]
            for j in range(a.shape[1]):
                top = max(top, a[i, j])
            total = a[i, 0] - a[i, 0]
            for j in range(a.shape[1]):
                e = np.exp(a[i, j] - top)
                a[i, j] = e
                total += e
            for j in range(a.shape[1]):
                a[i, j] /= total

    @numba.njit(fastmath=True)
    def softmax_backward(dp, d, p):
        for i in range(dp.shape[0]):
            di = d[i]
            for j in range(dp.shape[1]):
                dp[i, j] = (dp[i, j] - di) * p[i, j]

    return softmax_libm, softmax_backward


def fused(shape, repeat):
    """Table 2: ms of the whole softmax and dA chains, NumPy against fused kernels (each after a copy of its input,
    subtracted)."""
    rng = np.random.default_rng(0)
    table = {}
    kernels = numba_kernels() if numba else None
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        A = (3 * rng.standard_normal(shape)).astype(dtype)
        work = np.empty_like(A)
        flat = work.reshape(-1, shape[-1])
        copy = best(lambda A=A, work=work: np.copyto(work, A), repeat)

        def timed(f, A=A, work=work, copy=copy):
            return best(lambda: (np.copyto(work, A), f()), repeat) - copy

        table[f"softmax, NumPy passes, {name}"] = timed(lambda work=work: softmax_numpy(work))
        if numba:
            start = time.perf_counter()
            kernels[0](flat[:1].copy())
            compile_libm = time.perf_counter() - start
            table[f"softmax, numba with np.exp (libm), {name}"] = timed(lambda flat=flat: kernels[0](flat))
            table[f"  its first call (compile), {name}"] = 1e3 * compile_libm
            kernel = attention_numpy._fused_kernels()
            if kernel is not None:  # the generated modules' kernel (SYMATTN_NUMBA=0: left out)
                start = time.perf_counter()
                attention_numpy.fused_row_softmax(work[..., :1, :].copy())
                table[f"  fused_row_softmax's first call (compile), {name}"] = 1e3 * (time.perf_counter() - start)
                table[f"softmax, fused_row_softmax (polynomial exp), {name}"] = timed(
                    lambda work=work: attention_numpy.fused_row_softmax(work, out=work)
                )
        P = rng.random(shape).astype(dtype)
        D = rng.standard_normal((*shape[:-1], 1)).astype(dtype)
        dP = rng.standard_normal(shape).astype(dtype)
        copy = best(lambda dP=dP, work=work: np.copyto(work, dP), repeat)

        def timed_dp(f, dP=dP, work=work, copy=copy):
            return best(lambda: (np.copyto(work, dP), f()), repeat) - copy

        table[f"dA = P ⊙ (dP − D), NumPy (2 passes), {name}"] = timed_dp(
            lambda work=work, D=D, P=P: np.multiply(np.subtract(work, D, out=work), P, out=work)
        )
        if numba:
            Pf, Df = P.reshape(flat.shape), D.reshape(-1)
            table[f"dA = P ⊙ (dP − D), numba (1 sweep), {name}"] = timed_dp(
                lambda flat=flat, Df=Df, Pf=Pf: kernels[1](flat, Df, Pf)
            )
    return table


def gemm_blocks(shape, repeat):
    """Table 3: forward GEMMs + softmax, whole against blocks of rows, with the NumPy and the fused softmax."""
    rng = np.random.default_rng(0)
    B, H, n, m = shape
    Q, K, V = (rng.standard_normal((B, H, size, 64)).astype(np.float32) for size in (n, m, m))
    scale = np.float32(1 / 8)
    softmaxes = {"NumPy": softmax_numpy}
    if numba and attention_numpy._fused_kernels() is not None:
        softmaxes["fused"] = lambda a: attention_numpy.fused_row_softmax(a, out=a)
    table = {}
    for name, softmax in softmaxes.items():
        table[f"Q Kᵀ, softmax, P V: {name}"] = [best(lambda softmax=softmax: softmax((scale * Q) @ K.mT) @ V, repeat)]
        for b in BLOCKS:
            table[f"Q Kᵀ, softmax, P V: {name}"].append(
                best(
                    lambda b=b, softmax=softmax: [
                        softmax((scale * Q[..., s : s + b, :]) @ K.mT) @ V for s in range(0, n, b)
                    ],
                    repeat,
                )
            )
    table["Q Kᵀ and P V alone (no softmax)"] = [best(lambda: ((scale * Q) @ K.mT) @ V, repeat)]
    table["Q Kᵀ and P V alone (no softmax)"] += [
        best(lambda b=b: [((scale * Q[..., s : s + b, :]) @ K.mT) @ V for s in range(0, n, b)], repeat) for b in BLOCKS
    ]
    return table


def generated(shapes, repeat):
    """Table 4: forward + backward of the generated attention_numpy, the fused kernel on and off, taking turns."""
    kernels = attention_numpy._fused_kernels()
    table = {}
    for B, H, n in shapes:
        rng = np.random.default_rng(0)
        Q, K, V, G = (rng.standard_normal((B, H, n, 64)).astype(np.float32) for _ in range(4))

        def step(Q=Q, K=K, V=V, G=G):
            _, saved = attention_numpy.forward(Q, K, V)
            return attention_numpy.backward(saved, G)

        runs = {"NumPy passes": [], "fused softmax": []}
        for _ in range(2):  # taking turns: load from elsewhere falls on both
            attention_numpy._fused_kernels.made = None
            runs["NumPy passes"].append(best(step, repeat))
            if kernels is not None:
                attention_numpy._fused_kernels.made = kernels
                runs["fused softmax"].append(best(step, repeat))
        attention_numpy._fused_kernels.made = kernels
        table[f"{B}×{H}×{n}"] = {k: min(v) for k, v in runs.items() if v}
        try:  # the yardstick: torch's SDPA forward + autograd backward, same process and thread
            import torch
        except ImportError:
            continue
        torch.set_num_threads(1)
        q, k, v = (torch.tensor(x, requires_grad=True) for x in (Q, K, V))
        g = torch.tensor(G)

        def sdpa(q=q, k=k, v=v, g=g):
            torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(g)

        table[f"{B}×{H}×{n}"]["torch SDPA"] = best(sdpa, repeat)
    return table


def entrywise(shape, repeat):
    """ms of σ and softplus over an array of shape (scores-like values), kernel and NumPy's passes, per dtype."""
    from symattn.codegen.backends.numpy import runtime as numpy_runtime

    table = {}
    for dtype in (np.float32, np.float64):
        a = (4 * np.random.default_rng(0).standard_normal(shape)).astype(dtype)
        for helper in (numpy_runtime.sigmoid, numpy_runtime.softplus):
            row = {"numpy": best(lambda helper=helper, a=a: numpy_runtime_passes(numpy_runtime, helper, a), repeat)}
            if numba is not None:
                row["kernel"] = best(lambda helper=helper, a=a: helper(a), repeat)
            table[f"{helper.__name__} {np.dtype(dtype).name}"] = row
    return table


def numpy_runtime_passes(runtime, helper, a):
    """helper(a) with the compiled kernels off: NumPy's passes."""
    made = runtime._fused_kernels.__dict__.get("made", False)
    runtime._fused_kernels.made = None
    try:
        return helper(a)
    finally:
        runtime._fused_kernels.made = made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small arrays, one run each (a smoke test)")
    args = parser.parse_args()
    shape, shapes, repeat = (
        ((1, 2, 128, 128), [(1, 2, 128)], 1) if args.quick else ((1, 8, 1024, 1024), [(1, 8, 1024), (4, 8, 512)], 5)
    )
    print(f"numpy {np.__version__}, numba {numba.__version__ if numba else 'absent'}, one thread; shape {shape}")
    print(f"\n1. NumPy passes, float32, ms: whole array | blocks of {' / '.join(map(str, BLOCKS))} rows of every head")
    for name, row in numpy_passes(shape, np.float32, repeat).items():
        print(f"  {name:<22}" + "".join(f"{t:9.2f}" for t in row))
    print("\n2. Whole chains, ms (input copy subtracted)")
    for name, t in fused(shape, repeat).items():
        print(f"  {name:<52}{t:9.2f}")
    print(f"\n3. Forward GEMMs + softmax, float32, ms: whole | blocks of {' / '.join(map(str, BLOCKS))} rows")
    for name, row in gemm_blocks(shape, repeat).items():
        print(f"  {name:<36}" + "".join(f"{t:9.2f}" for t in row))
    print("\n4. Generated attention_numpy, forward + backward, float32, d = 64, ms")
    for size, row in generated(shapes, repeat).items():
        print(f"  {size:<12}" + "".join(f"  {k}: {t:7.1f}" for k, t in row.items()))
    print("\n5. Entrywise σ and softplus of the generated NumPy modules, the whole array, ms")
    for name, row in entrywise(shape, repeat).items():
        print(f"  {name:<18}" + "".join(f"  {k}: {t:7.1f}" for k, t in row.items()))


if __name__ == "__main__":
    main()
