# ruff: noqa: E741 (O, the attention output, is the derivation's name)
"""The ring's forward and backward passes over one rank's rows, each block's work done by the core's eager form.

A core's work is cut into pieces: ``ROWS`` of the rank's query rows against one key chunk (a causal diagonal chunk
only up to the piece's last row), each computed by the Triton module's eager core with ``part="share"`` at its
global positions (``origin``): the piece's share of the rows' output and its row statistic, merged over the key
blocks by the normaliser's rule (``merge``). Forward mode runs the same passes on forward-mode dual tensors, the key
blocks' tangents travelling with them. The backward recomputes each piece's scores' steps A_j under autograd
and pulls back the cotangent the merge gives it (``Merge.scores``): dQ and the tiles' and scalars' gradients stay
on the rank, the key block's dK, dV partials travel round with it and home to the rank from the last that reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from symattn.distributed.layout import DIAGONAL, FULL, SKIP, Layout
from symattn.distributed.merge import Merge
from symattn.distributed.ring import GRADIENTS, HELD, KEYS, RETURNED, Pending, Ring

ROWS = 128  # query rows per piece: a piece's n × m arrays are ROWS × (the key chunk's rows)


@dataclass(frozen=True)
class Plan:
    """What a call's passes need: the core's eager form and merge, the ring, the layouts, the options."""

    eager: Callable  # the Triton module's _core_eager: a piece's (share, statistic) with part="share"
    merge: Merge
    ring: Ring
    queries: Layout
    keys: Layout
    causal: bool
    symbols: dict  # the core's symbols, its query and key lengths the whole sequence's
    padded: bool = False  # a key block ends with its padding column (…, m_r, 1): 0 or −∞, added to the mask tile
    mask: int | None = None  # the tile (among the core's tensors) the padding adds to
    tangents: bool = False  # a key block carries K̇, V̇ after K, V (forward mode)
    tiles: int = 0  # the core's first tensors that are n × m tiles (cut per piece); the rest (scalars, tables) whole


@dataclass(frozen=True)
class Piece:
    """Query rows ``rows`` of the rank's block (from global position ``row``) against keys ``keys`` of a key block
    (from global position ``key``); causal: the keys after a row hidden."""

    rows: slice
    row: int
    keys: slice
    key: int
    causal: bool


def _pieces(plan: Plan, origin: int):
    """The pieces of the rank's rows against origin's key block that are computed."""
    for q in plan.queries.chunks[plan.ring.rank]:
        for k in plan.keys.chunks[origin]:
            how = plan.keys.pair(q, k, plan.causal)
            if how == SKIP or not k.length:
                continue
            for first in range(0, q.length, ROWS):
                size, row = min(ROWS, q.length - first), q.start + first
                count = k.length if how == FULL else min(k.length, row + size - k.start)
                rows = slice(q.offset + first, q.offset + first + size)
                yield Piece(rows, row, slice(k.offset, k.offset + count), k.start, how == DIAGONAL)


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    return x[..., rows, :]


def _tile(x, piece: Piece, whole: bool = False) -> torch.Tensor | None:
    """A tile's entries of the piece (rows of the rank's, columns at the keys' global positions; an axis of size 1
    broadcasts); a scalar, a table (whole) or None as it is."""
    if x is None or x.dim() == 0 or whole:
        return x
    rows = piece.rows if x.shape[-2] != 1 else slice(None)
    keys = slice(piece.key, piece.key + piece.keys.stop - piece.keys.start) if x.shape[-1] != 1 else slice(None)
    return x[..., rows, keys]


def _tensors(plan: Plan, tensors, piece: Piece, block: list, Q: torch.Tensor) -> list:
    """The core's tiles and scalars for the piece, the key block's padding added to the mask tile."""
    return _padded(plan, [_tile(x, piece, i >= plan.tiles) for i, x in enumerate(tensors)], piece, block, Q)


def _padded(plan: Plan, found: list, piece: Piece, block: list, Q: torch.Tensor) -> list:
    """The piece's tensors with the key block's padding (its keys' 0 or −∞) added to the mask tile."""
    if plan.padded:
        found = list(found)
        row = block[-1][..., piece.keys, :].mT  # (…, 1, keys)
        if 2 < row.dim() < Q.dim():  # the scores have a heads axis the padding lacks
            row = row.unsqueeze(-3)
        found[plan.mask] = row if found[plan.mask] is None else found[plan.mask] + row
    return found


def _share(plan: Plan, piece: Piece, Q, K, V, tensors: list) -> tuple:
    """(the piece's share of its rows' output, its row statistic) by the eager core at the piece's positions."""
    q, k, v = _rows(Q, piece.rows), _rows(K, piece.keys), _rows(V, piece.keys)
    return plan.eager(q, k, v, piece.causal, plan.symbols, tensors, origin=(piece.row, piece.key), part="share")


def _keys(plan: Plan, block: list) -> tuple:
    """K and V of a key block: dual tensors (with K̇, V̇) in forward mode."""
    if plan.tangents:
        return forward_ad.make_dual(block[0], block[2]), forward_ad.make_dual(block[1], block[3])
    return block[0], block[1]


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


def _starts(plan: Plan) -> list[tuple[int, int]]:
    """(first row, rows) of the rank's pieces of rows, in the order of its block."""
    return [
        (c.offset + f, min(ROWS, c.length - f))
        for c in plan.queries.chunks[plan.ring.rank]
        for f in range(0, c.length, ROWS)
    ]


def _merge_block(plan: Plan, origin: int, block: list, Q: torch.Tensor, tensors, merged: dict) -> None:
    """Merge the shares of the rank's pieces of rows over origin's key block into merged (by first row)."""
    K, V = _keys(plan, block)
    for piece in _pieces(plan, origin):
        share = _share(plan, piece, Q, K, V, _tensors(plan, tensors, piece, block, Q))
        start = piece.rows.start
        merged[start] = share if start not in merged else plan.merge.combine(merged[start], share)


def ring_forward(plan: Plan, Q: torch.Tensor, keys: list, tensors) -> tuple:
    """The merged share of the rank's rows over every key block, (output, statistic), in the core's wide dtype:
    keys [K, V] (with K̇, V̇ in forward mode, Q and tensors then dual) and the padding column last where padded."""
    ring, merged = plan.ring, {}
    block = list(keys)
    for step in range(ring.world):
        origin = (ring.rank - step) % ring.world
        send = block if block and plan.keys.travels(origin, step, plan.causal) else []
        pending = ring.post(send, _receive(plan, step, tuple(keys)), KEYS)
        if block:
            _merge_block(plan, origin, block, Q, tensors, merged)
        block = pending.wait()
    return _whole(plan, merged, Q, keys[1])


def _whole(plan: Plan, merged: dict, Q: torch.Tensor, V: torch.Tensor) -> tuple:
    """The shares of every piece of rows concatenated: rows that read no key the merge's nothing."""
    known = next(iter(merged.values()), None)
    batch = known[0].shape[:-2] if known is not None else torch.broadcast_shapes(Q.shape[:-2], V.shape[:-2])
    wide = known[0].dtype if known is not None else torch.promote_types(Q.dtype, torch.float32)
    parts = []
    for start, size in _starts(plan):
        if start not in merged:
            zeros = Q.new_zeros((*batch, size, V.shape[-1]), dtype=wide)
            merged[start] = plan.merge.nothing(zeros, zeros[..., :1])
        parts.append(merged[start])
    if not parts:
        zeros = Q.new_zeros((*batch, 0, V.shape[-1]), dtype=wide)
        parts = [plan.merge.nothing(zeros, zeros[..., :1])]
    statistic = None if parts[0][1] is None else torch.cat([p[1] for p in parts], dim=-2)
    return torch.cat([p[0] for p in parts], dim=-2), statistic


def _leaf(x, wanted: bool):
    return x.detach().requires_grad_(wanted) if isinstance(x, torch.Tensor) else x


def _block_gradients(plan: Plan, origin: int, block: list, saved: dict, dO, grads: list) -> list[torch.Tensor]:
    """The rank's rows' share of dK, dV of origin's block; dQ and the tensors' gradients added into grads. Per
    piece: A_j recomputed under autograd, P_j and Ā_j by the merge, dV_j = P_jᵀ Ō (summed over a key head's group
    of query heads), and autograd pulls Ā_j back to the piece's queries, keys, tiles and scalars."""
    parts = [torch.zeros_like(block[0]), torch.zeros_like(block[1])]
    Q, tensors, (O, stat), wanted = saved["Q"], saved["tensors"], saved["merged"], saved["wanted"]
    for piece in _pieces(plan, origin):
        v = _rows(block[1], piece.keys)
        with torch.enable_grad():
            q, k = _leaf(_rows(Q, piece.rows), True), _leaf(_rows(block[0], piece.keys), True)
            tiles = [_leaf(_tile(x, piece, i >= plan.tiles), w) for i, (x, w) in enumerate(zip(tensors, wanted))]
            found = _padded(plan, tiles, piece, block, Q)
            a = plan.eager(q, k, v, piece.causal, plan.symbols, found, origin=(piece.row, piece.key), part="logits")
        merged = (_rows(O, piece.rows), None if stat is None else _rows(stat, piece.rows))
        grad = _rows(dO, piece.rows)
        p = plan.merge.weights(a.detach(), merged)
        groups = _grouped(v, a)
        dV = (p.mT @ grad).to(v.dtype)
        if groups > 1:  # a key head read by a group of query heads: its share summed over them
            dV = dV.unflatten(-3, (-1, groups)).sum(-3)
        values = v.to(a.dtype).repeat_interleave(groups, dim=-3) if groups > 1 else v.to(a.dtype)
        cotangent = plan.merge.scores(p, grad @ values.mT, grad, merged)
        leaves = [q, k] + [x for x, w in zip(tiles, wanted) if w]
        pulled = torch.autograd.grad(a, leaves, cotangent, allow_unused=True)
        _add(_rows(grads[0], piece.rows), pulled[0])
        _add(_rows(parts[0], piece.keys), pulled[1])
        _add(_rows(parts[1], piece.keys), dV.sum_to_size(v.shape))
        rest = iter(pulled[2:])
        for i, w in enumerate(wanted):
            if w:
                _add_tile(grads[1 + i], piece, next(rest), i >= plan.tiles)
    return parts


def _grouped(v: torch.Tensor, a: torch.Tensor) -> int:
    """The query heads per key head: the scores' heads over V's where V has fewer (grouped-query heads), else 1."""
    if v.dim() < 3 or a.dim() < 3 or v.shape[-3] in (1, a.shape[-3]):
        return 1
    return a.shape[-3] // v.shape[-3]


def _add(into: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is not None:
        into.add_(grad.to(into.dtype))


def _add_tile(into: torch.Tensor, piece: Piece, grad: torch.Tensor | None, whole: bool) -> None:
    """A tile's gradient of a piece added at the piece's entries (a scalar's or a table's whole)."""
    if grad is not None:
        target = _tile(into, piece, whole)
        _add(target, grad.sum_to_size(target.shape))


def _home(plan: Plan, like: tuple) -> tuple[Pending | None, int | None]:
    """(the receive of the own block's partials, home from the last rank that reads it, or None where no other rank
    reads it; that rank). Posted before the loop where that rank is not the previous one (its only message here: the
    sender's wait never waits for this rank's loop), else after it (in the order of that rank's other messages)."""
    ring = plan.ring
    last = max(s for s in range(ring.world) if s == 0 or plan.keys.travels(ring.rank, s - 1, plan.causal))
    source = (ring.rank + last) % ring.world
    if not last or source == (ring.rank - 1) % ring.world:
        return None, source if last else None
    return ring.receive_from(source, _buffers(plan, ring.rank, like), RETURNED), None


def ring_backward(plan: Plan, block: list, saved: dict, dO: torch.Tensor) -> tuple[list, torch.Tensor, torch.Tensor]:
    """([dQ, each tensor's gradient (None: not wanted)], dK, dV) of the rank's rows: its queries' over every key
    block ([K, V] and the padding column where there is one), its keys' from every rank's queries. Each step posts,
    in one batch, the partials of the block it leaves to the next rank and the receive of those of the block it
    gets next (one partial send in flight)."""
    ring, keys, causal = plan.ring, plan.keys, plan.causal
    Q = saved["Q"]
    grads = [torch.zeros_like(Q)] + [
        torch.zeros_like(x) if w else None for x, w in zip(saved["tensors"], saved["wanted"])
    ]
    like, shapes = tuple(block[:2]), tuple(block)
    partials, own, returning = None, None, None
    home, late = _home(plan, like)
    for step in range(ring.world):
        origin = (ring.rank - step) % ring.world
        travels = bool(block) and keys.travels(origin, step, causal)
        pending = ring.post(block if travels else [], _receive(plan, step, shapes), KEYS)
        parts = []
        if block:
            parts = _block_gradients(plan, origin, block, saved, dO, grads)
            if partials is not None and partials.received:  # this block's partials from the ranks before
                parts = [a.add_(b) for a, b in zip(partials.wait(), parts)]
        if partials is not None:
            partials.wait()  # the previous block's partials sent
        arriving = _buffers(plan, (origin - 1) % ring.world, like) if pending.received else []
        partials = ring.post(parts if travels else [], arriving, GRADIENTS) if travels or arriving else None
        if block and not travels and origin != ring.rank:
            if returning is not None:  # one block's partials on their way home at a time
                returning.wait()
            returning = ring.post(parts, [], RETURNED, to=origin)
        elif block and not travels:
            own = parts
        block = pending.wait()
    if late is not None:
        home = ring.receive_from(late, _buffers(plan, ring.rank, like), RETURNED)
    own = home.wait() if home is not None else own
    for pending in (partials, returning):
        if pending is not None:
            pending.wait()
    return grads, own[0], own[1]


class RingFunction(torch.autograd.Function):
    """The ring as an autograd Function: apply(plan, Q, K, V, padding column or None, *tensors) → the rank's rows
    of O; its backward the ring's."""

    @staticmethod
    def forward(ctx, plan: Plan, Q, K, V, padding, *tensors):
        block = [K, V] if padding is None else [K, V, padding]
        merged = ring_forward(plan, Q, block, tensors)
        O = plan.merge.finish(merged)
        ctx.save_for_backward(Q, K, V, padding, O, merged[1], *tensors)
        ctx.plan, ctx.count = plan, len(tensors)
        return O.to(V.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO):
        Q, K, V, padding, O, statistic, *tensors = ctx.saved_tensors
        wanted = [
            isinstance(x, torch.Tensor) and x.is_floating_point() and w
            for x, w in zip(tensors, ctx.needs_input_grad[5:])
        ]
        saved = {"Q": Q, "tensors": tensors, "merged": (O, statistic), "wanted": wanted}
        block = [K, V] if padding is None else [K, V, padding]
        grads, dK, dV = ring_backward(ctx.plan, block, saved, dO.to(O.dtype))
        return (None, grads[0], dK, dV, None, *grads[1:])
