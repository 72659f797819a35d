"""Runtime helpers of the generated Triton modules' launches: each kernel's launch settings (blocks that fit shared
memory, warps, stages, tl.dot's precision), its grid, the eager or custom-op call, the operands broadcast and
flattened to the kernels' (batch·heads, rows, columns) layout, the n × m tiles' views and strides, the scalar
arguments as one float32 tensor, and an n × m tile's gradient summed back to its input's shape; a table read at
positions: its histogram's slots (its size limit), its gradient from the kernels' partial histograms.

Real code, linted and tested; ``module.render_triton`` copies the source of the ones a module calls (read with
``ast``, ``runtime_functions``) into it. ``LAUNCH``, ``SHARED``, ``STREAMED``, ``COPIES``, ``GRID_Y`` and ``_NUMBERS``
stand for the generated module's own (``templates/triton_module.py.j2``). Generating code reads this module's source
only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a Triton module reads this source, it needs no torch
    from types import SimpleNamespace

    torch = SimpleNamespace(compiler=SimpleNamespace(assume_constant_result=lambda f: f))

from symattn.codegen.backends.triton.runtime_autograd import SPEC, _batched  # (the generated module has its copies)

# per kernel: BLOCK_M (query rows), BLOCK_N (keys), warps, pipeline stages; the generated module's table
LAUNCH: dict[str, tuple[int, int, int, int]] = {}
SHARED = 0  # the shared-memory budget of one program's tiles, in bytes
STREAMED: dict[str, int] = {}  # the block a kernel's loop steps through (0: M, 1: N)
COPIES: dict[str, int] = {}  # the copies of each block a kernel holds (the JVP: each block beside its tangent)
GRID_Y = 65535  # a CUDA grid's most programs along its axes 1 and 2
_NUMBERS: dict = {}  # (the numbers, a device) → their float32 tensor there
_PLANS: dict = {}  # a launch's key (its kernel, layouts, dtypes, device, options) → its plan (_planned)


def _launch(x, width, kernel):
    """The kernel's launch settings for inputs like x, each row width entries (d + d_v): BLOCK_M × BLOCK_N = 16 × 16
    under the interpreter (CPU tensors, one program at a time); on a GPU LAUNCH's, the larger block (the streamed one
    of a tie) halved, down to 16, while one held block and num_stages streamed ones (triton's software pipeline), each
    row padded to a power of two, times the kernel's COPIES of each block (the JVP's tangents beside them), pass SHARED
    bytes: a wide head in float32 fits a GPU's shared memory."""
    if not x.is_cuda:
        return {"BLOCK_M": 16, "BLOCK_N": 16}
    *blocks, warps, stages = LAUNCH[kernel]
    row = _width(width) * x.element_size() * COPIES[kernel]
    streamed = STREAMED[kernel]
    while max(blocks) > 16:
        if (blocks[1 - streamed] + stages * blocks[streamed]) * row <= SHARED:
            break
        blocks[streamed if blocks[streamed] >= blocks[1 - streamed] else 1 - streamed] //= 2
    return {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1], "num_warps": warps, "num_stages": stages}


def _backward_parts(x, width, keys, rows, bh, atomic):
    """The backward kernel's launches for inputs like x (rows width entries) over keys keys and rows query rows of bh
    batch·heads: [(grid, constexprs)], the key part at _launch's "backward_keys" (dK, dV) and the query part at its
    "backward_queries" (dQ): one launch of both where their settings coincide (the interpreter's 16 × 16), one each
    where they differ; atomic (deterministic=False): the key part alone, adding dQ by atomic adds."""
    key_part, query_part = _launch(x, width, "backward_keys"), _launch(x, width, "backward_queries")
    if atomic:
        parts = [(key_part, True, False)]
    elif key_part == query_part:
        parts = [(key_part, True, True)]
    else:
        parts = [(key_part, True, False), (query_part, False, True)]
    launches = []
    for blocks, has_keys, has_queries in parts:
        programs = has_keys * _cdiv(keys, blocks["BLOCK_N"]) + has_queries * _cdiv(rows, blocks["BLOCK_M"])
        grid, wide = _grid(programs, bh)
        launches.append((grid, {"WIDE": wide, "KEYS": has_keys, "QUERIES": has_queries, "ATOMIC": atomic, **blocks}))
    return launches


def _planned(key, make):
    """make()'s result for key, made on key's first call and read from a dictionary after (a launch's plan: its grids
    and constexprs for its operands' shapes, dtypes, device and options, key); at most 256 plans kept."""
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:  # shapes that change call by call: the cache stays small
            _PLANS.clear()
        plan = _PLANS[key] = make()
    return plan


def _launcher(kernel, grid, constexprs, device):
    """A plan's launch of kernel over grid with its constexprs: launch(*arguments) takes the kernel's other arguments,
    in its order. The first call goes through Triton's JIT (kernel[grid]: it binds the arguments, computes its
    specialisation key and compiles, or under the interpreter runs the kernel); where the JIT returns a compiled
    kernel (on a GPU; the interpreter returns none) the later calls launch it directly, as Inductor launches one: its
    launcher called with the grid, the device's current stream and the arguments, the constexprs after them in the
    kernel's order (the JIT's binding, specialisation key and cache look-up skipped: the plan's key holds what they
    read, the operands' shapes, strides, dtypes, alignment and device, _layout). A launch hook (a profiler's, added
    to Triton's hook chain) sends a call through the JIT again, which gives the hook its metadata."""
    kept = []  # once known: the compiled kernel, its grid's axes, its device, the device's and stream's getters, …

    def launch(*arguments):
        if kept:
            compiled, axes, index, current, stream, tail, hook = kept
            now = current()
            if now == index and not _hooked(hook):  # (another current device: the JIT's kernel for that one)
                metadata = compiled.packed_metadata
                compiled.run(*axes, stream(now), compiled.function, metadata, None, None, None, *arguments, *tail)
                return
        found = kernel[grid](*arguments, **constexprs)
        if not kept:
            kept.extend(_direct(kernel, found, grid, len(arguments), constexprs, device))

    launch.settings = (grid, constexprs)  # what the plan chose (its grid and constexprs), to read
    return launch


def _direct(kernel, found, grid, given, constexprs, device):
    """[compiled kernel, grid axes, device, the current device's and its stream's getters, constexprs' values in the
    kernel's order, launch hook] for
    _launcher's direct launches of found (what kernel[grid] returned), or [] where there is none to make: found no
    compiled kernel (the interpreter's launch returns None), or the kernel's parameters after the given arguments
    not all constexprs given (a launch the JIT must bind)."""
    if not all(hasattr(found, name) for name in ("run", "function", "packed_metadata")):
        return []
    names = kernel.arg_names[given:]
    if any(name not in constexprs for name in names):
        return []
    import triton

    hook = getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "launch_enter_hook", None)
    if device.type == "cuda":  # as the JIT: the current device (it compiled for) and its current stream
        current, stream = torch.cuda.current_device, torch._C._cuda_getCurrentRawStream
    else:  # (a stand-in compiled kernel on the CPU: benchmarks/gpu_kernels.py's stubbed launches)

        def current():
            return None

        def stream(_):
            return 0

    tail = [constexprs[name] for name in names]
    return [found, (*grid, 1, 1)[:3], current(), current, stream, tail, hook]


def _hooked(hook):
    """Is a launch hook set (Triton's hook chain holds a call, or a hook that is not a chain)? Then the JIT launches,
    giving the hook the launch's metadata."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _layout(*tensors):
    """What Triton's JIT specialises a launch on beyond shapes and dtypes, per tensor (None: nothing): its shape,
    strides, and whether its address is a multiple of 16 bytes; a plan's key holds it, so that a compiled kernel
    launched directly (_launcher) is the one the JIT would pick."""
    return tuple([None if x is None else (x.shape, x.stride(), x.data_ptr() % 16 == 0) for x in tensors])


def _residual(o):
    """Does a core keep O's rounding beside a 16-bit O (bfloat16, float16), for its backward's D?"""
    return o.dtype in (torch.bfloat16, torch.float16)


def _precision(x):
    """tl.dot's input precision for float32 as torch's float32 matmul has it: "ieee" (no TF32) at torch's default
    float32 matmul precision ("highest"), "tf32" where it is set lower; float16 and bfloat16 ignore it."""
    return "ieee" if x.dtype == torch.float32 and _highest() else "tf32"


@torch.compiler.assume_constant_result  # torch.compile reads the setting once, as a constant of the graph
def _highest():
    """Whether torch's float32 matmul precision is "highest" (no TF32)."""
    return torch.get_float32_matmul_precision() == "highest"


def _width(size):
    """A tile's width for a dimension of size entries: a power of two, at least 16 (tl.dot's least)."""
    width = 16
    while width < size:
        width *= 2
    return width


def _cdiv(a, b):
    """⌈a / b⌉ (triton.cdiv's, without its per-call cost on the host)."""
    return -(-a // b)


def _grid(blocks, bh):
    """A kernel's grid and its WIDE flag: (blocks, batch·heads), the axes swapped where the batch·heads pass GRID_Y
    (batch 4096 of 16 heads: 65536)."""
    wide = bh > GRID_Y
    return ((bh, blocks) if wide else (blocks, bh)), wide


def _eager(x):
    """Does a launch on operands like x run eagerly on real tensors (not under torch.compile or torch.func's
    transforms, x not fake or meta)? Then the launch function is called directly, on the operands whole (_geometry):
    the custom op's dispatch costs host time on every call, time a GPU waits for. Else through the custom op
    (torch.compile holds it as one node, its fake gives the shapes; under vmap its vmap rule), on flat operands."""
    if torch.compiler.is_compiling() or isinstance(x, torch._subclasses.FakeTensor) or x.is_meta:
        return False
    return not torch._C._are_functorch_transforms_active()


def _whole(x, batch, rows, cols):
    """x as an eager launch takes it: itself where its batch axes are batch's (the launch reads them as one,
    _geometry), else broadcast to (*batch, rows, cols) and flattened (_flat)."""
    return x if x.shape[:-2] == batch else _flat(x, batch, rows, cols)


def _geometry(x):
    """(B·H, the batch stride, the row stride) of x read as the kernels read it, (B·H, rows, cols) with unit column
    stride: its leading axes stepped through as one axis, where their strides allow it (a contiguous tensor, a
    flat one, a view of heads split off the columns); None where they do not (the launch flattens x first: a
    copy). The one stride: s with stride_i = s · Π_{j > i} size_j along every leading axis i of size > 1."""
    *lead, _, cols = x.shape
    strides = x.stride()
    if cols > 1 and strides[-1] != 1:
        return None
    count, step = 1, 0
    for size, stride in zip(reversed(lead), reversed(strides[:-2])):
        if size == 1:
            continue
        if count == 1:
            step = stride
        elif stride != step * count:
            return None
        count *= size
    return count, step, strides[-2]


def _flat(x, batch, rows, cols):
    """x broadcast to (*batch, rows, cols), its batch axes as one (a view where the strides allow)."""
    if x.shape[:-2] != batch:  # broadcast (the common case, x already of the batch shape, skips expand's call)
        x = x.expand(*batch, rows, cols)
    return x.reshape(-1, rows, cols)  # reshape: a view where the strides allow


def _rows(x):
    """x with its last axis contiguous (the kernels step the last axis by 1)."""
    return x if _batched(x) or x.stride(-1) == 1 else x.contiguous()  # batched: laid out by the op's vmap rule


def _tile(x, batch, rows, cols):
    """x broadcast to (*batch, rows, cols) as (outer, inner, rows, cols), inner the last batch axis (the heads): a mask
    broadcast over it keeps its stride 0 there (a view; a copy only where the outer axes do not merge)."""
    return x.expand(*batch, rows, cols).reshape(-1, batch[-1] if batch else 1, rows, cols)


def _tile_arguments(tiles, dummy):
    """Each n × m tile's pointer and strides (outer batch, inner batch, row, key); an absent one (None): nothing."""
    arguments = []
    for t in tiles:
        arguments += [dummy, 0, 0, 0, 0] if t is None else [t, *t.stride()]
    return arguments


def _inner(batch):
    """The size of the last batch axis (the heads; 1 without batch axes): how a tile's batch·head index splits."""
    return batch[-1] if batch else 1


def _batches(Q, K, V, tiles, grouped):
    """(the queries' batch shape, the keys' and values'): the operands' broadcast batch axes. grouped: K and V have
    H_kv heads (the axis before their last two) shared by the queries' H, H_kv dividing H; theirs is the batch with
    H_kv there (the kernels read key/value head h // (H / H_kv) for query head h: K and V are never repeated)."""
    shapes = [t.shape for t in tiles if t is not None]
    if not grouped:
        batch = _batch(Q.shape, K.shape, V.shape, *shapes)
        return batch, batch
    heads = Q.shape[-3]
    if heads % K.shape[-3] or K.shape[-3] != V.shape[-3]:
        raise ValueError(f"{K.shape[-3]} key/value heads (K {tuple(K.shape)}, V {tuple(V.shape)}) do not share {heads}")
    seen = [(*x.shape[:-3], heads, *x.shape[-2:]) for x in (K, V)]
    batch = _batch(Q.shape, *seen, *shapes)
    return batch, (*batch[:-1], K.shape[-3])


def _batch(*shapes):
    """The broadcast batch shape of the operands' leading axes; a ValueError naming the shapes otherwise."""
    batches = {s[:-2] for s in shapes}
    if len(batches) == 1:  # the common case, without broadcast_shapes' cost
        return batches.pop()
    try:
        return torch.broadcast_shapes(*(s[:-2] for s in shapes))
    except RuntimeError:
        raise ValueError(f"batch axes do not broadcast: {', '.join(str(tuple(s)) for s in shapes)}") from None


def _scalar_tensor(values, like):
    """The kernels' scalar arguments as one float32 tensor on like's device, read by pointer in the kernels: a
    trainable scalar's value stays on the device and torch.compile traces it (no float() of a tensor). A number is
    filled in on the device: a copy from the host would wait for the device's queue to empty (torch copies pageable
    memory synchronously), leaving the host's launch work unhidden on every call. Numbers only (1/√d, a scale): the
    tensor filled once per device and values (_NUMBERS), not once per call; never while a CUDA graph is captured
    (its fill would only run on the graph's replay)."""
    if torch.compiler.is_compiling():
        values = values or (0,)  # none: one entry 0
        return torch.stack([torch.as_tensor(x, dtype=torch.float32, device=like.device).reshape(()) for x in values])
    if any(isinstance(x, torch.Tensor) for x in values) or (like.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _filled(values, like.device)
    key = (values, like.device)
    found = _NUMBERS.get(key)
    if found is None:
        if len(_NUMBERS) >= 64:  # values that change call by call: the cache stays small
            _NUMBERS.clear()
        found = _NUMBERS[key] = _filled(values, like.device)
    return found


def _filled(values, device):
    """values (numbers and one-entry tensors) as one float32 tensor on device; one entry 0 where there are none."""
    if not values:
        return torch.zeros(1, dtype=torch.float32, device=device)
    parts = [_scalar(x, device) for x in values]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _scalar(x, device):
    """x, a number or a one-entry tensor, as a float32 tensor of shape (1,) on device."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(x), dtype=torch.float32, device=device)


def _made(grads, wanted, absent):
    """The n × m gradients made (one per True of wanted, in order) placed among all of them, absent where one was not
    wanted: the kernels' pointer arguments (absent: a pointer never written), or None for the Function's gradients."""
    made = iter(grads)
    return [next(made) if w else absent for w in wanted]


def _gradient(flat, batch, like):
    """A gradient as like's: one made in like's shape (an eager launch's, _whole) as it is; a flat one (BH, rows,
    cols) viewed as (*batch, rows, cols), summed over the axes that like broadcasts."""
    if flat.shape == like.shape:  # made in like's shape (an eager launch's, _whole)
        return flat
    grad = flat.view(*batch, *flat.shape[-2:])
    return grad if grad.shape == like.shape else grad.sum_to_size(like.shape)


def _tile_gradient(grad, wanted, batch, like):
    """An n × m tile's gradient (BH, n, m) summed to like's shape (its broadcast axes), in like's dtype; None where
    it was not wanted (like does not require grad, or is absent; grad None)."""
    if not wanted or like is None:
        return None
    return grad.view(*batch, *grad.shape[-2:]).sum_to_size(like.shape).to(like.dtype)


def _slots(table, name):
    """The slots of a learned table's gradient histogram in the kernels: its rows·cols entries, padded to a power of
    two, at least 4. The kernels compare each score's index with every slot (one-hot, four slots at a time: O(tile ·
    slots) work per tile): a table of more than 256 entries is refused in one line."""
    size = table.shape[-2] * table.shape[-1]
    if size > 256:
        raise ValueError(
            f"{SPEC}: the table {name} read at positions has {size} entries; the Triton kernels sum a learned "
            "table's gradient over at most 256 (use the torch backend, or a smaller or clamped table)"
        )
    return max(4, 1 << (size - 1).bit_length())  # (four at a time: _histogram)


def _table_gradient(parts, batch, like, wanted):
    """A table's gradient from the kernels' partial histograms (BH, row blocks, slots), one row per program: summed
    over the row blocks, then over the batch axes the table broadcasts, in a fixed order (torch's sums, no atomics:
    the same bits on every run), in like's dtype and shape; None where not wanted."""
    if not wanted:
        return None
    size = like.shape[-2] * like.shape[-1]
    total = parts.sum(-2)[..., :size].reshape(*batch, *like.shape[-2:])
    return total.sum_to_size(like.shape).to(like.dtype)


def _table_tangent(tangent, table, batch):
    """A table's tangent as the JVP kernel takes it (zero where None), a view like the table's (_tile)."""
    tangent = torch.zeros_like(table) if tangent is None else tangent
    return _tile(tangent, batch, *table.shape[-2:])


def _narrowed(x):
    """A table as the kernels take it, (outer, inner, rows, cols), each batch axis it is broadcast along (stride 0) cut
    to one entry: a block map per sequence, not one copy per head."""
    for axis in (0, 1):
        if x.shape[axis] > 1 and x.stride(axis) == 0:
            x = x.narrow(axis, 0, 1)
    return x


def _kinds(empty, full):
    """A block map as the kernels read it (``block_classes``'s empty and full, (outer, inner, row blocks, key blocks),
    an axis of one entry where every sequence or head shares it): int8 kinds, 0 no pair of the tile visible (never
    visited), 2 every pair (the mask not evaluated), 1 the rest; then its strides along the outer and inner batch
    axes (0 along an axis of one entry) and the row blocks (the key blocks' 1)."""
    kinds = torch.where(empty, 0, torch.where(full, 2, 1)).to(torch.int8)
    kinds = kinds[(None,) * (4 - kinds.dim())].contiguous()
    outer, inner = (kinds.stride(a) if kinds.shape[a] > 1 else 0 for a in (0, 1))
    return kinds, outer, inner, kinds.stride(2)
