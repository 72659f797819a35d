"""Context parallelism on the CPU (issue 54): time per rank of the ring against one process at the same length.

One step is forward + backward of the generated attention module (``symattn.generated.attention_torch``, float32,
one sequence of n rows, d = 64, loss = ⟨G, O⟩), plain or causal:

- ``one process``: the module's ``forward`` (and its memory-efficient variant's) on the whole sequence, one thread;
- ``ring P``: ``symattn.distributed.context_parallel(attention_torch.forward)`` over P gloo processes on this
  machine, one thread each, each with its n / P rows (causal: contiguous and ``balance="causal"``); the step's
  time is the slowest rank's, the best of ``--repeats`` rounds (a barrier before each). Plain, also the same
  ranks' work without communication (each rank's n/P rows against all n keys, by a ring of one process): the
  ring's time over it is the overlap (1: communication wholly hidden).

The target (issue 54) is a ring's time per rank ≤ 1.3 × (one process's time ÷ P). The ranks need P free cores:
on a shared machine the figures are the machine's load as much as the ring's.

With ``--memory``, the peak bytes one step allocates beyond its inputs, per rank (the largest) and in one process.

    python benchmarks/context_parallel.py [--n 4096] [--world 2] [--repeats 5] [--causal] [--memory]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_variable] = "1"  # before torch starts its thread pools

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

D = 64


def _data(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(1, n, D) for _ in range(4)]  # Q, K, V, G


def _step(forward, tensors: list[torch.Tensor], causal: bool) -> float:
    """Seconds of one forward + backward of forward on the tensors (Q, K, V, G)."""
    Q, K, V = (x.detach().requires_grad_() for x in tensors[:3])
    start = time.perf_counter()
    forward(Q, K, V, causal=causal).backward(tensors[3])
    return time.perf_counter() - start


def _peak(forward, tensors: list[torch.Tensor], causal: bool) -> int:
    """Peak bytes allocated by one step beyond its inputs (torch profiler's memory events, as benchmarks/
    implementations.py measures them): the outputs, gradients, and what is alive inside, received blocks too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(forward, tensors, causal)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


def _worker(rank: int, world: int, args, init: str, out: str) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=300)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
        from symattn.generated import attention_torch

        from symattn.distributed import context_parallel

        results = {}
        for balance in (None, "causal") if args.causal else (None,):
            ring = context_parallel(attention_torch.forward, balance=balance)
            rows = torch.tensor_split(torch.arange(args.n), world if balance is None else 2 * world)
            mine = rows[rank] if balance is None else torch.cat([rows[rank], rows[2 * world - 1 - rank]])
            tensors = [x[..., mine, :] for x in _data(args.n)]
            times = []
            for _ in range(args.repeats + 1):  # the first a warm-up
                dist.barrier()
                elapsed = torch.tensor([_step(ring, tensors, args.causal)])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
            results[balance] = min(times[1:])
            if args.memory:
                peak = torch.tensor([_peak(ring, tensors, args.causal)])
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                results[f"memory {balance}"] = int(peak.item())
        if not args.causal:  # the same work without communication: the rank's rows against every key, a ring of one
            alone = [dist.new_group([r]) for r in range(world)][rank]
            solo = context_parallel(attention_torch.forward, alone)
            Q, K, V, G = _data(args.n)
            tensors = [Q[..., torch.tensor_split(torch.arange(args.n), world)[rank], :], K, V, G]
            tensors[3] = G[..., : tensors[0].shape[-2], :]
            elapsed = torch.tensor([min(_step(solo, tensors, False) for _ in range(3))])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            results["compute"] = elapsed.item()
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)  # as tests/integration/gloo_step.py leaves: no ProcessGroupGloo destructor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--memory", action="store_true", help="also the peak bytes per rank and of one process")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from symattn.generated import attention_torch, attention_torch_memeff

    single = {}
    for name, module in (("attention_torch", attention_torch), ("attention_torch_memeff", attention_torch_memeff)):
        tensors = _data(args.n)
        single[name] = min(_step(module.forward, tensors, args.causal) for _ in range(args.repeats + 1))
        if args.memory:
            single[f"memory {name}"] = _peak(module.forward, tensors, args.causal)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ring")
        mp.spawn(_worker, args=(args.world, args, f"file://{Path(tmp) / 'rdv'}", out), nprocs=args.world, join=True)
        ring = torch.load(out)
    mask = "causal" if args.causal else "plain"
    print(f"# {datetime.date.today()}, {os.uname().machine}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"# {mask} attention, n = {args.n}, d = {D}, float32, one thread per process, best of {args.repeats}")
    single_memory = (single.get("memory attention_torch_memeff"), single.get("memory attention_torch"))
    for name in [key for key in single if key.startswith("memory")]:
        print(f"one process, peak {name[7:]}: {single.pop(name) / 2**20:.1f} MiB")
    for name in [key for key in ring if isinstance(key, str) and key.startswith("memory")]:
        peak = ring.pop(name)
        print(f"ring of {args.world}, peak per rank, balance={name[7:]}: {peak / 2**20:.1f} MiB", end=" ")
        memeff, standard = (peak / x for x in single_memory)
        print(f"({memeff:.2f} × one process's memory-efficient, {standard:.2f} × standard)")
    for name, seconds in single.items():
        print(f"one process, {name}: {seconds * 1e3:.1f} ms (÷ {args.world}: {seconds * 1e3 / args.world:.1f} ms)")
    compute = ring.pop("compute", None)
    if compute is not None:
        print(f"the rank's work without communication: {compute * 1e3:.1f} ms (the overlap: ring ÷ this below)")
    for balance, seconds in ring.items():
        if compute is not None:
            print(f"ring ÷ its work without communication: {seconds / compute:.2f}")
        ratio = seconds / (single["attention_torch"] / args.world)
        print(f"ring of {args.world}, balance={balance}: {seconds * 1e3:.1f} ms per rank ({ratio:.2f} × one ÷ P)")


if __name__ == "__main__":
    main()
