"""Runtime helpers of generated JAX modules: softmax, heads, GELU, LayerNorm, input checks, masks, residuals.

Real code, linted and tested; ``JaxMatrixPrinter`` copies the source of the ones a module calls (read with ``ast``)
into it, so a generated JAX module imports only jax. Every helper is a pure function of its arguments (no in-place
writes): it runs under ``jax.jit`` and ``jax.vmap`` and can be differentiated again. ``SHAPES`` and ``OPTIONAL``
stand for the generated module's own constants. Generating code reads this module's source only (no jax needed).
"""

from __future__ import annotations

try:
    import jax
    import jax.numpy as jnp
except ImportError:  # pragma: no cover - generating a JAX module reads this source, it needs no jax
    from types import SimpleNamespace

    jax = SimpleNamespace(tree_util=SimpleNamespace(register_static=lambda cls: cls))
    jnp = None

SHAPES: dict[str, str] = {}  # input name -> its shape as the docstring writes it, e.g. "(..., n, d_k)"
OPTIONAL: tuple[str, ...] = ()  # inputs that may be None (biases)

from symattn.codegen.backends.common_runtime import _mask_layout  # noqa: E402


def _row_max(a):
    """The row max of a as a column, 0 where the row is all -inf; a constant to differentiation (softmax
    does not change when a row is shifted, so a second derivative needs no term through the max)."""
    if not a.shape[-1]:  # no keys
        return jnp.zeros((*a.shape[:-1], 1), a.dtype)
    top = jax.lax.stop_gradient(a.max(axis=-1, keepdims=True))
    return jnp.where(jnp.isneginf(top), 0.0, top)


def row_softmax(a):
    """softmax along the last axis, the row max subtracted first."""
    e = jnp.exp(a - _row_max(a))
    return e / e.sum(axis=-1, keepdims=True)


def masked_row_softmax(a):
    """row_softmax for rows that may hold -inf: a row whose entries are all -inf gives zeros, not NaN."""
    e = jnp.exp(a - _row_max(a))
    total = e.sum(axis=-1, keepdims=True)
    return e / jnp.where(total == 0, 1.0, total)  # not max(total, 1): its derivative at total = 1 is 1/2


def masked_log_softmax(a):
    """log_softmax for rows that may hold -inf: a row whose entries are all -inf gives -inf (the log of its zero
    probabilities), not NaN."""
    shifted = a - _row_max(a)
    total = jnp.exp(shifted).sum(axis=-1, keepdims=True)
    return shifted - jnp.log(jnp.where(total == 0, 1.0, total))


def wide_matmul(a, b):
    """a @ b, a product much larger than its factors (the scores Q Kᵀ, dP = dO Vᵀ: n × m from n × d and d × m).
    Of 16-bit factors (bfloat16, float16) the product is float32 (preferred_element_type): the n × m arrays and
    what is made of them (P, dS) stay float32, as jax.nn.dot_product_attention keeps its logits; the products
    that read them round them once (``narrow_matmul``)."""
    a, b, low = _alike(a, b)
    if low in (jnp.bfloat16, jnp.float16):
        return jnp.matmul(a, b, preferred_element_type=jnp.float32)
    return a @ b


def narrow_matmul(a, b):
    """a @ b, where a factor may be a float32 n × m array of a 16-bit run (P, dS of ``wide_matmul``): rounded to
    the 16-bit dtype right before the product (its one rounding), which accumulates in float32 and is rounded to
    the 16-bit dtype. Factors of one wider dtype (float32, float64 runs): a @ b."""
    a, b, low = _alike(a, b)
    if low in (jnp.bfloat16, jnp.float16):
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(low)
    return a @ b


def _alike(a, b):
    """(a, b, the narrower dtype): factors of two dtypes, a float32 array of a 16-bit run beside a 16-bit one, made
    the 16-bit one; of one dtype, as they are."""
    if a.dtype == b.dtype:
        return a, b, a.dtype
    low = a.dtype if a.dtype.itemsize < b.dtype.itemsize else b.dtype
    return a.astype(low), b.astype(low), low


def row_dot(a, b):
    """rowsum(a ⊙ b) as a column (..., n, 1), such as D = rowsum(dO ⊙ O): in float32 for 16-bit a or b (a
    statistic, as SDPA keeps it), else in their dtype (XLA fuses the product into the sum)."""
    if a.dtype in (jnp.bfloat16, jnp.float16) or b.dtype in (jnp.bfloat16, jnp.float16):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return (a * b).sum(axis=-1, keepdims=True)


def sigmoid(a):
    """1 / (1 + exp(-a)), entrywise."""
    return jax.nn.sigmoid(a)


def split_heads(a, heads):
    """(..., n, heads * k) -> (..., heads, n, k)."""
    return jnp.swapaxes(a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads), -2, -3)


def merge_heads(a, heads):
    """(..., heads, n, k) -> (..., n, heads * k)."""
    a = jnp.swapaxes(a, -2, -3)
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def repeat_heads(a, heads):
    """(..., kv_heads, n, k) -> (..., heads, n, k): head h reads kv head h // (heads // kv_heads)."""
    return a if a.shape[-3] == heads else jnp.repeat(a, heads // a.shape[-3], axis=-3)


def sum_groups(a, heads):
    """(..., H, n, k) -> (..., heads, n, k): each group of H // heads consecutive heads summed."""
    if a.shape[-3] == heads:
        return a
    return a.reshape(*a.shape[:-3], heads, a.shape[-3] // heads, *a.shape[-2:]).sum(axis=-3)


def rows(a):
    """(..., n, k) -> (N, k): every row of every batch element, stacked."""
    return a.reshape(-1, a.shape[-1])


def sum_batch(a):
    """(..., p, q) -> (p, q): the sum over the leading batch dimensions."""
    return a.reshape(-1, *a.shape[-2:]).sum(axis=0)


def gelu(a):
    """x Φ(x), entrywise (exact, erf form)."""
    return jax.nn.gelu(a, approximate=False)


def gelu_grad(a):
    """GELU′(x) = Φ(x) + x φ(x), entrywise."""
    return 0.5 * (1.0 + jax.scipy.special.erf(a * 0.7071067811865476)) + a * jnp.exp(-0.5 * a * a) * 0.3989422804014327


def gelu_tanh(a):
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""
    return jax.nn.gelu(a, approximate=True)


def gelu_tanh_grad(a):
    """The derivative of gelu_tanh: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2, t = tanh(k (x + c x³))."""
    t = jnp.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)


def layer_norm(a, eps):
    """Each row standardised: (a − mean) / √(biased variance + eps), along the last axis."""
    c = a - a.mean(axis=-1, keepdims=True)
    return c / jnp.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def row_inv_std(a, eps):
    """1 / √(biased variance + eps) of each row, as a column (..., n, 1)."""
    c = a - a.mean(axis=-1, keepdims=True)
    return 1.0 / jnp.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)


def sum_to_shape(a, shape):
    """a summed down to shape, which it was broadcast from: the extra leading axes, and the axes of size 1."""
    a = a.reshape(-1, *a.shape[a.ndim - len(shape) :]).sum(axis=0)
    axes = tuple(i for i, (size, full) in enumerate(zip(shape, a.shape)) if size == 1 and full != 1)
    return a.sum(axis=axes, keepdims=True) if axes else a


def _arrays(named):
    """The inputs as jax arrays, checked: rank, one leading batch shape for the non-weights, one dtype.

    A trainable scalar (shape "()") is a number or a 0-d array, taken in the matrices' dtype.
    """
    arrays, batch, first = [], None, None
    for name, value in named.items():
        if (value is None and name in OPTIONAL) or SHAPES[name] == "()":
            arrays.append(value)
            continue
        a = jnp.asarray(value)
        weight = not SHAPES[name].startswith("(...")
        if a.ndim < 2 or (weight and a.ndim != 2):
            raise ValueError(f"{name}: expected shape {SHAPES[name]}, got {a.shape}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise ValueError(f"{name}: expected a floating-point array of shape {SHAPES[name]}, got {a.dtype}")
        if first is not None and a.dtype != first[1].dtype:
            raise ValueError(f"mixed dtypes: {first[0]} is {first[1].dtype}, {name} is {a.dtype}")
        if not weight and batch is not None and a.shape[:-2] != batch[1].shape[:-2]:
            raise ValueError(
                f"{name}: expected shape {SHAPES[name]} with the batch dimensions of {batch[0]} "
                f"{batch[1].shape[:-2]}, got {a.shape}"
            )
        first = first or (name, a)
        batch = batch or (None if weight else (name, a))
        arrays.append(a)
    for i, name in enumerate(named):  # a trainable scalar: a real number or 0-d array, in the matrices' dtype
        if SHAPES[name] == "()" and not (arrays[i] is None and name in OPTIONAL):
            a = jnp.asarray(arrays[i])
            if a.ndim != 0 or not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer)):
                raise ValueError(f"{name}: expected a real scalar (a float or a 0-d array), got {a.dtype} {a.shape}")
            arrays[i] = a.astype(first[1].dtype)
    return arrays


def _one_mask(name, value, attn_mask, query, key, allowed=False):
    """The mask the spec's additive constant `name` is made from: value, given in its position, or attn_mask,
    given by keyword; both given is a TypeError naming them. value (n × m or (..., n, m), n the query's rows, m
    the key's; torch's (B, 1, n, m) and any shape broadcasting to them: ``_mask_layout``) is a constant
    (stop_gradient: no gradient): a float one is added as it is, a bool is read as attn_mask's, True = not allowed,
    or with allowed, True = allowed (as torch's scaled_dot_product_attention reads a bool attn_mask)."""
    if value is None:
        return attn_mask
    if attn_mask is not None:
        raise TypeError(f"forward() got the mask {name} both in its position and as attn_mask; give it once")
    value = jax.lax.stop_gradient(jnp.asarray(value))
    shapes = (jnp.shape(query)[-2], jnp.shape(key)[-2], tuple(jnp.shape(query)[:-2]))
    viewed, read = _mask_layout(name, value.shape, *shapes)
    if value.dtype != jnp.bool_ and not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a bool or floating-point array, got {value.dtype}")
    value = jnp.broadcast_to(value.reshape(viewed), read)
    return jnp.logical_not(value) if allowed and value.dtype == jnp.bool_ else value


def _bool_constant(value, form, like):
    """A constant given as a bool array, made the matrix the spec holds, in like's dtype: form "additive": -inf
    where True, else 0; "additive_false": -inf where False; "keep": 1 where False, else 0; "keep_false": 1 where
    True. Any other value is returned as it is (the inputs' checks read it)."""
    if value is None or jnp.asarray(value).dtype != jnp.bool_:
        return value
    value, dtype = jnp.asarray(value), jnp.asarray(like).dtype
    masked = value if form in ("additive", "keep") else jnp.logical_not(value)  # True where the constant masks
    if form.startswith("additive"):
        return jnp.where(masked, -jnp.inf, 0.0).astype(dtype)
    return jnp.logical_not(masked).astype(dtype)


def _rows(named):
    """Each parameter of shape (1, k) given 1-D, (k,) as torch holds a bias, as the 1 × k row (jax differentiates
    the reshape: its gradient comes back (k,)); the others as they are (the inputs' checks read them)."""
    return [jnp.asarray(v)[None, :] if v is not None and jnp.ndim(v) == 1 else v for v in named.values()]


def _mask_shape(mask):
    """The shape of the additive mask, which receives a gradient (summed to it), or None without a mask."""
    return None if mask is None else mask.shape


@jax.tree_util.register_static
class _Static:
    """Python values (dimensions, options, the mask's shape) that the forward hands the backward through
    jax.custom_vjp's residuals as static data: no leaves, so under jit they stay Python values."""

    def __init__(self, items):
        self.items = items

    def __hash__(self):
        return hash(self.items)

    def __eq__(self, other):
        return isinstance(other, _Static) and other.items == self.items


def _residuals(saved):
    """The forward's saved values as custom_vjp residuals: the arrays (None for an absent input) as leaves,
    every other value (an int, a float, a shape) static."""
    arrays = {name: value for name, value in saved.items() if value is None or isinstance(value, jax.Array)}
    return arrays, _Static(tuple((name, value) for name, value in saved.items() if name not in arrays))


def _restore(residuals):
    """The saved values from _residuals' pair."""
    arrays, static = residuals
    return {**arrays, **dict(static.items)}


def _additive_mask(attn_mask, key_padding_mask, causal, query, key, per_head=False, by_blocks=False):
    """The additive mask M (0 where a query may see a key, -inf where not), or None without a mask.

    attn_mask: (n, m) or (..., n, m), boolean (True: not allowed; a constant) or floating (added to the
    scores; differentiable); key_padding_mask: (..., m) boolean (True: ignore that key); causal: query i
    sees keys j <= i. per_head: the scores have a heads axis, (..., H, n, m), so a batched mask gets one.
    by_blocks: M leaves the causal part out (None when nothing else is left), for a loop over blocks of query
    rows that writes it into each block of scores (causal_fill), so that no n × m array is made for it.
    """
    if type(causal).__name__ not in ("bool", "bool_"):  # True or False, or NumPy's np.True_ or np.False_
        raise ValueError(f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    if attn_mask is None and key_padding_mask is None and (by_blocks or not causal):
        return None
    query, key = jnp.asarray(query), jnp.asarray(key)
    n, m, batch, dtype = query.shape[-2], key.shape[-2], tuple(query.shape[:-2]), query.dtype
    mask = None
    if attn_mask is not None:
        attn_mask = jnp.asarray(attn_mask)
        if tuple(attn_mask.shape) not in ((n, m), (*batch, n, m)):
            expected = f"(n, m) = ({n}, {m}) or {(*batch, n, m)}"
            raise ValueError(f"attn_mask: expected shape {expected}, got {tuple(attn_mask.shape)}")
        if attn_mask.dtype == jnp.bool_:
            mask = jnp.where(attn_mask, -jnp.inf, 0.0).astype(dtype)
        elif jnp.issubdtype(attn_mask.dtype, jnp.floating):
            mask = attn_mask.astype(dtype)
        else:
            raise ValueError(f"attn_mask: expected a bool or floating-point array, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        key_padding_mask = jnp.asarray(key_padding_mask)
        if tuple(key_padding_mask.shape) != (*batch, m):
            got = tuple(key_padding_mask.shape)
            raise ValueError(f"key_padding_mask: expected shape (..., m) = {(*batch, m)}, got {got}")
        if key_padding_mask.dtype != jnp.bool_:
            got = key_padding_mask.dtype
            raise ValueError(f"key_padding_mask: expected a bool array (True: ignore a key), got {got}")
        padding = jnp.where(key_padding_mask, -jnp.inf, 0.0).astype(dtype)[..., None, :]
        mask = padding if mask is None else mask + padding
    if mask is not None:
        mask = jnp.broadcast_to(mask, (*mask.shape[:-2], n, m))  # every query row
        if per_head and mask.ndim > 2:  # one mask for every head: (..., 1, n, m)
            mask = mask[..., None, :, :]
    return mask if by_blocks else with_causal(mask, causal, query, key)


def with_causal(mask, causal, query, key):
    """M with the causal part added (-inf where key j comes after query i) when causal, as a whole n × m array:
    the additive mask for the closed forms that take it whole, from the mask a loop over blocks of rows takes."""
    if not causal:
        return mask
    n, m, dtype = query.shape[-2], key.shape[-2], query.dtype
    future = jnp.where(jnp.triu(jnp.ones((n, m), dtype=bool), 1), -jnp.inf, 0.0).astype(dtype)
    return future if mask is None else mask + future


def rows_per_block(mask, causal, query, size=128, most=16):
    """Query rows per block of a standard module's loop. With causal, each block reads only the keys 0 … its last
    row: 128 rows (size) up to 8 blocks, 256 past them (n > 1024: as fast, and jax.jit, which compiles the Python
    loop unrolled, one copy of the block's code per block, compiles half as many), and at most 16 blocks (most:
    larger ones past n = 4096; the scores skipped, (b − 1)/2b of them at b blocks, hardly grow). Without causal,
    every row in one block (the whole computation at once). Static under jax.jit: causal is a Python bool and
    shapes are static; another mask's keys are never skipped (its values may be traced: the loop adds it to
    each block's scores)."""
    n = query.shape[-2]
    if not causal:
        return max(n, 1)
    if n > 8 * size:
        size *= 2
    return size * max(1, -(-n // (size * most)))


def key_range(mask, causal, rows, m):
    """The keys a block of query rows (a slice) reads: slice(0, k1), with causal the keys 0 … the block's last row
    (row i sees keys j <= i), never empty; without, every key. From causal alone (no branch on the mask's values,
    which jit traces); the loop skips the keys outside it, whose probabilities are exactly zero."""
    if not causal:
        return slice(0, m)
    return slice(0, max(1, min(m, rows.stop)))


def causal_fill(scores, rows, keys):
    """A block of scores (..., b, k) of query rows rows.start … and keys keys.start …, with -inf where the key
    comes after the query (j > i: what the causal mask hides); a new array (jnp.where), the block itself where
    no key of the block comes after a row."""
    b, k = scores.shape[-2:]
    if keys.start + k - 1 <= rows.start:
        return scores
    future = jnp.arange(keys.start, keys.start + k) > jnp.arange(rows.start, rows.start + b)[:, None]
    return jnp.where(future, -jnp.inf, scores)


def add_rows(total, keys, part, m):
    """The sum over blocks of a value of m rows (…, m, k), part adding to its rows keys; total is 0 before the
    first block. Functional: part padded with zero rows to m (no in-place update to trace). 16-bit parts are
    summed in float32 (an accumulation): the sum is float32, rounded once by the custom_vjp's rule (``_narrowed``)."""
    if part.dtype in (jnp.bfloat16, jnp.float16):
        part = part.astype(jnp.float32)
    if part.shape[-2] != m:
        part = jnp.pad(part, [(0, 0)] * (part.ndim - 2) + [(keys.start, m - keys.stop), (0, 0)])
    return part if isinstance(total, int) else total + part


def _narrowed(grads, dtype):
    """The gradients of a 16-bit run (dtype, the cotangent's) in that dtype: a float32 sum over blocks of rows
    (add_rows) rounded once; of a wider run, as they are."""
    if dtype not in (jnp.bfloat16, jnp.float16):
        return grads
    return {name: g if g is None or g.dtype == dtype else g.astype(dtype) for name, g in grads.items()}


def put_rows(whole, rows, keys, part, n, m):
    """An n × m value made block by block: part (..., b, k) of rows and keys, padded with zeros on the other
    keys of its rows (the ones the block skipped) and collected in a list that placed_rows concatenates once;
    whole is None before the first block. One block of every key: part is the whole."""
    if whole is None and part.shape[-2:] == (n, m):
        return part
    padded = jnp.pad(part, [(0, 0)] * (part.ndim - 1) + [(keys.start, m - keys.stop)])
    return [*(whole or []), padded]


def placed_rows(whole):
    """The value put_rows made, after the loop: its blocks (a list) concatenated once."""
    return jnp.concatenate(whole, axis=-2) if isinstance(whole, list) else whole


def entries(f, rows, cols, dtype):
    """[f(i, j)], rows × cols: f of the row positions i (a column) and the column positions j (a row), on grids of
    at least float32 (positions exact), cast to dtype."""
    wide = jnp.promote_types(dtype, jnp.float32)
    i, j = jnp.arange(rows, dtype=wide)[:, None], jnp.arange(cols, dtype=wide)[None, :]
    value = jnp.asarray(f(i, j), dtype=dtype)
    return jnp.broadcast_to(value, jnp.broadcast_shapes(value.shape, (rows, cols)))


def table_read(table, rows, cols):
    """table[..., r, c] at the index grids r and c (positions exact in floats), the table's leading axes first;
    indices of under two axes read as 1 × 1 or 1 × k (p[0, 0] of a table per sequence broadcasts against the grids)."""
    rows, cols = (jnp.atleast_2d(jnp.asarray(x).astype(jnp.int32)) for x in (rows, cols))
    return table[..., rows, cols]


def indexed_read(table, rows, cols, name, source):
    """table[..., r, c] at index grids r, c read from a constant (source): each an integer inside the table (name),
    else ValueError; under jit, NaN where one leaves it. Never a read outside it (JAX would clamp to the nearest)."""
    valid = True
    for grid, size, what in zip(map(jnp.asarray, (rows, cols)), table.shape[-2:], ("row", "column")):
        if jnp.issubdtype(grid.dtype, jnp.floating) and size - 1 > 2 / jnp.finfo(grid.dtype).eps:
            raise ValueError(f"{source} is {grid.dtype}: its integers are inexact past {name}'s {size} {what}s")
        good = (grid >= 0) & (grid <= size - 1) & (grid == jnp.floor(grid))
        try:
            known = bool(good.all())
        except jax.errors.ConcretizationTypeError:  # under jit: the values are tracers
            known = True
        if not known:
            raise ValueError(
                f"{source} gives {name} the {what} index {grid[~good].flatten()[0].item()!r}: an index read from a "
                f"constant is an integer in [0, {size - 1}] ({name} has {size} {what}s)"
            )
        valid = valid & good
    inside = table_read(table, jnp.clip(rows, 0, table.shape[-2] - 1), jnp.clip(cols, 0, table.shape[-1] - 1))
    return jnp.where(valid, inside, jnp.nan)


def table_scatter(w, index, rows, cols):
    """[Σ_{(i, j): index(i, j) = (k, l)} w_ij]_kl, rows × cols (w's leading axes kept): each table entry collects w at
    the positions that read it (``.at[].add``, deterministic on CPU)."""
    n, m = w.shape[-2:]
    wide = jnp.promote_types(w.dtype, jnp.float32)
    i, j = jnp.arange(n, dtype=wide)[:, None], jnp.arange(m, dtype=wide)[None, :]
    r, c = (jnp.asarray(x).astype(jnp.int32) for x in index(i, j))
    flat = jnp.broadcast_to(r * cols + c, (n, m)).reshape(-1)
    sums = jnp.zeros((*w.shape[:-2], rows * cols), dtype=w.dtype)
    return sums.at[..., flat].add(w.reshape(*w.shape[:-2], n * m)).reshape(*w.shape[:-2], rows, cols)
