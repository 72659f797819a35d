"""The ring's messages: point-to-point sends to the next rank and receives from the previous one (torch.distributed
isend/irecv, posted together by ``batch_isend_irecv``, as NCCL needs a ring's sends and receives grouped), posted
before a block's compute and waited after it, so that the transfer of the next block overlaps the work on this one.

``HELD`` counts the key blocks of other ranks alive on this rank (received buffers, freed when the ring drops
them): its peak is what the memory bound promises (two: the block computed with and the one arriving).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

KEYS, GRADIENTS, RETURNED = 1, 2, 3  # message tags: key/value blocks, gradient partials along, partials home


class _Held:
    """A count of live tensors registered with ``track``, and its peak since ``reset``."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._release)

    def _release(self) -> None:
        self.now -= 1

    def reset(self) -> None:
        self.peak = self.now


HELD = _Held()


@dataclass
class Pending:
    """Posted transfers: wait() completes them and gives the received tensors (the sent ones kept alive until then)."""

    works: list = field(default_factory=list)
    received: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        return self.received


class Ring:
    """A process group's ranks as a ring: rank r sends to r + 1 and receives from r − 1 (mod the world size)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def post(self, send: list[torch.Tensor], receive: list[torch.Tensor], tag: int, to: int | None = None) -> Pending:
        """Send the tensors to rank to (default the next) and receive into the buffers from the previous rank."""
        to = (self.rank + 1) % self.world if to is None else to
        sent = [t.contiguous() for t in send]
        ops = [dist.P2POp(dist.isend, t, self._global(to), self.group, tag) for t in sent]
        prev = self._global((self.rank - 1) % self.world)
        ops += [dist.P2POp(dist.irecv, t, prev, self.group, tag) for t in receive]
        return Pending(dist.batch_isend_irecv(ops) if ops else [], receive, sent)

    def receive_from(self, source: int, buffers: list[torch.Tensor], tag: int) -> Pending:
        """Receive into the buffers from rank source."""
        ops = [dist.P2POp(dist.irecv, t, self._global(source), self.group, tag) for t in buffers]
        return Pending(dist.batch_isend_irecv(ops) if ops else [], buffers)

    def lengths(self, device: torch.device, *lengths: int) -> list[list[int]]:
        """Every rank's values of these lengths, in rank order: one list per length (gathered on device: NCCL's
        collectives take CUDA tensors)."""
        mine = torch.tensor(lengths, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return [[int(x[i]) for x in every] for i in range(len(lengths))]
