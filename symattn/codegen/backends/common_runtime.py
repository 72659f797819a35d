"""Runtime helpers every generated module calls, whatever its backend: plain Python (``math`` its one import).

Real code, linted and tested; the generated-code printers copy the source of the ones a module
calls (read with ``ast``). ``SHAPES`` stands for the generated module's own constant.
"""

from __future__ import annotations

SHAPES: dict[str, str] = {}  # input name -> its shape as the docstring writes it, e.g. "(..., n, d_k)"
DIRECTION_OF: dict[str, str] = {}  # a module with a second closed form: input name -> its direction's name


def add_optional(a, b):
    """a + b, or a itself when b is None (an absent bias or mask)."""
    return a if b is None else a + b


def block_starts(rows, size):
    """The first row of each block of size rows: one block where rows ≤ size (a traced run under torch.compile's
    dynamic shapes keeps one graph for every length up to size, not one per length), and one pass with no rows
    (results get their shapes)."""
    return (0,) if rows <= size else range(0, rows, size)


def key_window(lo, hi, m, within=None, rows=None, maps=()):
    """The keys a block of query rows reads: [lo, hi), outside which a position mask hides every key from every row
    of the block (its structure, ``optimize.mask_structure``), within the key range a mask argument leaves (a slice)
    and the keys each block map (``block_map``: a mask on data) leaves the block of rows rows, clipped to 0 … m,
    never empty (every key hidden: one read, its probability zero)."""
    if within is not None:
        lo, hi = max(lo, within.start), min(hi, within.stop)
    for blocks in maps:
        entry = _map_entry(blocks, rows)
        if entry is not None:
            lo, hi = max(lo, entry[0]), min(hi, entry[1])
    lo = min(max(lo, 0), m - 1)
    return slice(lo, max(min(hi, m), lo + 1))


def _keys_looked_at(keys, open_keys):
    """(first, stop): the keys of a block (a slice) a mask of positions is looked for on, less a range every row of
    the block sees (open_keys) at one end of them: one part, one fill."""
    first, stop = keys.start, keys.stop
    if open_keys.start <= first < open_keys.stop:
        first = min(open_keys.stop, stop)
    elif open_keys.start < stop <= open_keys.stop:
        stop = max(open_keys.start, first)
    return first, stop


def _parts_looked_at(keys, open_keys, runs=()):
    """[(first, stop), …]: the parts of a block's keys a mask is looked for on, less open_keys at one end
    (``_keys_looked_at``) and less the runs (sorted disjoint slices of keys every row of the block sees, from a block
    map) wherever they lie: one fill per part."""
    first, stop = _keys_looked_at(keys, open_keys)
    parts = []
    for run in runs:
        if run.stop <= first or run.start >= stop:
            continue
        if run.start > first:
            parts.append((first, run.start))
        first = max(first, run.stop)
    return [*parts, (first, stop)] if first < stop else parts


def block_rows(empty, full, size, m):
    """A block map as the loop reads it, (size, entries) from empty and full (nested lists [row block][key block] of
    bools: no pair of the two blocks visible, every pair visible): per block of size rows, (lo, hi, runs): [lo, hi)
    from its first to its last key block some row may see (the key blocks outside wholly masked: never computed),
    runs the slices of keys (adjacent wholly open key blocks merged) every row sees (the mask not applied there)."""
    entries = []
    for hides, opens in zip(empty, full):
        seen = [k for k, hide in enumerate(hides) if not hide]
        runs = []
        for k, whole in enumerate(opens):
            if whole and runs and runs[-1][1] == k * size:
                runs[-1][1] = min(m, (k + 1) * size)
            elif whole:
                runs.append([k * size, min(m, (k + 1) * size)])
        lo, hi = (seen[0] * size, min(m, (seen[-1] + 1) * size)) if seen else (0, 0)
        entries.append((lo, hi, [slice(a, b) for a, b in runs]))
    return size, entries


def _map_entry(blocks, rows):
    """The entry (lo, hi, runs) of a block map (``block_rows``) for the block of rows rows (a slice), or None (no
    such block: no rows)."""
    size, entries = blocks
    k = rows.start // size
    return entries[k] if k < len(entries) else None


def size_math(function, x):
    """function (exp, log, tanh, sin, cos) of x, a number made of sizes (log n), by Python's math: a Python float."""
    import math

    return getattr(math, function)(x)


def _check_shape(name, a, dims):
    """a's last two axes against the dimensions read off the inputs."""
    if tuple(a.shape[-2:]) != dims:
        batch = "..., " if a.ndim > 2 or SHAPES[name].startswith("(...") else ""
        raise ValueError(f"{name}: expected shape {SHAPES[name]} = ({batch}{dims[0]}, {dims[1]}), got {tuple(a.shape)}")


def _quotient(name, shape, divisor):
    """shape[-1] // divisor, which must divide it."""
    if shape[-1] % divisor:
        raise ValueError(f"{name}: expected shape {SHAPES[name]}, the last axis a multiple of {divisor}, got {shape}")
    return shape[-1] // divisor


def _mask_layout(name, shape, n, m, batch):
    """(the shape a mask given in its position is viewed at, the shape it is read at): (n, m) and (*batch, n, m) as
    given; torch's layout with a heads axis of size 1, one axis more than the query's batch ((B, 1, n, m), a padding
    row (B, 1, 1, m)), viewed without it; a shape that broadcasts to (*batch, n, m) read broadcast to it. Any other
    shape is a ValueError naming the mask."""
    shape = tuple(shape)
    full = (*batch, n, m)
    viewed = shape[:-3] + shape[-2:] if len(shape) == len(batch) + 3 and shape[-3] == 1 else shape
    if viewed in ((n, m), full) or (
        len(viewed) <= len(full) and all(a in (1, b) for a, b in zip(reversed(viewed), reversed(full)))
    ):
        return viewed, viewed if viewed in ((n, m), full) else full
    raise ValueError(f"{name}: expected shape (n, m) = ({n}, {m}) or {full}, or one broadcasting to it, got {shape}")


def _positive_int(name, value):
    """value as a Python int >= 1: an int or a NumPy integer scalar, never a bool."""
    # value.__index__(), not type(value).__index__: torch.compile traces the one, not the other
    if type(value).__name__ in ("bool", "bool_") or not hasattr(value, "__index__") or value.__index__() < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value.__index__()


def _nonempty(sizes, named):
    """Every size but the query rows at least 1: with no keys or no features softmax and the norms have no value."""
    empty = [f"{size} = 0" for size, value in sizes.items() if value == 0]
    if empty:
        shapes = ", ".join(f"{name} {tuple(a.shape)}" for name, a in named.items() if a is not None)
        raise ValueError(f"{', '.join(empty)}: only the query rows may be empty; got {shapes}")


def _direction(direction):
    """A Hessian-vector product's direction: a dict from input names to arrays of their shapes (a name left
    out: zero in that input)."""
    if not isinstance(direction, dict):
        raise TypeError(f"direction: expected a dict from input names to arrays, got {type(direction).__name__}")
    unknown = [name for name in direction if name not in DIRECTION_OF]
    if unknown:
        raise ValueError(f"direction: {unknown[0]!r} is no input; inputs: {', '.join(DIRECTION_OF)}")
    return direction


def chain(*factors):
    """F₁ @ F₂ @ … @ F_k in the order that costs the fewest multiply-adds at the factors' shapes: the matrix-chain
    programme of ``numpy.linalg.multi_dot``, run at call time (microseconds for a few factors), where the best
    order depends on sizes the spec leaves open. A product's count is its two operands' broadcast batch entries
    (an unbatched weight times a weight is paid once) times a·b·c; ties go left to right."""
    k = len(factors)
    dims = [f.shape[-2] for f in factors] + [factors[-1].shape[-1]]
    batch = []
    for f in factors:
        entries = 1
        for size in f.shape[:-2]:
            entries *= size
        batch.append(entries)
    best = {(i, i): (0, i) for i in range(k)}  # (i, j) -> (cost, split after which the product is cut)
    for length in range(2, k + 1):
        for i in range(k - length + 1):
            j = i + length - 1
            entries = max(batch[i : j + 1])
            options = [
                (best[(i, s)][0] + best[(s + 1, j)][0] + entries * dims[i] * dims[s + 1] * dims[j + 1], -s)
                for s in range(i, j)
            ]
            cost, split = min(options)
            best[(i, j)] = (cost, -split)

    def product(i, j):
        if i == j:
            return factors[i]
        s = best[(i, j)][1]
        return _times(product(i, s), product(s + 1, j))

    return product(0, k - 1)


def _times(a, b):
    """a @ b; of factors of two dtypes (a float32 n × m array of a 16-bit run beside a 16-bit factor), the wider
    one rounded to the narrower, once, right before the product (torch multiplies no two dtypes), as the
    backends' narrow_matmul does."""
    if a.dtype == b.dtype:
        return a @ b
    low = a.dtype if a.dtype.itemsize < b.dtype.itemsize else b.dtype
    a, b = ((x.astype(low) if hasattr(x, "astype") else x.to(low)) for x in (a, b))
    return a @ b
