# ruff: noqa: E741 (O, the attention output, is the derivation's name)
"""The ring's forward and backward passes over one rank's rows, each block's work done by the generated module.

Forward: the rank's query chunks against each key block as it comes round the ring (the module's ``_forward`` on
a query chunk and a key chunk, causal on a diagonal pair), the partials merged by the normaliser's rule.
Backward: the module's ``_backward`` per pair again, its saved values the pair's with the merged output and
statistic in place of the pair's own (so that P = N(A) is the whole row's); dQ summed on the rank, the key
block's dK, dV partials sent round with it and home to its rank from the last rank that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from symattn.distributed.layout import DIAGONAL, SKIP, Layout
from symattn.distributed.merge import Merge
from symattn.distributed.ring import GRADIENTS, HELD, KEYS, RETURNED, Pending, Ring


@dataclass(frozen=True)
class Plan:
    """What a call's passes need: the block module, the merge, the ring, the layouts of queries and keys, options."""

    module: ModuleType  # the generated module whose _forward and _backward do one pair's work
    merge: Merge
    ring: Ring
    queries: Layout
    keys: Layout
    causal: bool
    options: dict  # the module's options after causal, by name (scale, and block_size where it takes one), as given
    padded: bool = False  # a key block ends with its padding column (…, m_r, 1): 0 or −∞, added to its keys' scores


def _rows(x: torch.Tensor, chunk) -> torch.Tensor:
    return x[..., chunk.offset : chunk.offset + chunk.length, :]


def _mask(plan: Plan, block: list, q, k) -> torch.Tensor | None:
    """The additive mask of the pair (query chunk q, key chunk k): the key chunk's padding column as a row, every
    query row's (an expanded view, as the module's own key_padding_mask), or None without padding."""
    if not plan.padded:
        return None
    column = _rows(block[-1], k)
    return column.mT.expand(*column.shape[:-2], q.length, k.length)


def _pairs(plan: Plan, origin: int):
    """(query chunk, key chunk, causal) of the rank's pairs with origin's key block that are computed."""
    for q in plan.queries.chunks[plan.ring.rank]:
        for k in plan.keys.chunks[origin]:
            how = plan.keys.pair(q, k, plan.causal)
            if how != SKIP and q.length and k.length:
                yield q, k, how == DIAGONAL


def _buffers(plan: Plan, origin: int, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Empty tensors for origin's key block, shaped as like's but with its number of rows."""
    rows = sum(c.length for c in plan.keys.chunks[origin])
    return [x.new_empty((*x.shape[:-2], rows, x.shape[-1])) for x in like]


def _receive(plan: Plan, step: int, like: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Buffers for the key block arriving at this step (none where it does not travel), each tracked by HELD."""
    ring = plan.ring
    origin = (ring.rank - step - 1) % ring.world
    if step == ring.world - 1 or not plan.keys.travels(origin, step, plan.causal):
        return []
    buffers = _buffers(plan, origin, like)
    HELD.track(buffers[0])
    return buffers


def _partial(plan: Plan, queries: list, block: list, q, k, diagonal: bool) -> tuple[tuple, dict]:
    """(the pair's partial, the constants the module's forward saved): (O_j, L_j) of the query chunk q over the key
    chunk k by the module's _forward; with tangents (queries [Q, Q̇], block [K, V, K̇, V̇]) (O_j, L_j, Ȯ_j, L̇_j),
    the tangents by torch.func.jvp of that same _forward (the module's closed-form _jvp gives no L̇_j)."""
    saved_constants: dict = {}

    M = _mask(plan, block, q, k)

    def forward(Q, K, V):
        O_j, saved = plan.module._forward(Q, K, V, M, diagonal, *plan.options.values())
        saved_constants.update((name, x) for name, x in saved.items() if not isinstance(x, torch.Tensor))
        return O_j, saved[plan.merge.statistic]

    primals = (_rows(queries[0], q), _rows(block[0], k), _rows(block[1], k))
    if len(queries) == 1:
        return forward(*primals), saved_constants
    tangents = (_rows(queries[1], q), _rows(block[2], k), _rows(block[3], k))
    (O_j, L_j), (dO_j, dL_j) = torch.func.jvp(forward, primals, tangents)
    return (O_j, L_j, dO_j, dL_j), saved_constants


def _merge_block(plan: Plan, origin: int, block: list, queries: list, merged: list) -> dict:
    """Merge the partials of the rank's query chunks over origin's key block into merged (one per chunk); returns
    the constants the module's forward saved (its resolved options, for the backward)."""
    chunks, constants = plan.queries.chunks[plan.ring.rank], {}
    combine = plan.merge.combine if len(queries) == 1 else plan.merge.tangent
    for q, k, diagonal in _pairs(plan, origin):
        part, constants = _partial(plan, queries, block, q, k, diagonal)
        i = chunks.index(q)
        merged[i] = part if merged[i] is None else combine(merged[i], part)
    return constants


def _nothing(Q: torch.Tensor, V: torch.Tensor, rows: int, count: int) -> tuple:
    """The partial of rows that read no key: O = 0, the statistic −∞ (no key), their tangents 0."""
    out = (Q.new_zeros((*Q.shape[:-2], rows, V.shape[-1])), Q.new_full((*Q.shape[:-2], rows, 1), float("-inf")))
    return (out + (out[0], torch.zeros_like(out[1])))[:count]


def ring_forward(plan: Plan, queries: list, keys: list) -> tuple[list[torch.Tensor], dict]:
    """The merged partials of the rank's query rows over every key block (O and the statistic; with tangents, queries
    [Q, Q̇] and keys [K, V, K̇, V̇], their tangents after them) and the constants the module's forward saved."""
    ring = plan.ring
    chunks = plan.queries.chunks[ring.rank]
    merged: list = [None] * len(chunks)
    block, constants = list(keys), {}
    for step in range(ring.world):
        origin = (ring.rank - step) % ring.world
        send = block if block and plan.keys.travels(origin, step, plan.causal) else []
        pending = ring.post(send, _receive(plan, step, tuple(keys)), KEYS)
        if block:
            constants |= _merge_block(plan, origin, block, queries, merged)
        block = pending.wait()
    count = 2 * len(queries)
    merged = [_nothing(queries[0], keys[1], q.length, count) if m is None else m for m, q in zip(merged, chunks)]
    return [torch.cat(parts, dim=-2) for parts in zip(*merged)], constants


def _block_gradients(plan: Plan, origin: int, block, Q, O, L, dO, dQ, constants: dict) -> list[torch.Tensor]:
    """The rank's rows' share of dK, dV of origin's block (its dQ share added into dQ)."""
    merge = plan.merge
    parts = [torch.zeros_like(block[0]), torch.zeros_like(block[1])]
    for q, k, diagonal in _pairs(plan, origin):
        M = _mask(plan, block, q, k)
        saved = constants | {"Q": _rows(Q, q), "K": _rows(block[0], k), "V": _rows(block[1], k), "M": M}
        saved |= {"O": _rows(O, q), merge.statistic: merge.saved(_rows(L, q)), "causal": diagonal}
        # the options as given (scale None: its default), as the module's Function keeps them, where the forward
        # saved no resolved value (block_size)
        saved |= {name: x for name, x in plan.options.items() if name not in constants}
        grads = plan.module._backward(saved, _rows(dO, q))
        _rows(dQ, q).add_(grads["Q"])
        _rows(parts[0], k).add_(grads["K"])
        _rows(parts[1], k).add_(grads["V"])
    return parts


def _home(plan: Plan, K: torch.Tensor, V: torch.Tensor) -> tuple[Pending | None, int | None]:
    """(the receive of the own block's partials, home from the last rank that reads it, or None where no other rank
    reads it; that rank). Posted before the loop where that rank is not the previous one (its only message here: the
    sender's wait never waits for this rank's loop), else after it (in the order of that rank's other messages)."""
    ring = plan.ring
    last = max(s for s in range(ring.world) if s == 0 or plan.keys.travels(ring.rank, s - 1, plan.causal))
    source = (ring.rank + last) % ring.world
    if not last or source == (ring.rank - 1) % ring.world:
        return None, source if last else None
    return ring.receive_from(source, _buffers(plan, ring.rank, (K, V)), RETURNED), None


def ring_backward(
    plan: Plan, Q, block: list, O, L, dO, constants: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of the rank's rows: its queries' over every key block ([K, V] and the padding column where there
    is one), its keys' from every rank's queries. Each step posts, in one batch, the partials of the block it leaves
    to the next rank and the receive of those of the block it gets next (one partial send in flight)."""
    ring, keys, causal = plan.ring, plan.keys, plan.causal
    dQ = torch.zeros_like(Q)
    like, (K, V) = tuple(block), block[:2]
    partials, own, returning = None, None, None
    home, late = _home(plan, K, V)
    for step in range(ring.world):
        origin = (ring.rank - step) % ring.world
        travels = bool(block) and keys.travels(origin, step, causal)
        pending = ring.post(block if travels else [], _receive(plan, step, like), KEYS)
        parts = []
        if block:
            parts = _block_gradients(plan, origin, block, Q, O, L, dO, dQ, constants)
            if partials is not None and partials.received:  # this block's partials from the ranks before
                parts = [a.add_(b) for a, b in zip(partials.wait(), parts)]
        if partials is not None:
            partials.wait()  # the previous block's partials sent
        arriving = _buffers(plan, (origin - 1) % ring.world, (K, V)) if pending.received else []
        partials = ring.post(parts if travels else [], arriving, GRADIENTS) if travels or arriving else None
        if block and not travels and origin != ring.rank:
            if returning is not None:  # one block's partials on their way home at a time
                returning.wait()
            returning = ring.post(parts, [], RETURNED, to=origin)
        elif block and not travels:
            own = parts
        block = pending.wait()
    if late is not None:
        home = ring.receive_from(late, _buffers(plan, ring.rank, (K, V)), RETURNED)
    own = home.wait() if home is not None else own
    for pending in (partials, returning):
        if pending is not None:
            pending.wait()
    return dQ, own[0], own[1]


class RingFunction(torch.autograd.Function):
    """The ring as an autograd Function: apply(plan, Q, K, V, padding column or None) → the rank's rows of O; its
    backward the ring's."""

    @staticmethod
    def forward(ctx, plan: Plan, Q, K, V, padding):
        block = [K, V] if padding is None else [K, V, padding]
        (O, L), constants = ring_forward(plan, [Q], block)
        ctx.save_for_backward(Q, O, L, *block)
        ctx.plan, ctx.constants = plan, constants
        return O

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        Q, O, L, *block = ctx.saved_tensors
        return (None, *ring_backward(ctx.plan, Q, block, O, L, dO.contiguous(), ctx.constants), None)
