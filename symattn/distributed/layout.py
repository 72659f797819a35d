"""Which rows of the sequence each rank holds, at their global positions, and which key blocks its queries read.

The sequence is cut into chunks. Contiguous: rank r holds chunk r (the ranks' blocks in rank order, of any
lengths). ``balance="causal"`` (zig-zag): 2P chunks, rank r holding chunks r and 2P − 1 − r, each half of its
block (a block of even length), so that every rank has as much causal work as the others. Chunks partition the
sequence, so two chunks are the same or disjoint: under a causal mask a query chunk sees a key chunk wholly
(the keys come before it), on its diagonal (the same chunk: causal within it, the positions aligned), or not at
all (the keys come after it; neither computed nor, where no later rank needs it, sent).
"""

from __future__ import annotations

from dataclasses import dataclass

from symattn.errors import SymattnError

BALANCES = (None, "causal")
FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


@dataclass(frozen=True)
class Chunk:
    """Rows start … start + length − 1 of the sequence, at offset rows of the rank's block."""

    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class Layout:
    """The chunks of every rank's block, in rank order."""

    chunks: tuple[tuple[Chunk, ...], ...]

    @property
    def world(self) -> int:
        return len(self.chunks)

    def pair(self, query: Chunk, key: Chunk, causal: bool) -> str:
        """How a query chunk reads a key chunk: FULL, DIAGONAL (causal within the same chunk) or SKIP."""
        if not causal or key.start + key.length <= query.start:
            return FULL
        if key.start == query.start:
            return DIAGONAL
        return SKIP if key.start >= query.start + query.length else _overlap(query, key)

    def reads(self, rank: int, origin: int, causal: bool) -> bool:
        """Does rank's query block read any key of origin's block?"""
        return any(self.pair(q, k, causal) != SKIP for q in self.chunks[rank] for k in self.chunks[origin] if q.length)

    def travels(self, origin: int, step: int, causal: bool) -> bool:
        """Is origin's key block sent on at step (from rank origin + step to the next): does a later holder read it?"""
        return any(self.reads((origin + later) % self.world, origin, causal) for later in range(step + 1, self.world))


def _overlap(query: Chunk, key: Chunk) -> str:  # pragma: no cover - chunks partition the sequence
    raise AssertionError(f"chunks overlap: {query} and {key}")


def check_balance(balance: str | None) -> None:
    """A SymattnError of one line unless balance is one of BALANCES."""
    if balance not in BALANCES:
        raise SymattnError(f"context_parallel: balance must be None or 'causal', got {balance!r}")


def layout(lengths: list[int], balance: str | None) -> Layout:
    """The layout of blocks of these lengths (one per rank, in rank order) for a balance of BALANCES."""
    check_balance(balance)
    world = len(lengths)
    if balance is None:
        starts = [sum(lengths[:r]) for r in range(world)]
        return Layout(tuple((Chunk(s, n, 0),) for s, n in zip(starts, lengths)))
    odd = [r for r, n in enumerate(lengths) if n % 2]
    if odd:
        raise SymattnError(
            f"context_parallel: balance='causal' cuts each rank's block into two equal chunks, but rank {odd[0]} "
            f"holds {lengths[odd[0]]} rows (an odd number); pad the sequence to a multiple of 2 × world size"
        )
    halves = [n // 2 for n in lengths]
    owner = [*range(world), *reversed(range(world))]  # chunk c belongs to rank owner[c]
    starts = [sum(halves[owner[c]] for c in range(i)) for i in range(2 * world)]
    chunks = tuple(
        (Chunk(starts[r], halves[r], 0), Chunk(starts[2 * world - 1 - r], halves[r], halves[r])) for r in range(world)
    )
    return Layout(chunks)
