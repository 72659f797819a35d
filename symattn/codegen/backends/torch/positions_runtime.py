"""The torch modules' runtime for matrices of positions (``sa.entries``): copied into a generated module that
computes one, as the other runtime helpers are."""

from __future__ import annotations

import torch


def entries(f, rows, cols, dtype, device):
    """[f(i, j)], rows × cols: f of the row positions i (a column) and the column positions j (a row), on grids of
    at least float32 (positions exact), cast to dtype."""
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows, dtype=wide, device=device)[:, None]
    j = torch.arange(cols, dtype=wide, device=device)[None, :]
    return torch.broadcast_to(torch.as_tensor(f(i, j), dtype=dtype, device=device), (rows, cols))


def block_entries(f, rows, keys, n, dtype, device, heads=None):
    """The block of [f(i, j)] at the query rows rows (a slice of 0 … n − 1) and the keys keys (a slice): f of the
    block's own positions, (b, k), or with heads f(i, j, h) of the heads h = 0 … heads − 1, (heads, b, k); grids of
    at least float32 (positions exact), cast to dtype."""
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows.start, min(rows.stop, n), dtype=wide, device=device)[:, None]
    j = torch.arange(keys.start, keys.stop, dtype=wide, device=device)[None, :]
    shape = (len(i), j.shape[1])
    if heads is None:
        return torch.broadcast_to(torch.as_tensor(f(i, j), dtype=dtype, device=device), shape)
    h = torch.arange(heads, dtype=wide, device=device)[:, None, None]
    return torch.broadcast_to(torch.as_tensor(f(i, j, h), dtype=dtype, device=device), (heads, *shape))
