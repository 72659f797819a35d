"""Training a long-context model with FSDP2 + context parallelism over a symattn block (docs/context_parallel.md).

Every rank holds the whole model's shard (FSDP2's ``fully_shard`` over a 1-d mesh) and its block of the
sequence's rows (``balance="causal"``: the zig-zag chunks r and 2P − 1 − r). The transformer block is the generated
``TransformerBlock`` (causal pre-LN attention + feed-forward), called through ``context_parallel``: its keys and
values travel round the ring, everything else runs on the rank's rows. Each rank's loss is the mean over its rows;
FSDP2 averages the gradients over the ranks, which is the gradient of the mean over the whole sequence (the ranks
hold as many rows each). The run checks itself: the losses of a few SGD steps on P gloo processes (CPU) equal
those of one process on the whole sequence (float64).

    python examples/long_context_training.py [--world 2] [--n 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D_MODEL, HEADS, D_FF = 16, 2, 32


class LongContextModel(torch.nn.Module):
    """x ↦ W_out · block(x W_in): one causal transformer block between two projections; ``ring`` (a
    ``context_parallel`` of the block, or None for one process) runs the block on the rank's rows."""

    def __init__(self, features: int, ring: bool) -> None:
        super().__init__()
        from symattn.generated import transformer_block_torch

        from symattn.distributed import context_parallel

        self.embed = torch.nn.Linear(features, D_MODEL, dtype=torch.float64)
        self.block = transformer_block_torch.TransformerBlock(D_MODEL, D_FF, num_heads=HEADS, dtype=torch.float64)
        self.head = torch.nn.Linear(D_MODEL, 1, dtype=torch.float64)
        for p in self.block.parameters():  # the generated module leaves its weights uninitialised, as nn.Linear's
            torch.nn.init.normal_(p, std=D_MODEL**-0.5)
        self.ring = context_parallel(self.block, balance="causal") if ring else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.ring(h, causal=True) if self.ring is not None else self.block(h, causal=True)
        return self.head(h)


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence of n random feature rows and its target: the running mean of the first feature (causal)."""
    torch.manual_seed(1)
    x = torch.randn(1, n, 4, dtype=torch.float64)
    return x, x[..., :1].cumsum(-2) / torch.arange(1, n + 1, dtype=torch.float64)[:, None]


def rows(n: int, world: int, rank: int) -> torch.Tensor:
    """The rank's rows under balance="causal": chunks rank and 2P − 1 − rank of 2P."""
    chunks = torch.arange(n).chunk(2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """SGD steps on the mean squared error over x's rows; the loss of each step (before its update)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def worker(rank: int, world: int, args, init: str, out: str) -> None:
    code = 1
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(60))
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = LongContextModel(4, ring=True)
        fully_shard(model, mesh=mesh)  # the weights sharded over the ranks, gathered whole for each forward
        x, y = data(args.n)
        mine = rows(args.n, world, rank)
        losses = torch.stack(train(model, x[..., mine, :], y[..., mine, :], args.steps))
        dist.all_reduce(losses)  # the mean over the ranks of their means: the whole sequence's mean
        if rank == 0:
            torch.save(losses / world, out)
        dist.barrier()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)  # tests/integration/gloo_step.py says why: no ProcessGroupGloo destructor


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "losses")
        mp.spawn(worker, args=(args.world, args, f"file://{folder}/rendezvous", out), nprocs=args.world)
        ring = torch.load(out)
    torch.manual_seed(0)
    one = torch.stack(train(LongContextModel(4, ring=False), *data(args.n), args.steps))
    for step, (a, b) in enumerate(zip(ring.tolist(), one.tolist())):
        print(f"step {step}: loss {a:.12f} over {args.world} ranks, {b:.12f} in one process")
    gap = (ring - one).abs().max().item()
    print(f"largest difference: {gap:.1e}")
    return 0 if gap <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
