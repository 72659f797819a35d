"""Runtime helpers of generated PyTorch modules: softmax, heads, GELU, LayerNorm, input checks and masks (the
autograd Functions' own helpers are in ``function_runtime``).

Real code, linted and tested; ``TorchMatrixPrinter`` copies the source of the ones a module calls
(read with ``ast``) into it, so a generated torch module imports only torch. ``SHAPES``,
``OPTIONAL`` and ``SPEC`` stand for the generated module's own constants. Generating code reads
this module's source only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a torch module reads this source, it needs no torch
    from types import SimpleNamespace

    torch = SimpleNamespace(autograd=SimpleNamespace(Function=object))

SHAPES: dict[str, str] = {}  # input name -> its shape as the docstring writes it, e.g. "(..., n, d_k)"
OPTIONAL: tuple[str, ...] = ()  # inputs that may be None (biases)
SPEC = ""  # the spec's name, for error messages

from symattn.codegen.backends.common_runtime import _mask_layout  # noqa: E402
from symattn.codegen.backends.torch.function_runtime import _alike  # noqa: E402
from symattn.codegen.backends.torch.pages import _by_custom_op, huge_empty, huge_matmul, write_rows  # noqa: E402


def masked_row_softmax_lse(a, out=None):
    """row_softmax_lse for rows that may hold -inf: a row of -inf gives zeros and L = +inf (exp(A - L) = 0)."""
    top = a.amax(dim=-1, keepdim=True) if a.shape[-1] else a.new_zeros(*a.shape[:-1], 1)  # no keys
    e = masked_row_softmax(a, out=out)
    return e, (top - torch.log(e.amax(dim=-1, keepdim=True))).masked_fill_(top == float("-inf"), float("inf"))


def masked_row_softmax(a, out=None):
    """row_softmax for rows that may hold -inf: a row whose entries are all -inf gives zeros, not NaN."""
    if not a.shape[-1]:  # no keys
        return row_softmax(a, out=out)
    empty = a.amax(dim=-1, keepdim=True) == float("-inf")  # before out (maybe a itself) is written
    out = row_softmax(a, out=out)
    if _functional(a):  # no branch on the data in a traced or transformed function: one pass to fill
        return out.masked_fill(empty, 0.0)
    return out.masked_fill_(empty, 0.0) if a.device.type != "cpu" or bool(empty.any()) else out  # GPU: no wait


def row_softmax(a, out=None):
    """softmax along the last axis (torch's one-pass kernel, the row max subtracted first); out may be a itself.
    Compiled, softmax over a large a (out=a) is the custom op symattn::row_softmax_, written over a's buffer (the
    scores', in huge pages) as in eager code: inductor's softmax would write a fresh buffer (_by_custom_op)."""
    # (else a compiled graph plans its own buffers; export traces with autograd on, which refuses out=, as it
    # does for a that requires grad, as jvp's may; vmap batches no out=)
    if out is not None and not out.is_contiguous():  # torch's softmax into strided memory (−Aᵀ's) is wrong
        out = None
    if out is a and not a.requires_grad and _by_custom_op(a, a.numel() * a.element_size()):
        torch.ops.symattn.row_softmax_(a)
        return a
    if out is None or _functional(a) or a.requires_grad:
        return torch.softmax(a, dim=-1)
    return torch._softmax(a, -1, False, out=out)


def _functional(a):
    """Is a traced (torch.compile, torch.export) or transformed (torch.func's vmap, grad, jvp)? Then no out= and
    no branch on its values: what eager code does in place or only where needed is done for every row."""
    return torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(a)


def masked_log_softmax(a):
    """log_softmax along the last axis for rows that may hold -inf: a row whose entries are all -inf gives -inf
    (the log of its zero probabilities), not NaN."""
    empty = a.amax(dim=-1, keepdim=True) == float("-inf") if a.shape[-1] else None
    out = torch.log_softmax(a, dim=-1)
    return out if empty is None else out.masked_fill(empty, float("-inf"))


def split_heads(a, heads):
    """(..., n, heads * k) -> (..., heads, n, k)."""
    return a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads).transpose(-2, -3)


def merge_heads(a, heads):
    """(..., heads, n, k) -> (..., n, heads * k)."""
    a = a.transpose(-2, -3)
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def repeat_heads(a, heads):
    """(..., kv_heads, n, k) -> (..., heads, n, k): head h reads kv head h // (heads // kv_heads)."""
    return a if a.shape[-3] == heads else a.repeat_interleave(heads // a.shape[-3], dim=-3)


def sum_groups(a, heads):
    """(..., H, n, k) -> (..., heads, n, k): each group of H // heads consecutive heads summed."""
    if a.shape[-3] == heads:
        return a
    return a.reshape(*a.shape[:-3], heads, a.shape[-3] // heads, *a.shape[-2:]).sum(dim=-3)


def matmul_tn(a, b):
    """aᵀ b, for a (..., k, r) much wider than b (..., k, c). From r = 1024 rows on it is computed as (bᵀ a)ᵀ,
    the same values: torch's CPU GEMM (MKL) multiplies a long transposed left operand by a thin one at about
    half the speed in float64 (Pᵀ dO, 4 heads, n = 1024, d = 64: 33 → 17 ms). Shorter products stay aᵀ b,
    whose result is contiguous. Factors of two dtypes are made one first (``_alike``); a float32 product of a
    16-bit run is rounded, and in eager code kept as the result's float32_value, which add_rows sums instead."""
    a, b, dtype = _alike(a, b)
    product = (b.mT @ a).mT if a.shape[-1] >= 1024 and a.shape[-1] >= 8 * b.shape[-1] else a.mT @ b
    rounded = product if product.dtype == dtype else product.to(dtype)
    if rounded is not product and not _functional(product):
        rounded.float32_value = product
    return rounded


def big_matmul(a, b):
    """a @ b for a product much larger than its factors (the scores Q Kᵀ, dP = dO Vᵀ: n × m from n × d and
    d × m). On CPU the result is written into memory advised for transparent huge pages, as NumPy advises its own
    large arrays: torch's allocator maps a fresh n × m tensor in 4 KiB pages, and the GEMM's first touch of each
    one faults (1 × 8 × 1024², float32, one thread: 35 → 19 ms). Compiled (torch.compile), a large product of
    factors of one batch shape is the custom op symattn::big_matmul (_by_custom_op), which inductor calls as it
    is. Transformed (torch.func), exported or recorded by autograd in eager code, plainly a @ b. Of 16-bit
    factors (bfloat16, float16) the product is float32 (``_wide_matmul``)."""
    a, b, _ = _alike(a, b)
    if a.dtype in (torch.bfloat16, torch.float16):
        return _wide_matmul(a, b)
    if a.device.type != "cpu" or a.dim() < 2 or b.dim() < 2:
        return a @ b
    if torch.compiler.is_compiling():
        size = a.shape[:-2].numel() * a.shape[-2] * b.shape[-1] * a.element_size()
        if a.shape[:-2] == b.shape[:-2] and _by_custom_op(a, size):
            return torch.ops.symattn.big_matmul(a, b)
        return a @ b
    if _functional(a) or _functional(b) or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return a @ b  # (a Function's forward and backward run with grad off: its saved inputs still require grad)
    return huge_matmul(a, b)


def _wide_matmul(a, b):
    """a @ b of 16-bit factors as float32: the n × m scores Q Kᵀ, dP = dO Vᵀ and what is made of them (P, L, dS)
    stay float32 as SDPA keeps them (products round them: ``narrow_matmul``). On CUDA by bmm's out_dtype; else of
    the thin factors widened (the same values: 16-bit products are exact in float32, sums are float32)."""
    if a.device.type == "cuda" and a.shape[:-2] == b.shape[:-2] and not (_functional(a) or _functional(b)):
        try:
            out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
            return out.reshape(*a.shape[:-2], *out.shape[-2:])
        except (RuntimeError, TypeError):  # a torch without bmm's out_dtype
            pass
    return big_matmul(a.float(), b.float())


def repeat_columns(a, times):
    """(..., n, 1) -> (..., n, times): the column repeated (a view; a is evaluated once)."""
    return a.expand(*a.shape[:-1], times)


def rows(a):
    """(..., n, k) -> (N, k): every row of every batch element, stacked."""
    return a.reshape(-1, a.shape[-1])


def sum_batch(a):
    """(..., p, q) -> (p, q): the sum over the leading batch dimensions."""
    return a.reshape(-1, *a.shape[-2:]).sum(dim=0)


def row_softmax_lse(a, out=None):
    """softmax along the last axis and the row log-sum-exp L = max + log Σ exp(a - max), which is max - log(P's
    largest entry, exp(0) / Σ): torch's one-pass softmax (into out, maybe a itself) and two row maxima, not the
    four passes of exp(a - max), its sum and the division."""
    if not a.shape[-1]:  # no keys
        return row_softmax(a, out=out), a.new_zeros(*a.shape[:-1], 1)
    top = a.amax(dim=-1, keepdim=True)  # before out, maybe a itself, is written
    e = row_softmax(a, out=out)
    return e, top - torch.log(e.amax(dim=-1, keepdim=True))


def gelu(a):
    """x Φ(x), entrywise (exact, erf form)."""
    return torch.nn.functional.gelu(a)


def gelu_grad(a):
    """GELU′(x) = Φ(x) + x φ(x), entrywise."""
    return 0.5 * (1.0 + torch.erf(a * 0.7071067811865476)) + a * torch.exp(-0.5 * a * a) * 0.3989422804014327


def gelu_tanh(a):
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""
    return torch.nn.functional.gelu(a, approximate="tanh")


def gelu_tanh_grad(a):
    """The derivative of gelu_tanh: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2, t = tanh(k (x + c x³))."""
    t = torch.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)


def layer_norm(a, eps):
    """Each row standardised: (a − mean) / √(biased variance + eps), along the last axis."""
    return torch.nn.functional.layer_norm(a, a.shape[-1:], eps=eps)


def row_inv_std(a, eps):
    """1 / √(biased variance + eps) of each row, as a column (..., n, 1): LayerNorm's own rstd (one pass; a.var
    takes five times as long on CPU)."""
    return torch.native_layer_norm(a, a.shape[-1:], None, None, eps)[2]


def _tensors(named):
    """The inputs, checked: tensors, rank, one leading batch shape for the non-weights, one dtype.

    A trainable scalar (shape "()") is a 0-d tensor of that dtype, or a number (made one).
    """
    tensors, batch, first = [], None, None
    for name, a in named.items():
        if (a is None and name in OPTIONAL) or SHAPES[name] == "()":
            tensors.append(a)
            continue
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor of shape {SHAPES[name]}, got {type(a).__name__}")
        weight = not SHAPES[name].startswith("(...")
        if a.dim() < 2 or (weight and a.dim() != 2):
            raise ValueError(f"{name}: expected shape {SHAPES[name]}, got {tuple(a.shape)}")
        if not a.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor of shape {SHAPES[name]}, got {a.dtype}")
        if first is not None and a.dtype != first[1].dtype:
            raise ValueError(f"mixed dtypes: {first[0]} is {first[1].dtype}, {name} is {a.dtype}")
        if not weight and batch is not None and a.shape[:-2] != batch[1].shape[:-2]:
            raise ValueError(
                f"{name}: expected shape {SHAPES[name]} with the batch dimensions of {batch[0]} "
                f"{tuple(batch[1].shape[:-2])}, got {tuple(a.shape)}"
            )
        first = first or (name, a)
        batch = batch or (None if weight else (name, a))
        tensors.append(a)
    for i, name in enumerate(named):  # a trainable scalar: a 0-d tensor of the inputs' dtype, or a number
        a = tensors[i]
        if SHAPES[name] != "()" or (a is None and name in OPTIONAL):  # a zero direction may be None
            continue
        if not isinstance(a, torch.Tensor):
            if type(a).__name__ in ("bool", "bool_") or not hasattr(type(a), "__float__"):
                raise TypeError(f"{name}: expected a real scalar (a float or a 0-d tensor), got {type(a).__name__}")
            tensors[i] = torch.tensor(float(a), dtype=first[1].dtype, device=first[1].device)
        elif a.dim() != 0 or not a.is_floating_point():
            raise ValueError(f"{name}: expected a 0-d floating-point tensor, got {a.dtype} {tuple(a.shape)}")
        elif a.dtype != first[1].dtype:
            raise ValueError(f"mixed dtypes: {first[0]} is {first[1].dtype}, {name} is {a.dtype}")
    return tensors


def _one_mask(name, value, attn_mask, query, key, allowed=False):
    """The mask the spec's additive constant `name` is made from: value, given in its position, or attn_mask,
    given by keyword; both given is a TypeError naming them. value (n × m or (..., n, m), n the query's rows, m
    the key's; torch's (B, 1, n, m) and any shape broadcasting to them: ``_mask_layout``) is a constant (detached:
    no gradient): a float one is added as it is, a bool is read as attn_mask's, True = not allowed, or with allowed,
    True = allowed (as torch's scaled_dot_product_attention reads a bool attn_mask)."""
    if value is None:
        return attn_mask
    if attn_mask is not None:
        raise TypeError(f"forward() got the mask {name} both in its position and as attn_mask; give it once")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (bool or float) or None, got {type(value).__name__}")
    viewed, read = _mask_layout(name, value.shape, query.shape[-2], key.shape[-2], tuple(query.shape[:-2]))
    if value.dtype != torch.bool and not value.is_floating_point():
        raise ValueError(f"{name}: expected a bool or floating-point tensor, got {value.dtype}")
    value = value.detach().reshape(viewed)
    value = value if viewed == read else value.expand(read).contiguous()
    return ~value if allowed and value.dtype == torch.bool else value


def _bool_constant(value, form, like):
    """A constant given as a bool tensor, made the matrix the spec holds, in like's dtype: form "additive": -inf
    where True, else 0; "additive_false": -inf where False; "keep": 1 where False, else 0; "keep_false": 1 where
    True. Any other value is returned as it is (the inputs' checks read it)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        return value
    masked = value if form in ("additive", "keep") else ~value  # True where the constant masks
    if form.startswith("additive"):
        return torch.zeros(value.shape, dtype=like.dtype, device=value.device).masked_fill(masked, float("-inf"))
    return (~masked).to(like.dtype)


def _rows(named):
    """Each parameter of shape (1, k) given 1-D, (k,) as torch holds a bias, as the 1 × k row (a view, so that
    autograd returns its gradient (k,)); the others as they are (the inputs' checks read them)."""
    return [v.unsqueeze(0) if isinstance(v, torch.Tensor) and v.dim() == 1 else v for v in named.values()]


def _grad_shape(mask):
    """The shape of the additive mask when it requires a gradient (a float attn_mask that does), else None."""
    return None if mask is None or not mask.requires_grad else mask.shape


def _additive_mask(attn_mask, key_padding_mask, causal, query, key, per_head=False, by_blocks=False):
    """The additive mask M (0 where a query may see a key, -inf where not), or None without a mask.

    attn_mask: (n, m) or (..., n, m), boolean (True: not allowed) or floating (added to the scores);
    key_padding_mask: (..., m) boolean (True: ignore that key); causal: query i sees keys j <= i.
    per_head: the scores have a heads axis, (..., H, n, m), so a batched mask gets one, (..., 1, n, m).
    by_blocks: M leaves the causal part out (None when nothing else is left), for a loop over blocks of query
    rows that writes it into each block of scores (causal_fill), so that no n × m tensor is made for it.
    """
    if type(causal).__name__ not in ("bool", "bool_"):  # True or False, or NumPy's np.True_ or np.False_
        raise ValueError(f"causal must be True or False, got {causal!r}")
    causal = bool(causal)
    if attn_mask is None and key_padding_mask is None and (by_blocks or not causal):
        return None
    n, m, batch = query.shape[-2], key.shape[-2], tuple(query.shape[:-2])
    dtype, device = query.dtype, query.device
    mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) not in ((n, m), (*batch, n, m)):
            got = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
            expected = f"(n, m) = ({n}, {m}) or {(*batch, n, m)}"
            raise ValueError(f"attn_mask: expected a tensor of shape {expected}, got {got}")
        if attn_mask.dtype == torch.bool:
            mask = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill_(attn_mask, float("-inf"))
        elif attn_mask.is_floating_point():
            mask = attn_mask.to(dtype)
        else:
            raise ValueError(f"attn_mask: expected a bool or floating-point tensor, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (*batch, m):
            got = key_padding_mask
            got = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"key_padding_mask: expected a tensor of shape (..., m) = {(*batch, m)}, got {got}")
        if key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype
            raise ValueError(f"key_padding_mask: expected a bool tensor (True: ignore a key), got {got}")
        padding = torch.zeros(key_padding_mask.shape, dtype=dtype, device=device)
        padding = padding.masked_fill_(key_padding_mask, float("-inf")).unsqueeze(-2)
        mask = padding if mask is None else mask + padding
    if mask is not None:
        mask = mask.expand(*mask.shape[:-2], n, m)  # a view: every query row, so that blocks of rows slice it
        if per_head and mask.ndim > 2:  # one mask for every head: (..., 1, n, m)
            mask = mask.unsqueeze(-3)
    return mask if by_blocks else with_causal(mask, causal, query, key)


def with_causal(mask, causal, query, key):
    """M with the causal part added (-inf where key j comes after query i) when causal, as a whole n × m tensor:
    the additive mask for the closed forms that take it whole, from the mask a loop over blocks of rows takes."""
    if not causal:
        return mask
    n, m, dtype, device = query.shape[-2], key.shape[-2], query.dtype, query.device
    future = torch.ones(n, m, dtype=torch.bool, device=device).triu_(1)
    future = torch.zeros(n, m, dtype=dtype, device=device).masked_fill_(future, float("-inf"))
    return future if mask is None else mask + future


def key_range(mask, causal, rows, m):
    """The keys a block of query rows (a slice) reads: slice(k0, k1), the smallest range holding every key that
    a row of the block may see (causal: key j <= query i; mask: an additive mask whose -inf hide a key), never
    empty. A loop over blocks of rows skips the keys outside it, whose probabilities are exactly zero. Traced,
    transformed or off the CPU, only the causal range (no branch on the mask's values: no wait for a GPU)."""
    first, last = 0, m
    if causal:  # row i sees keys 0 … i
        last = max(1, min(m, rows.stop))
    if mask is not None and mask.device.type == "cpu" and not _functional(mask):
        seen = (mask[..., rows, first:last] != float("-inf")).reshape(-1, last - first).any(dim=0).nonzero()
        if len(seen):
            first, last = first + int(seen[0]), first + int(seen[-1]) + 1
        else:  # every key hidden: one read, its probability zero
            last = first + 1
    return slice(first, max(last, first + 1))


def causal_fill(scores, rows, keys):
    """A block of scores (..., b, k) of query rows rows.start … and keys keys.start …, with -inf written where the
    key comes after the query (j > i: what the causal mask hides). In eager code only the keys after the block's
    first row are written (in place): the ones before it every row sees."""
    b, k = scores.shape[-2:]
    first = max(0, rows.start + 1 - keys.start)  # the first key of the block that some query row does not see
    if first >= k:
        return scores
    functional = _functional(scores)
    first = 0 if functional else first  # (traced: one masked_fill of the whole block, a new tensor)
    device = scores.device
    future = torch.arange(keys.start + first, keys.start + k, device=device) > torch.arange(
        rows.start, rows.start + b, device=device
    ).unsqueeze(-1)
    if functional:
        return scores.masked_fill(future, float("-inf"))
    scores[..., first:].masked_fill_(future, float("-inf"))
    return scores


def add_rows(total, keys, part, m):
    """The sum over blocks of a value of m rows (…, m, k), part adding to its rows keys; total is 0 before the
    first block. part is a product made for the sum (dAᵀ Q): the first one may become the sum itself. 16-bit parts
    are summed in float32 (an accumulation): the total is the float32 sum (its attribute float32_sum) rounded."""
    if _functional(part):  # no in-place update: part padded with zero rows to m
        padded = torch.nn.functional.pad(part, (0, 0, keys.start, m - keys.stop))
        return padded if isinstance(total, int) else total + padded
    low = part.dtype in (torch.bfloat16, torch.float16)
    # every key: part (a product made for this sum, maybe transposed by matmul_tn) is the sum so far
    if isinstance(total, int) and not low and part.shape[-2] == m and (part.is_contiguous() or part.mT.is_contiguous()):
        return part
    into = total.float32_sum if low and not isinstance(total, int) else total
    if isinstance(into, int):  # laid out as part is (matmul_tn gives a transposed product): a cheap add
        transposed = part.mT.is_contiguous() and not part.is_contiguous()
        shape, dtype = (*part.shape[:-2], m, part.shape[-1]), torch.float32 if low else part.dtype
        into = (
            part.new_zeros(shape[:-2] + shape[:-3:-1], dtype=dtype).mT
            if transposed
            else part.new_zeros(shape, dtype=dtype)
        )
    into[..., keys, :] += getattr(part, "float32_value", part) if low else part
    if not low:
        return into
    total = into.to(part.dtype)
    total.float32_sum = into
    return total


def put_rows(whole, rows, keys, part, n, m):
    """An n × m value made block by block: part (..., b, k) placed at its rows and keys, zero on the other keys
    of those rows (the ones the block skipped); whole is None before the first block."""
    if whole is None and part.shape[-2:] == (n, m) and part._base is None:  # one block, every key: part is the whole
        return part
    if _functional(part):  # no in-place update: the blocks and their key ranges, placed by placed_rows
        return [*(whole or []), (part, keys.start, m)]
    if whole is None:
        whole = huge_empty((*part.shape[:-2], n, m), part)
    write_rows(whole, rows, keys.start, part)
    return whole


def placed_rows(whole):
    """The value put_rows made, after the loop: traced or transformed, its blocks (a list of (part, first key, m))
    padded with zero keys and concatenated once; compiled, a large one by the custom op symattn::placed_rows, into
    huge pages (_by_custom_op: inductor's own buffer would fault page by page)."""
    if not isinstance(whole, list):
        return whole
    parts, starts, m = [part for part, _, _ in whole], [start for _, start, _ in whole], whole[0][2]
    first = parts[0]
    size = first.shape[:-2].numel() * sum(part.shape[-2] for part in parts) * m * first.element_size()
    if _by_custom_op(first, size):
        return torch.ops.symattn.placed_rows(parts, starts, m)
    padded = [torch.nn.functional.pad(part, (start, m - start - part.shape[-1])) for part, start in zip(parts, starts)]
    return torch.cat(padded, dim=-2)


def rows_per_block(mask, causal, query):
    """Query rows per block of a standard module's loop: 128 where the mask may let a block skip keys (causal,
    or any mask: key_range finds the keys each block sees), else all rows in one block (no mask: the whole
    computation at once, nothing to skip). Traced or transformed, blocks only for causal: key_range knows no
    other mask's keys there (no branch on its values), and a compiled graph fuses the whole. Off the CPU
    (CUDA), one block: a loop of small kernels costs more there than the masked keys it skips."""
    if query.device.type != "cpu" or not (causal or (mask is not None and not _functional(query))):
        return max(query.shape[-2], 1)
    return 128
