"""FSDP2 over generated torch modules: one training step of `fully_shard(model, mesh=init_device_mesh("cpu", (2,)))`
on two local gloo processes gives the single process's gradients.

For the generated MultiHeadAttention (own layout) and its nn.MultiheadAttention drop-in, float64: each rank's loss is
the mean over its half of the batch; FSDP2 reduce-scatters the gradients, so each rank holds a DTensor shard (dim 0)
of the rank-averaged gradient. Checked: every parameter's gradient is sharded (rank r holds torch.chunk's r-th
chunk of dim 0, and the two local shards stacked along dim 0 are the gathered tensor), and the gathered gradient
(`full_tensor()`) equals the gradient of one process that takes the whole batch, to 1e-12 relative to the largest
gradient entry.

The step runs in its own script (gloo_step.py: a subprocess, its own session, its own `file://` rendezvous in
tmp_path, no environment variables and no ports chosen), a process apart from the DDP test's. Each rank leaves
with `os._exit` once its process group is destroyed (gloo_step.py's docstring says why: the DDP test hung when
FSDP2 shared its process, 617984c).
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from gloo_step import run_step  # noqa: E402

# FSDP2's step of the script gloo_step.py runs (its models, data, loss, exit and single-process reference)
FSDP_STEP = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard


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

"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["own", "dropin"])
def test_fsdp2_fully_shard_gloo_matches_single_process(tmp_path: Path, kind: str) -> None:
    # d/dθ mean over the batch = mean over the ranks of d/dθ mean over each rank's half (equal halves)
    out = run_step(tmp_path, "fsdp2_step", FSDP_STEP, kind, timeout=180)
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
