"""The torch modules' runtime for matrices of positions (``sa.entries``) and the tables they read: copied into a
generated module that computes one, as the other runtime helpers are.

A table's cotangent is a segment sum (``table_scatter``), the same bits on every run on every device without
``torch.use_deterministic_algorithms``: on CPU ``index_add`` (out of place: torch.func's vmap takes it), which adds
the positions one after another in row-major order; elsewhere the positions sorted by the entry they read (a stable
sort, so each entry's positions keep their row-major order), then ``torch.segment_reduce`` sums each entry's run of
positions: no CUDA ``index_add_`` or ``scatter_add_``, whose atomic sums depend on the order threads arrive in."""

from __future__ import annotations

import torch


def entries(f, rows, cols, dtype, device):
    """[f(i, j)], rows × cols: f of the row positions i (a column) and the column positions j (a row), on grids of
    at least float32 (positions exact), cast to dtype."""
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows, dtype=wide, device=device)[:, None]
    j = torch.arange(cols, dtype=wide, device=device)[None, :]
    value = torch.as_tensor(f(i, j), dtype=dtype, device=device)
    return torch.broadcast_to(value, torch.broadcast_shapes(value.shape, (rows, cols)))


def table_read(table, rows, cols):
    """table[..., r, c] at the index grids r and c (positions held exactly in floats): broadcast against each other,
    with the table's leading axes first."""
    r = torch.as_tensor(rows, device=table.device).long()
    c = torch.as_tensor(cols, device=table.device).long()
    return table[..., r, c]


def table_scatter(w, index, rows, cols, by_sorting=None):
    """[Σ_{(i, j): index(i, j) = (k, l)} w_ij]_kl, rows × cols (w's leading axes kept): each table entry collects w at
    the positions that read it, in row-major order of the positions (by_sorting: a stable sort then a segment sum,
    None: off CPU only)."""
    n, m = w.shape[-2:]
    wide = torch.promote_types(w.dtype, torch.float32)
    i = torch.arange(n, dtype=wide, device=w.device)[:, None]
    j = torch.arange(m, dtype=wide, device=w.device)[None, :]
    r, c = (torch.as_tensor(x, device=w.device).long() for x in index(i, j))
    flat = torch.broadcast_to(r * cols + c, (n, m)).reshape(-1)
    values = w.reshape(-1, n * m).mT  # (n·m, the leading axes flattened)
    if not (w.device.type != "cpu" if by_sorting is None else by_sorting):  # CPU: sequential, 7 times faster
        sums = values.new_zeros(rows * cols, values.shape[1]).index_add(0, flat, values)
    else:
        order = torch.argsort(flat, stable=True)
        lengths = torch.bincount(flat, minlength=rows * cols)
        sums = torch.segment_reduce(values[order], "sum", lengths=lengths, axis=0)
    return sums.mT.reshape(*w.shape[:-2], rows, cols)
