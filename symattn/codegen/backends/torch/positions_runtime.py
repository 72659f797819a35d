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
