"""The torch modules' runtime for matrices of positions (``sa.entries``): copied into a generated module that
computes one, as the other runtime helpers are."""

from __future__ import annotations

import torch

from symattn.codegen.backends.torch.runtime import _functional  # (a generated module has it beside)


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


def hide_keys(scores, hidden, rows, keys, n, open_keys, dtype, device, heads=None, inplace=True):
    """scores (..., b, k) of the query rows rows and the keys keys plus a mask of positions: -inf written where
    hidden(i, j) (per head hidden(i, j, h)) holds, not looked for on the keys of open_keys (a range every row of the
    block sees) at one end of keys; into scores where inplace (a value made for it), else into a copy."""
    first, stop = keys.start, keys.stop  # the keys looked at: less an open range at one end (one part, one fill)
    if open_keys.start <= first < open_keys.stop:
        first = min(open_keys.stop, stop)
    elif open_keys.start < stop <= open_keys.stop:
        stop = max(open_keys.start, first)
    out = scores if inplace and not _functional(scores) else scores.clone()
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows.start, min(rows.stop, n), dtype=wide, device=device)[:, None]
    h = None if heads is None else torch.arange(heads, dtype=wide, device=device)[:, None, None]
    if first < stop:
        j = torch.arange(first, stop, dtype=wide, device=device)[None, :]
        where = hidden(i, j) if heads is None else hidden(i, j, h)
        out[..., first - keys.start : stop - keys.start].masked_fill_(where, float("-inf"))
    return out
