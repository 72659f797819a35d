"""Runtime helpers only generated NumPy modules call: in-place and masked softmax, batch sums, input checks, masks
(a float16 run's products, statistics and sums: ``symattn.numeric.low_precision``).

Real code, linted and tested; ``GeneratedNumPyPrinter`` copies the source of the ones a module
calls (read with ``ast``) into it, so a generated NumPy module imports only numpy. The
module-level ``SHAPES`` and ``OPTIONAL`` stand for the generated module's own constants.
"""

from __future__ import annotations

import numpy as np

from symattn.codegen.backends.common_runtime import _mask_layout
from symattn.codegen.backends.numpy.numba_kernels import _fused_kernels
from symattn.numeric.low_precision import _half, wide_sum

SHAPES: dict[str, str] = {}  # input name -> its shape as the docstring writes it, e.g. "(..., n, d_k)"
OPTIONAL: tuple[str, ...] = ()  # inputs that may be None (biases)


def masked_row_softmax_lse(a, out=None):
    """row_softmax_lse for rows that may hold -inf: a row of -inf gives zeros and L = +inf (exp(A - L) = 0)."""
    fused = fused_row_softmax(a, out, lse=True)
    if fused is not None:
        e, top, total = fused
    else:
        top = a.max(axis=-1, keepdims=True, initial=-np.inf)
        top[top == -np.inf] = 0.0
        e = np.exp(np.subtract(a, top, out=out), out=out)
        total = e.sum(axis=-1, keepdims=True)
        e /= np.where(total == 0, 1.0, total)
    with np.errstate(divide="ignore"):
        return e, np.where(total == 0, np.inf, top + np.log(total))


def masked_row_softmax(a, out=None):
    """row_softmax for rows that may hold -inf: a row whose entries are all -inf gives zeros, not NaN."""
    fused = fused_row_softmax(a, out)
    if fused is not None:
        return fused
    top = a.max(axis=-1, keepdims=True, initial=-np.inf)
    top[top == -np.inf] = 0.0
    out = np.subtract(a, top, out=out)
    np.exp(out, out=out)
    out /= np.maximum(out.sum(axis=-1, keepdims=True), 1.0)  # the row max gives exp(0) = 1 unless all are -inf
    return out


def masked_log_softmax(a):
    """log_softmax for rows that may hold -inf: a row whose entries are all -inf gives -inf (the log of its zero
    probabilities), not NaN."""
    top = a.max(axis=-1, keepdims=True, initial=-np.inf)
    top[top == -np.inf] = 0.0
    shifted = a - top
    total = np.exp(shifted).sum(axis=-1, keepdims=True)
    return shifted - np.log(np.where(total == 0, 1.0, total))


def row_softmax(a, out=None):
    """softmax along the last axis, the row max subtracted first; out may be a itself."""
    fused = fused_row_softmax(a, out)
    if fused is not None:
        return fused
    out = np.subtract(a, a.max(axis=-1, keepdims=True, initial=-np.inf), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


def fused_row_softmax(a, out=None, lse=False):
    """row_softmax by a compiled kernel that sweeps each row once while it is in cache (exp(a - max) and its sum,
    then the scale), in place: a row of -inf gives zeros. lse: (softmax, row max, row sum of exp(a - max)), the
    max 0 on a row of -inf (whose sum is 0). None (the caller's NumPy passes then) without numba, for a dtype
    other than float32 / float64, an empty or a non-contiguous array."""
    kernels = _compiled_kernels(a, out) if a.flags.c_contiguous else None
    if kernels is None:
        return None
    out = _written(a, out)
    flat = out.reshape(-1, out.shape[-1])
    top = flat.max(axis=-1)
    top[top == -np.inf] = 0.0  # a row of -inf: exp(-inf) = 0 everywhere, its sum 0, the row zeros
    total = np.empty_like(top)
    kernels["exp_normalize"](flat, top, out.dtype.type(1.0), total)
    if lse:
        return out, top.reshape(*out.shape[:-1], 1), total.reshape(*out.shape[:-1], 1)
    return out


def exp_rows(a, shift, out=None):
    """exp(a - shift), shift a column (..., k, 1) of one value a row (a row log-sum-exp: P from the scores and
    L); a compiled sweep where fused_row_softmax has one, else NumPy's two passes. out may be a itself."""
    kernel = _shifted_kernels(a, shift, out)
    if kernel is None:
        return np.exp(np.subtract(a, shift, out=out), out=out)
    out = _written(a, out)
    kernel["exp_rows"](_stacked(out), _stacked(shift)[..., 0])
    return out


def shifted_product(p, a, shift, out=None):
    """p ⊙ (a - shift), shift a column (..., k, 1) of one value a row (softmax's backward, dA = P ⊙ (dP - D));
    one compiled sweep where fused_row_softmax has one, else NumPy's two passes. out may be a or p."""
    kernel = _shifted_kernels(a, shift, out) if p.shape == a.shape and p.dtype == a.dtype else None
    if out is not None and out is not a and np.may_share_memory(out, p):  # a - shift may not overwrite p
        return np.multiply(p, np.subtract(a, shift), out=out)
    if kernel is None:
        return np.multiply(np.subtract(a, shift, out=out), p, out=out)
    out = _written(a, out)
    kernel["shifted_product"](_stacked(p), _stacked(out), _stacked(shift)[..., 0])
    return out


def _written(a, out):
    """The array a kernel overwrites in place: out holding a copy of a (a new one when out is None)."""
    if out is None:
        return a.copy()
    if out is not a:
        np.copyto(out, a)
    return out


def sigmoid(a):
    """σ(a) = 1 / (1 + exp(-a)), entrywise: one compiled sweep where numba is (_entrywise), else NumPy's passes."""
    out = _entrywise(sigmoid, a)
    return 1.0 / (1.0 + np.exp(-a)) if out is None else out


def softplus(a):
    """log(1 + exp(a)) = max(a, 0) + log1p(exp(-|a|)), entrywise, without overflow: one compiled sweep where numba
    is (_entrywise), else np.logaddexp (25 ns an entry: 4096², float32, 405 ms against 41)."""
    out = _entrywise(softplus, a)
    return np.logaddexp(0.0, a) if out is None else out


def _entrywise(helper, a):
    """The compiled kernel of the entrywise helper (the one of its name) applied to a copy of a, or None (NumPy's
    passes): not an array, or _compiled_kernels has none for it."""
    kernels = _compiled_kernels(a, None) if isinstance(a, np.ndarray) else None
    if kernels is None:
        return None
    out = a.copy()  # (C order: its entries one flat run)
    kernels[helper.__name__](out.reshape(-1), out.dtype.type(1.0))
    return out


def _shifted_kernels(a, shift, out):
    """_compiled_kernels for a (..., k, m) and one shift a row (..., k, 1) of its dtype, or None (NumPy's
    passes): also for a broadcast shift or one of another dtype."""
    if np.shape(shift) != (*a.shape[:-1], 1) or np.asarray(shift).dtype != a.dtype:
        return None
    return _compiled_kernels(a, out)


def _compiled_kernels(a, out):
    """The compiled kernels (numba_kernels: row-wise and entrywise) of a's dtype, for a result written into out
    (None: a new array; else a contiguous array of a's shape, maybe a itself), or None (NumPy's passes): no
    numba, a dtype other than float32 and float64, an empty array."""
    if not a.size or a.dtype.name not in ("float32", "float64"):
        return None
    if out is not None and not (out.shape == a.shape and out.flags.c_contiguous):
        return None
    kernels = _fused_kernels()
    return None if kernels is None else kernels[a.dtype.name]


def _stacked(a):
    """(..., k, m) -> (N, k, m): the leading axes as one (a view of a contiguous array, else a copy)."""
    return np.asarray(a).reshape(-1, *np.shape(a)[-2:])


def rows(a):
    """(..., n, k) -> (N, k): every row of every batch element, stacked."""
    return a.reshape(-1, a.shape[-1])


def sum_batch(a):
    """(..., p, q) -> (p, q): the sum over the leading batch dimensions (``wide_sum``)."""
    return wide_sum(a.reshape(-1, *a.shape[-2:]), 0)


def row_softmax_lse(a, out=None):
    """softmax along the last axis and the row log-sum-exp L = max + log Σ exp(a - max); out may be a itself."""
    fused = fused_row_softmax(a, out, lse=True)
    if fused is not None:
        e, top, total = fused
        return e, top + np.log(total)
    top = a.max(axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(np.subtract(a, top, out=out), out=out)
    total = e.sum(axis=-1, keepdims=True)
    e /= total
    return e, top + np.log(total)


def _arrays(named):
    """The inputs as arrays, checked: rank, one leading batch shape for the non-weights, one dtype.

    A trainable scalar (shape "()") is a number or a 0-d array, taken in the matrices' dtype.
    """
    arrays, batch, first = [], None, None
    for name, value in named.items():
        if (value is None and name in OPTIONAL) or SHAPES[name] == "()":
            arrays.append(value)
            continue
        a = np.asarray(value)
        weight = not SHAPES[name].startswith("(...")
        if a.ndim < 2 or (weight and a.ndim != 2):
            raise ValueError(f"{name}: expected shape {SHAPES[name]}, got {a.shape}")
        if not np.issubdtype(a.dtype, np.floating):
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
            a = np.asarray(arrays[i])
            if a.ndim != 0 or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"{name}: expected a real scalar (a float or a 0-d array), got {a.dtype} {a.shape}")
            arrays[i] = a.astype(first[1].dtype)
    return arrays


def _cotangent(grad_out, saved):
    """grad_out as an array of the output's shape and dtype."""
    grad_out = np.asarray(grad_out)
    if grad_out.shape != saved["output_shape"]:
        raise ValueError(f"grad_out: expected shape {saved['output_shape']}, got {grad_out.shape}")
    if grad_out.dtype != saved["dtype"]:
        raise ValueError(f"mixed dtypes: the output is {saved['dtype']}, grad_out is {grad_out.dtype}")
    return grad_out


def _one_mask(name, value, attn_mask, query, key, allowed=False):
    """The mask the spec's additive constant `name` is made from: value, given in its position, or attn_mask,
    given by keyword; both given is a TypeError naming them. value (n × m or (..., n, m), n the query's rows, m
    the key's; torch's (B, 1, n, m) and any shape broadcasting to them: ``_mask_layout``) is a constant (backward
    gives it no gradient): a float one is added as it is, a bool is read as attn_mask's, True = not allowed, or
    with allowed, True = allowed (as torch's scaled_dot_product_attention reads a bool attn_mask)."""
    if value is None:
        return attn_mask
    if attn_mask is not None:
        raise TypeError(f"forward() got the mask {name} both in its position and as attn_mask; give it once")
    value, query, key = np.asarray(value), np.asarray(query), np.asarray(key)
    viewed, read = _mask_layout(name, value.shape, query.shape[-2], key.shape[-2], tuple(query.shape[:-2]))
    if value.dtype != np.bool_ and not np.issubdtype(value.dtype, np.floating):
        raise ValueError(f"{name}: expected a bool or floating-point array, got {value.dtype}")
    value = value.reshape(viewed)
    value = value if viewed == read else np.broadcast_to(value, read).copy()
    return ~value if allowed and value.dtype == np.bool_ else value


def _bool_constant(value, form, like):
    """A constant given as a bool array, made the matrix the spec holds, in like's dtype: form "additive": -inf
    where True, else 0; "additive_false": -inf where False; "keep": 1 where False, else 0; "keep_false": 1 where
    True. Any other value is returned as it is (the inputs' checks read it)."""
    if value is None or np.asarray(value).dtype != np.bool_:
        return value
    value, dtype = np.asarray(value), np.asarray(like).dtype
    masked = value if form in ("additive", "keep") else ~value  # True where the constant masks
    if form.startswith("additive"):
        return np.where(masked, -np.inf, 0.0).astype(dtype)
    return (~masked).astype(dtype)


def _rows(named):
    """Each parameter of shape (1, k) given 1-D, (k,) as torch holds a bias, as the 1 × k row (a view); the others
    as they are (the inputs' checks read them)."""
    return [np.asarray(v)[None, :] if v is not None and np.ndim(v) == 1 else v for v in named.values()]


def _vectors(named):
    """The names of the (1, k) parameters given 1-D: backward returns their gradients 1-D (``_as_given``)."""
    return tuple(name for name, v in named.items() if v is not None and np.ndim(v) == 1)


def _as_given(grads, vectors):
    """The gradients of the inputs given (None: an absent input's, left out), each of a parameter given 1-D as a
    vector of its length, the layout it was given in."""
    return {name: g.reshape(-1) if name in vectors else g for name, g in grads.items() if g is not None}


def _float_mask_shape(attn_mask):
    """The shape of a floating attn_mask (an additive bias, which receives a gradient), else None."""
    if attn_mask is None or np.asarray(attn_mask).dtype == np.bool_:
        return None
    return np.shape(attn_mask)


def sum_to_mask(a, shape, heads=False):
    """∂f/∂B for a bias B of the given shape, (n, m) or (..., n, m), added to scores whose cotangent is a,
    (..., n, m) or with heads (..., H, n, m): a summed over the axes B was broadcast along (``wide_sum``)."""
    if heads:
        a = wide_sum(a, -3)
    return wide_sum(a.reshape(-1, *shape), 0)


def _additive_mask(attn_mask, key_padding_mask, causal, query, key, per_head=False, by_blocks=False):
    """The additive mask M (0 where a query may see a key, -inf where not), or None without a mask.

    attn_mask: (n, m) or (..., n, m), boolean (True: not allowed) or floating (added to the scores);
    key_padding_mask: (..., m) boolean (True: ignore that key); causal: query i sees keys j <= i.
    per_head: the scores have a heads axis, (..., H, n, m), so a batched mask gets one, (..., 1, n, m).
    by_blocks: M leaves the causal part out (None when nothing else is left), for a loop over blocks of query
    rows that writes it into each block of scores (causal_fill), so that no n × m array is made for it.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    if attn_mask is None and key_padding_mask is None and (by_blocks or not causal):
        return None
    query, key = np.asarray(query), np.asarray(key)
    n, m, batch = query.shape[-2], key.shape[-2], query.shape[:-2]
    mask = None
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.shape not in ((n, m), (*batch, n, m)):
            expected = f"(n, m) = ({n}, {m}) or {(*batch, n, m)}"
            raise ValueError(f"attn_mask: expected shape {expected}, got {attn_mask.shape}")
        if attn_mask.dtype == np.bool_:
            mask = np.where(attn_mask, -np.inf, 0.0).astype(query.dtype)
        elif np.issubdtype(attn_mask.dtype, np.floating):
            mask = attn_mask.astype(query.dtype)
        else:
            raise ValueError(f"attn_mask: expected a bool or floating-point array, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        key_padding_mask = np.asarray(key_padding_mask)
        if key_padding_mask.shape != (*batch, m):
            raise ValueError(f"key_padding_mask: expected shape (..., m) = {(*batch, m)}, got {key_padding_mask.shape}")
        if key_padding_mask.dtype != np.bool_:
            got = key_padding_mask.dtype
            raise ValueError(f"key_padding_mask: expected a bool array (True: ignore a key), got {got}")
        padding = np.where(key_padding_mask, -np.inf, 0.0).astype(query.dtype)[..., None, :]
        mask = padding if mask is None else mask + padding
    if mask is not None:
        mask = np.broadcast_to(mask, (*mask.shape[:-2], n, m))  # a view: every query row, so that blocks slice it
        if per_head and mask.ndim > 2:  # one mask for every head: (..., 1, n, m)
            mask = mask[..., None, :, :]
    return mask if by_blocks else with_causal(mask, causal, query, key)


def with_causal(mask, causal, query, key):
    """M with the causal part added (-inf where key j comes after query i) when causal, as a whole n × m array:
    the additive mask for the closed forms that take it whole, from the mask a loop over blocks of rows takes."""
    if not causal:
        return mask
    n, m = np.shape(query)[-2], np.shape(key)[-2]
    future = np.where(np.triu(np.ones((n, m), dtype=bool), 1), -np.inf, 0.0).astype(np.asarray(query).dtype)
    return future if mask is None else mask + future


def key_range(mask, causal, rows, m):
    """The keys a block of query rows (a slice) reads: slice(k0, k1), the smallest range holding every key that
    a row of the block may see (causal: key j <= query i; mask: an additive mask whose -inf hide a key), never
    empty. A loop over blocks of rows skips the keys outside it, whose probabilities are exactly zero."""
    first, last = 0, m
    if causal:  # row i sees keys 0 … i
        last = max(1, min(m, rows.stop))
    if mask is not None:
        seen = np.flatnonzero((mask[..., rows, first:last] != -np.inf).reshape(-1, last - first).any(axis=0))
        if seen.size:
            first, last = first + int(seen[0]), first + int(seen[-1]) + 1
        else:  # every key hidden: one read, its probability zero
            last = first + 1
    return slice(first, max(last, first + 1))


def causal_fill(scores, rows, keys):
    """A block of scores (..., b, k) of query rows rows.start … and keys keys.start …, with -inf written where the
    key comes after the query (j > i: what the causal mask hides). Only the keys after the block's first row are
    written: the ones before it every row sees."""
    b, k = scores.shape[-2:]
    first = max(0, rows.start + 1 - keys.start)  # the first key of the block that some query row does not see
    if first < k:
        future = np.arange(keys.start + first, keys.start + k) > np.arange(rows.start, rows.start + b)[:, None]
        np.copyto(scores[..., first:], -np.inf, where=future)
    return scores


def add_rows(total, keys, part, m):
    """The sum over blocks of a value of m rows (…, m, k), part adding to its rows keys; total is 0 before the
    first block. part is a product made for the sum (dAᵀ Q): the first one may become the sum itself. 16-bit parts
    are summed in float32 (an accumulation): the sum is float32, rounded once by the public function
    (``_in_run_dtype``; matmul_tn's parts are float32 already)."""
    if _half(part):
        part = part.astype(np.float32)
    if isinstance(total, int) and part.shape[-2] == m and part.base is None:  # every key: part is the sum so far
        return part
    if isinstance(total, int):
        total = np.zeros((*part.shape[:-2], m, part.shape[-1]), dtype=part.dtype)
    total[..., keys, :] += part
    return total


def put_rows(whole, rows, keys, part, n, m):
    """An n × m value made block by block: part (..., b, k) placed at its rows and keys, zero on the other keys
    of those rows (the ones the block skipped); whole is None before the first block."""
    if whole is None and part.shape[-2:] == (n, m) and part.base is None:  # one block, every key: part is the whole
        return part
    if whole is None:
        whole = np.empty((*part.shape[:-2], n, m), dtype=part.dtype)
    whole[..., rows, : keys.start] = 0.0
    whole[..., rows, keys] = part
    whole[..., rows, keys.stop :] = 0.0
    return whole


def rows_per_block(mask, causal, query):
    """Query rows per block of a standard module's loop: 128 where the mask may let a block skip keys (causal,
    or any mask: key_range finds the keys each block sees), else all rows in one block (no mask: the whole
    computation at once, nothing to skip)."""
    return 128 if causal or mask is not None else max(query.shape[-2], 1)


# the helpers that the evaluation runtime (symattn.numeric.numpy_runtime) has too and the generated modules replace:
# row_softmax with out= (written into a dying array), σ and softplus by their compiled kernels
REPLACING = (row_softmax, sigmoid, softplus)
