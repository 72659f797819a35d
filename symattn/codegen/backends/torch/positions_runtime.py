"""The torch modules' runtime for matrices of positions (``sa.entries``) and the tables they read: copied into a
generated module that computes one, as the other runtime helpers are.

A table's cotangent is a segment sum (``table_scatter``), the same bits on every run on every device without
``torch.use_deterministic_algorithms``: on CPU ``index_add`` (out of place: torch.func's vmap takes it), which adds
the positions one after another in row-major order; elsewhere the positions sorted by the entry they read (a stable
sort, so each entry's positions keep their row-major order), then ``torch.segment_reduce`` sums each entry's run of
positions: no CUDA ``index_add_`` or ``scatter_add_``, whose atomic sums depend on the order threads arrive in."""

from __future__ import annotations

import torch

from symattn.codegen.backends.common_runtime import _map_entry, _parts_looked_at, block_rows
from symattn.codegen.backends.torch.runtime import _functional  # (a generated module has it beside)


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
    with the table's leading axes first; indices of fewer than two axes read as 1 × 1 or 1 × k (a read at constant
    indices of a table per sequence, p[0, 0], broadcasts against the grids, not along them)."""
    r = torch.as_tensor(rows, device=table.device).long()
    c = torch.as_tensor(cols, device=table.device).long()
    return table[..., torch.atleast_2d(r), torch.atleast_2d(c)]


def indexed_read(table, rows, cols, name, source):
    """table[..., r, c] at index grids r and c read from a constant (source, Swin's idx of T[idx[i, j], h]): no size
    bounds their values, so each is checked, an integer inside the table (name), else ValueError naming the
    constant and the value; never a read outside the table."""
    for grid, size, what in ((rows, table.shape[-2], "row"), (cols, table.shape[-1], "column")):
        checked_index(torch.as_tensor(grid, device=table.device), size, what, name, source)
    return table_read(table, rows, cols)


def checked_index(grid, size, what, name, source):
    """A ValueError unless every value of grid, indices read from a constant (source) into a table (name) of size
    rows (what: "row") or columns, is an integer in [0, size − 1]; a float grid whose integers stop being exact
    below size is refused too. (The Triton modules check a whole index constant so before any launch.)"""
    if grid.is_floating_point() and size - 1 > 2 / torch.finfo(grid.dtype).eps:
        raise ValueError(_inexact(source, name, size, what, grid.dtype, 2 / torch.finfo(grid.dtype).eps))
    bad = (grid < 0) | (grid > size - 1) | (grid != torch.floor(grid))
    if bool(bad.any()):
        raise ValueError(
            f"{source} gives {name} the {what} index {grid[bad].flatten()[0].item()!r}: an index read from a "
            f"constant is an integer in [0, {size - 1}] ({name} has {size} {what}s)"
        )


def _inexact(source, name, size, what, dtype, limit):
    """Why an index constant in dtype cannot index a table of size rows (its integers exact only up to limit)."""
    return (
        f"{source} is {dtype}, whose integers are exact only up to {int(limit)}, and {name} has {size} {what}s: "
        "run in float32 or wider (a constant takes the inputs' dtype)"
    )


def table_scatter(w, index, rows, cols, by_sorting=None):
    """[Σ_{(i, j): index(i, j) = (k, l)} w_ij]_kl, rows × cols (w's leading axes kept): each table entry collects w at
    the positions that read it, in row-major order of the positions (by_sorting: a stable sort then a segment sum,
    None: off CPU only)."""
    n, m = w.shape[-2:]
    return block_scatter(w, index, rows, cols, slice(0, n), slice(0, m), by_sorting=by_sorting)


def block_scatter(w, index, rows, cols, block, keys, heads=None, by_sorting=None):
    """The part of a table's cotangent a block adds: [Σ_{(i, j) in the block: index(i, j) = (k, l)} w_ij]_kl, rows ×
    cols, w (..., b, k) at the query rows block.start … and the keys keys.start … (with heads (..., heads, b, k) and
    index(i, j, h)); each table entry collects w in row-major order of the block's positions (by_sorting: a stable
    sort then a segment sum, None: off CPU only), w's other leading axes kept."""
    shape = w.shape[-2:] if heads is None else w.shape[-3:]
    wide = torch.promote_types(w.dtype, torch.float32)
    i = torch.arange(block.start, block.start + shape[-2], dtype=wide, device=w.device)[:, None]
    j = torch.arange(keys.start, keys.start + shape[-1], dtype=wide, device=w.device)[None, :]
    grids = (i, j) if heads is None else (i, j, torch.arange(heads, dtype=wide, device=w.device)[:, None, None])
    r, c = (torch.as_tensor(x, device=w.device).long() for x in index(*grids))
    flat = torch.broadcast_to(r * cols + c, shape).reshape(-1)
    lead = w.shape[: w.dim() - len(shape)]
    values = w.reshape(lead.numel(), flat.numel()).mT  # (the positions, the leading axes flattened)
    if not (w.device.type != "cpu" if by_sorting is None else by_sorting):  # CPU: sequential, 7 times faster
        sums = values.new_zeros(rows * cols, values.shape[1]).index_add(0, flat, values)
    else:
        order = torch.argsort(flat, stable=True)
        lengths = torch.bincount(flat, minlength=rows * cols)
        sums = torch.segment_reduce(values[order], "sum", lengths=lengths, axis=0)
    return sums.mT.reshape(*lead, rows, cols)


def block_entries(f, rows, keys, n, dtype, device, heads=None):
    """The block of [f(i, j)] at the query rows rows (a slice of 0 … n − 1) and the keys keys (a slice): f of the
    block's own positions, (b, k), or with heads f(i, j, h) of the heads h = 0 … heads − 1, (heads, b, k), after
    the leading axes of a table f reads per sequence (the grids then 1 × b × 1 and 1 × 1 × k: such a read
    keeps its axes before the heads'); grids of at least float32 (positions exact), cast to dtype."""
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows.start, min(rows.stop, n), dtype=wide, device=device)[:, None]
    j = torch.arange(keys.start, keys.stop, dtype=wide, device=device)[None, :]
    shape = (len(i), j.shape[1]) if heads is None else (heads, len(i), j.shape[1])
    grids = (
        (i, j) if heads is None else (i[None], j[None], torch.arange(heads, dtype=wide, device=device)[:, None, None])
    )
    value = torch.as_tensor(f(*grids), dtype=dtype, device=device)  # (a table per sequence: its leading axes)
    return torch.broadcast_to(value, torch.broadcast_shapes(value.shape, shape))


def hide_keys(scores, hidden, rows, keys, n, open_keys, dtype, device, heads=None, inplace=True, blocks=None):
    """scores (..., b, k) of the query rows rows and the keys keys plus a mask of positions: -inf written where
    hidden(i, j) (per head hidden(i, j, h)) holds, not looked for on the keys of open_keys (a range every row of the
    block sees) at one end of keys, nor on the wholly open key blocks of a block map (``block_map``); into scores
    where inplace (a value made for it), else into a copy."""
    entry = None if blocks is None else _map_entry(blocks, rows)
    out = scores if inplace and not _functional(scores) else scores.clone()
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(rows.start, min(rows.stop, n), dtype=wide, device=device)[:, None]
    h = None if heads is None else torch.arange(heads, dtype=wide, device=device)[:, None, None]
    for first, stop in _parts_looked_at(keys, open_keys, () if entry is None else entry[2]):
        j = torch.arange(first, stop, dtype=wide, device=device)[None, :]
        where = hidden(i, j) if heads is None else hidden(i[None], j[None], h)  # (a read per sequence: …, 1, b, k)
        out[..., first - keys.start : stop - keys.start].masked_fill_(where, float("-inf"))
    return out


def block_map(test, reads, n, m, size, dtype, device):
    """The block map of a mask on data (``optimize.block_tests``) for blocks of size query rows and size keys, per
    call, O(n/size · m/size), on device (``block_classes``); a pair counts where it does for every sequence. As
    ``block_rows`` gives it (the nb × mb booleans copied to the host once). Under torch.compile or torch.func's
    transforms of the values (no branch on them there), and off the CPU (where nothing is read back to decide a path:
    no wait for the device at every call): an empty map, every block computed with the mask."""
    if torch.device(device).type != "cpu" or any(_functional(torch.as_tensor(values)) for values, _ in reads):
        return size, []
    classes = block_classes(test, reads, n, m, size, size, dtype, device)
    empty, full = (x.reshape(-1, *x.shape[-2:]).all(dim=0) for x in classes)
    return block_rows(empty.tolist(), full.tolist(), size, m)


def block_classes(test, reads, n, m, rows, cols, dtype, device):
    """(empty, full) of a mask on data (``optimize.block_tests``) over every pair of a block of rows query rows and a
    block of cols keys, per sequence: booleans (..., ⌈n/rows⌉, ⌈m/cols⌉), the leading axes the reads' broadcast, by
    torch ops on device (no loop over blocks). test(i, i_last, j, j_last, t0_lo, t0_hi, …) → (empty, full), i, i_last
    a column of the row blocks' first and last rows, j, j_last a row of the key blocks', each read (values, along)
    given by its least and greatest value over the block ("i": values of the rows, "j": of the keys, None: one per
    sequence)."""
    wide = torch.promote_types(dtype, torch.float32)
    i = torch.arange(0, n, rows, dtype=wide, device=device)[:, None]
    j = torch.arange(0, m, cols, dtype=wide, device=device)[None, :]
    bounds = []
    for values, along in reads:
        values = torch.as_tensor(values, device=device).to(wide)
        extremes = _block_extremes(values, rows if along == "i" else cols) if along else (values[..., None, None],) * 2
        bounds += [x[..., None] if along == "i" else x[..., None, :] if along else x for x in extremes]
    tests = test(i, (i + rows - 1).clamp(max=n - 1), j, (j + cols - 1).clamp(max=m - 1), *bounds)
    tests = [torch.as_tensor(x, device=device) for x in tests]
    shape = torch.broadcast_shapes(*(x.shape for x in tests), (i.shape[0], j.shape[1]))
    return tuple(x.expand(shape) for x in tests)


def _block_extremes(values, size):
    """(least, greatest) of values (..., count) over each block of size entries along the last axis (the last block
    maybe shorter)."""
    count = values.shape[-1]
    blocks = -(-count // size)
    if count and blocks * size > count:  # the last block padded with its last value
        values = torch.cat([values, values[..., -1:].expand(*values.shape[:-1], blocks * size - count)], dim=-1)
    values = values.unflatten(-1, (blocks, size))
    return (values.amin(dim=-1), values.amax(dim=-1)) if count else (values[..., 0], values[..., 0])
