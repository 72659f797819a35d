"""Runtime helpers of NumPy code printed by ``NumPyMatrixPrinter``: the nodes NumPy has no function for.

Real code, linted and tested; a printer copies the source of the ones an expression calls
(read with ``ast``) into the code it prints, which then needs only ``numpy as np``.
"""

from __future__ import annotations

import numpy as np


def row_softmax(a):
    """softmax along the last axis, the row max subtracted first."""
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def log_softmax(a):
    """log softmax along the last axis: A − max − log(rowsum(exp(A − max))), the row max subtracted first."""
    shifted = a - a.max(axis=-1, keepdims=True, initial=-np.inf)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def sigmoid(a):
    """1 / (1 + exp(-a)), entrywise."""
    return 1.0 / (1.0 + np.exp(-a))


def silu(a):
    """a σ(a), entrywise."""
    return a / (1.0 + np.exp(-a))


def softplus(a):
    """log(1 + exp(a)), entrywise, without overflow."""
    return np.logaddexp(0.0, a)


def split_heads(a, heads):
    """(..., n, heads * k) -> (..., heads, n, k)."""
    return np.swapaxes(a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads), -2, -3)


def merge_heads(a, heads):
    """(..., heads, n, k) -> (..., n, heads * k)."""
    a = np.swapaxes(a, -2, -3)
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def repeat_heads(a, heads):
    """(..., kv_heads, n, k) -> (..., heads, n, k): head h reads kv head h // (heads // kv_heads)."""
    return a if a.shape[-3] == heads else np.repeat(a, heads // a.shape[-3], axis=-3)


def sum_groups(a, heads):
    """(..., H, n, k) -> (..., heads, n, k): each group of H // heads consecutive heads summed."""
    if a.shape[-3] == heads:
        return a
    return a.reshape(*a.shape[:-3], heads, a.shape[-3] // heads, *a.shape[-2:]).sum(axis=-3)


def erf(x):
    """erf(x) = 2/√π exp(−x²) Σ_k 2^k x^(2k+1) / (1·3·…·(2k+1)): positive terms, no cancellation;
    ±1 to double precision past |x| = 6."""
    a = np.clip(x, -6.0, 6.0)
    a2 = a * a
    term = a * 1.0
    total = a * 1.0
    for k in range(1, 160):
        term = term * (2.0 * a2) / (2 * k + 1)
        total = total + term
        if np.all(np.abs(term) <= 1e-17 * np.abs(total)):
            break
    return 1.1283791670955126 * np.exp(-a2) * total


def gelu(a):
    """x Φ(x) = x (1 + erf(x / √2)) / 2, entrywise."""
    return 0.5 * a * (1.0 + erf(a * 0.7071067811865476))


def gelu_grad(a):
    """GELU′(x) = Φ(x) + x φ(x), entrywise."""
    return 0.5 * (1.0 + erf(a * 0.7071067811865476)) + a * np.exp(-0.5 * a * a) * 0.3989422804014327


def gelu_tanh(a):
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""
    return 0.5 * a * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))


def gelu_tanh_grad(a):
    """The derivative of gelu_tanh: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2, t = tanh(k (x + c x³))."""
    t = np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)


def layer_norm(a, eps):
    """Each row standardised: (a − mean) / √(biased variance + eps), along the last axis."""
    c = a - a.mean(axis=-1, keepdims=True)
    return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def row_inv_std(a, eps):
    """1 / √(biased variance + eps) of each row, as a column (..., n, 1)."""
    c = a - a.mean(axis=-1, keepdims=True)
    return 1.0 / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def entries(f, rows, cols, dtype=np.float64):
    """[f(i, j)], rows × cols: f of the row positions i (a column) and the column positions j (a row), on grids of
    at least float32 (positions exact), cast to dtype; a branch of a where computed where it is not taken warns of
    nothing."""
    wide = np.promote_types(dtype, np.float32)
    i, j = np.arange(rows, dtype=wide)[:, None], np.arange(cols, dtype=wide)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):  # a where's branch not taken (log 0 of a bucket's log)
        value = np.asarray(f(i, j), dtype=dtype)
    return np.broadcast_to(value, np.broadcast_shapes(value.shape, (rows, cols)))


def table_read(table, rows, cols):
    """table[..., r, c] at the index grids r and c (positions held exactly in floats): broadcast against each other,
    with the table's leading axes first; indices of fewer than two axes read as 1 × 1 or 1 × k (a read at constant
    indices of a table per sequence, p[0, 0], broadcasts against the grids, not along them)."""
    return table[
        ..., np.atleast_2d(np.asarray(rows).astype(np.int64)), np.atleast_2d(np.asarray(cols).astype(np.int64))
    ]


def indexed_read(table, rows, cols, name, source):
    """table[..., r, c] at index grids r and c read from a constant (source, Swin's idx of T[idx[i, j], h]): no size
    bounds their values, so each is checked, an integer inside the table (name), else ValueError naming the
    constant and the value; never a read outside the table."""
    for grid, size, what in ((rows, table.shape[-2], "row"), (cols, table.shape[-1], "column")):
        grid = np.asarray(grid)
        if np.issubdtype(grid.dtype, np.floating) and size - 1 > 2 / np.finfo(grid.dtype).eps:
            raise ValueError(_inexact(source, name, size, what, grid.dtype, 2 / np.finfo(grid.dtype).eps))
        bad = (grid < 0) | (grid > size - 1) | (grid != np.floor(grid))
        if bad.any():
            raise ValueError(
                f"{source} gives {name} the {what} index {grid[bad].flat[0].item()!r}: an index read from a "
                f"constant is an integer in [0, {size - 1}] ({name} has {size} {what}s)"
            )
    return table_read(table, rows, cols)


def _inexact(source, name, size, what, dtype, limit):
    """Why an index constant in dtype cannot index a table of size rows (its integers exact only up to limit)."""
    return (
        f"{source} is {dtype}, whose integers are exact only up to {int(limit)}, and {name} has {size} {what}s: "
        "run in float32 or wider (a constant takes the inputs' dtype)"
    )


def table_scatter(w, index, rows, cols):
    """[Σ_{(i, j): index(i, j) = (k, l)} w_ij]_kl, rows × cols (w's leading axes kept): each table entry collects w at
    the positions that read it, in row-major order of the positions (np.add.at, unbuffered, in index order)."""
    n, m = w.shape[-2:]
    return block_scatter(w, index, rows, cols, slice(0, n), slice(0, m))


def block_scatter(w, index, rows, cols, block, keys, heads=None):
    """The part of a table's cotangent a block adds: [Σ_{(i, j) in the block: index(i, j) = (k, l)} w_ij]_kl, rows ×
    cols, w (..., b, k) at the query rows block.start … and the keys keys.start … (with heads (..., heads, b, k) and
    index(i, j, h)); each table entry collects w in row-major order of the block's positions (np.add.at,
    unbuffered, in index order), w's other leading axes kept."""
    shape = w.shape[-2:] if heads is None else w.shape[-3:]
    wide = np.promote_types(w.dtype, np.float32)
    i = np.arange(block.start, block.start + shape[-2], dtype=wide)[:, None]
    j = np.arange(keys.start, keys.start + shape[-1], dtype=wide)[None, :]
    grids = (i, j) if heads is None else (i, j, np.arange(heads, dtype=wide)[:, None, None])
    r, c = (np.asarray(x).astype(np.int64) for x in index(*grids))
    flat = np.broadcast_to(r * cols + c, shape).reshape(-1)
    lead = w.shape[: w.ndim - len(shape)]
    sums = np.zeros((rows * cols, *lead), dtype=w.dtype)
    np.add.at(sums, flat, np.moveaxis(w.reshape(*lead, flat.size), -1, 0))
    return np.moveaxis(sums, 0, -1).reshape(*lead, rows, cols)


def block_entries(f, rows, keys, n, dtype=np.float64, heads=None):
    """The block of [f(i, j)] at the query rows rows (a slice of 0 … n − 1) and the keys keys (a slice): f of the
    block's own positions, (b, k), or with heads f(i, j, h) of the heads h = 0 … heads − 1, (heads, b, k), after
    the leading axes of a table f reads per sequence (the grids then 1 × b × 1 and 1 × 1 × k: such a read
    keeps its axes before the heads'); grids of at least float32 (positions exact), cast to dtype."""
    wide = np.promote_types(dtype, np.float32)
    i = np.arange(rows.start, min(rows.stop, n), dtype=wide)[:, None]
    j = np.arange(keys.start, keys.stop, dtype=wide)[None, :]
    shape = (len(i), j.shape[1]) if heads is None else (heads, len(i), j.shape[1])
    grids = (i, j) if heads is None else (i[None], j[None], np.arange(heads, dtype=wide)[:, None, None])
    with np.errstate(divide="ignore", invalid="ignore"):  # a where's branch not taken
        value = np.asarray(f(*grids), dtype=dtype)  # (a table per sequence: its leading axes)
    return np.broadcast_to(value, np.broadcast_shapes(value.shape, shape))


def fixed_dropout_mask(a, p):
    """Dropout's mask as verification evaluates it: one fixed Bernoulli(1 − p) / (1 − p) draw per shape of a (the
    same at every point a derivation is checked, a constant of the call), a's dtype."""
    keep = np.random.default_rng(list(np.shape(a))).random(np.shape(a)) >= p
    return keep.astype(np.result_type(a, np.float64)) / (1.0 - p)
