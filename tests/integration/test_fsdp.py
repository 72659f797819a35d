"""FSDP2 over generated torch modules: one training step of `fully_shard(model, mesh=init_device_mesh("cpu", (2,)))`
on two local gloo processes gives the single process's gradients.

For the generated MultiHeadAttention (own layout) and its nn.MultiheadAttention drop-in, float64: each rank's loss is
the mean over its half of the batch; FSDP2 reduce-scatters the gradients, so each rank holds a DTensor shard (dim 0)
of the rank-averaged gradient. Checked: every parameter's gradient is sharded (rank r holds torch.chunk's r-th
chunk of dim 0, and the two local shards stacked along dim 0 are the gathered tensor), and the gathered gradient
(`full_tensor()`) equals the gradient of one process that takes the whole batch, to 1e-12 relative to the largest
gradient entry.

The step runs in its own script (a subprocess, its own session, its own `file://` rendezvous in tmp_path, no
environment variables and no ports chosen), so it shares nothing with the DDP test in test_torch_engines.py. Each
rank leaves with `os._exit` once its process group is destroyed: in torch 2.13 a gloo collective launched during
backward holds a Python object (the contextvars copy that `backward()` stashes in thread-local state), so the gloo
worker thread needs the GIL to free it; a ProcessGroupGloo destructor that runs on the main thread (holding the GIL)
joins that thread and can deadlock. That is how the DDP test hung when FSDP2 shared its script (617984c).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

FSDP_SCRIPT = textwrap.dedent(
    """
    import datetime
    import os
    import sys
    import traceback

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    from symattn.generated import mha_torch

    E, H, L, N, WORLD = 16, 4, 6, 4, 2
    # The process groups (and the sharded model) stay referenced until os._exit: ProcessGroupGloo's destructor,
    # run with the GIL held, joins gloo worker threads that may be waiting for the GIL (see the test's docstring).
    KEEP_ALIVE: list = []


    def model(kind: str) -> torch.nn.Module:
        torch.manual_seed(0)
        if kind == "own":
            return mha_torch.MultiHeadAttention(E, num_heads=H, bias=True, dtype=torch.float64)
        return mha_torch.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)


    def data() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        return torch.randn(N, L, E, dtype=torch.float64), torch.randn(N, L, E, dtype=torch.float64)


    def loss(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = module(x, x, x)
        out = out[0] if isinstance(out, tuple) else out
        return ((out - target) ** 2).mean()


    def step(rank: int, kind: str, init: str, out: str) -> None:
        timeout = datetime.timedelta(seconds=60)  # a lost peer fails the collective instead of waiting 30 minutes
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timeout)
        KEEP_ALIVE.append(dist.group.WORLD)
        try:
            torch.set_num_threads(1)
            mesh = init_device_mesh("cpu", (WORLD,))  # the default group is initialised: no MASTER_ADDR needed
            KEEP_ALIVE.append(mesh.get_group())
            sharded = fully_shard(model(kind), mesh=mesh)
            KEEP_ALIVE.append(sharded)
            x, target = data()
            shard = slice(rank * N // WORLD, (rank + 1) * N // WORLD)
            loss(sharded, x[shard], target[shard]).backward()  # reduce-scatter: each rank keeps a shard of the mean
            full, local = {}, {}
            for name, p in sharded.named_parameters():
                if not isinstance(p.grad, DTensor) or p.grad.placements != (Shard(0),):
                    raise AssertionError(f"{name}: gradient {type(p.grad).__name__} is not sharded on dim 0")
                local[name] = p.grad.to_local()
                full[name] = p.grad.full_tensor()  # an all-gather outside backward
            torch.save({"full": full, "local": local}, f"{out}.{rank}")
        finally:
            dist.destroy_process_group()


    def worker(rank: int, kind: str, init: str, out: str) -> None:
        code = 1
        try:
            step(rank, kind, init, out)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no ProcessGroupGloo destructor runs; mp.spawn's join reads the exit code


    if __name__ == "__main__":
        kind, init, out = sys.argv[1:]
        mp.spawn(worker, args=(kind, init, out), nprocs=WORLD, join=True)
        single = model(kind)
        x, target = data()
        loss(single, x, target).backward()
        torch.save({name: p.grad for name, p in single.named_parameters()}, f"{out}.single")
    """
)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run args in a session of its own; on timeout kill the whole session (the script, both ranks, and
    multiprocessing's resource tracker), so that nothing outlives the test."""
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"the FSDP2 step did not finish in {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["own", "dropin"])
def test_fsdp2_fully_shard_gloo_matches_single_process(tmp_path: Path, kind: str) -> None:
    # d/dθ mean over the batch = mean over the ranks of d/dθ mean over each rank's half (equal halves)
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    script = tmp_path / "fsdp2_step.py"
    script.write_text(FSDP_SCRIPT, encoding="utf-8")
    out = tmp_path / "grads"
    init = f"file://{tmp_path / 'fsdp2_rendezvous'}"
    run = _run([sys.executable, str(script), kind, init, str(out)], timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    single = torch.load(f"{out}.single")
    ranks = [torch.load(f"{out}.{rank}") for rank in (0, 1)]
    # relative to the largest gradient entry of all parameters: the key bias's gradient is zero in exact
    # arithmetic (b_K adds one constant to a row of scores, which softmax ignores), round-off on both sides
    scale = max(g.abs().max().item() for g in single.values())
    assert scale > 0
    for rank, saved in enumerate(ranks):
        assert saved["full"].keys() == single.keys()
        for name, g in saved["full"].items():
            want = single[name]
            assert g.dtype == torch.float64 and g.shape == want.shape, name
            assert (g - want).abs().max() <= 1e-12 * scale, f"rank {rank}: {name}"
    for name, want in single.items():  # each rank held its chunk of dim 0 (torch.chunk's sizes), together the whole
        shards = [saved["local"][name] for saved in ranks]
        rows = want.shape[0]
        assert [s.shape[0] for s in shards] == [(rows + 1) // 2, rows // 2], name
        assert torch.equal(torch.cat(shards), ranks[0]["full"][name]), name
