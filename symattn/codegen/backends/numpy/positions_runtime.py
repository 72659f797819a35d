"""The NumPy modules' runtime for masks of positions in a loop over blocks of rows: the fill of a mask's −∞
(``hide_keys``) and the block map of a mask on data (``block_map``, ``optimize.block_tests``); copied into a
generated module that calls them, as the other runtime helpers are."""

from __future__ import annotations

import numpy as np

from symattn.codegen.backends.common_runtime import _map_entry, _parts_looked_at, block_rows


def hide_keys(scores, hidden, rows, keys, n, open_keys, dtype, heads=None, inplace=True, blocks=None):
    """scores (..., b, k) of the query rows rows and the keys keys plus a mask of positions: -inf written where
    hidden(i, j) (per head hidden(i, j, h)) holds, not looked for on the keys of open_keys (a range every row of the
    block sees) at one end of keys, nor on the wholly open key blocks of a block map (``block_map``); into scores
    where inplace (a value made for it), else into a copy."""
    entry = None if blocks is None else _map_entry(blocks, rows)
    out = scores if inplace else scores.copy()
    wide = np.promote_types(dtype, np.float32)
    i = np.arange(rows.start, min(rows.stop, n), dtype=wide)[:, None]
    h = None if heads is None else np.arange(heads, dtype=wide)[:, None, None]
    for first, stop in _parts_looked_at(keys, open_keys, () if entry is None else entry[2]):
        j = np.arange(first, stop, dtype=wide)[None, :]
        where = hidden(i, j) if heads is None else hidden(i[None], j[None], h)  # (a read per sequence: …, 1, b, k)
        np.copyto(out[..., first - keys.start : stop - keys.start], -np.inf, where=where)
    return out


def block_map(test, reads, n, m, size, dtype):
    """The block map of a mask on data (``optimize.block_tests``) for blocks of size query rows and size keys, per
    call, O(n/size · m/size): test(i, i_last, j, j_last, t0_lo, t0_hi, …) → (empty, full) over every pair of blocks
    (i, i_last a column of the row blocks' first and last rows, j, j_last a row of the key blocks'), each read
    (values, along) given by its least and greatest value over the block ("i": values of the rows, "j": of the keys,
    None: one per sequence); a pair counts where it does for every sequence. As ``block_rows`` gives it."""
    wide = np.promote_types(dtype, np.float32)
    i, j = np.arange(0, n, size, dtype=wide)[:, None], np.arange(0, m, size, dtype=wide)[None, :]
    bounds = []
    for values, along in reads:
        values = np.asarray(values).astype(wide)
        extremes = _block_extremes(values, size) if along else (values[..., None, None],) * 2
        bounds += [x[..., None] if along == "i" else x[..., None, :] if along else x for x in extremes]
    tests = test(i, np.minimum(i + size - 1, n - 1), j, np.minimum(j + size - 1, m - 1), *bounds)
    shape = np.broadcast_shapes(*(np.shape(x) for x in tests), (i.shape[0], j.shape[1]))
    empty, full = (np.broadcast_to(x, shape).reshape(-1, *shape[-2:]).all(axis=0) for x in tests)
    return block_rows(empty.tolist(), full.tolist(), size, m)


def _block_extremes(values, size):
    """(least, greatest) of values (..., count) over each block of size entries along the last axis (the last block
    maybe shorter)."""
    count = values.shape[-1]
    blocks = -(-count // size)
    if count and blocks * size > count:  # the last block padded with its last value
        values = np.concatenate([values, np.repeat(values[..., -1:], blocks * size - count, axis=-1)], axis=-1)
    values = values.reshape(*values.shape[:-1], blocks, size)
    return (values.min(axis=-1), values.max(axis=-1)) if count else (values[..., 0], values[..., 0])
