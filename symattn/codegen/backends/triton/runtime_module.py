"""Runtime helpers of the generated Triton modules' public functions: the dimensions read off the inputs, head counts
and the products of the axes checked, masks made additive (attn_mask, key_padding_mask), bias rows that may be left
out, dropout's seed, and the arguments of jvp (tangents, dual inputs) and hvp (leaves, direction, the derivative
along it).

Real code, linted and tested; ``module.render_triton`` copies the source of the ones a module calls (read with
``ast``, ``runtime_functions``) into it. ``AXES`` and ``TANGENT_OF`` stand for the generated module's own.
Generating code reads this module's source only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
    from torch.autograd import forward_ad
except ImportError:  # pragma: no cover - generating a Triton module reads this source, it needs no torch
    torch = forward_ad = None

AXES: dict[str, tuple] = {}  # input name -> its last two axes: a dimension's name or a size
TANGENT_OF: tuple[str, ...] = ()  # the inputs jvp takes tangents of (and hvp directions)
_DIMENSIONS: dict = {}  # the inputs' shapes → their dimensions (_dimensions)


def _dimensions(*arrays):
    """The dimensions read off the arrays' last two axes (AXES's, in its order); a ValueError naming the input and
    shapes otherwise. Read once per tuple of shapes (_DIMENSIONS; at most 256 kept), then looked up: a fresh dict."""
    key = tuple(None if x is None else x.shape for x in arrays)
    dims = _DIMENSIONS.get(key)
    if dims is None:
        if len(_DIMENSIONS) >= 256:  # shapes that change call by call: the cache stays small
            _DIMENSIONS.clear()
        dims = _DIMENSIONS[key] = _read_dimensions(arrays)
    return dict(dims)


def _read_dimensions(arrays):
    """_dimensions' reading: each array's last two axes checked against AXES and the sizes read before."""
    dims = {}
    for (name, axes), x in zip(AXES.items(), arrays):
        if x is None:  # a bias left out
            continue
        if x.dim() < 2:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected (..., {', '.join(map(str, axes))})")
        for size, axis in zip(x.shape[-2:], axes):
            known = axis if isinstance(axis, int) else dims.setdefault(axis, size)
            if known != size:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; expected (..., {', '.join(map(str, axes))}) "
                    f"with {axis} = {known}"
                )
    return dims


def _count(name, value):
    """A head count as a Python int >= 1 (an int or a NumPy integer, never a bool); a ValueError otherwise."""
    if type(value).__name__ in ("bool", "bool_") or not hasattr(value, "__index__") or value.__index__() < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value.__index__()


def _divides(name, value, of, total):
    """A ValueError unless value (name) divides total (of)."""
    if total % value:
        raise ValueError(f"{name} = {value} does not divide {of} = {total}")


def _share(dims, size, rest):
    """The factor of the axis size (a product, H*d_k) left by rest (H); a ValueError where rest does not divide it."""
    if dims[size] % rest:
        raise ValueError(f"{size} = {dims[size]} is not a multiple of {rest}")
    return dims[size] // rest


def _product(dims, size, value):
    """A ValueError unless the axis of the product size (H_kv*d_k) is value."""
    if dims[size] != value:
        raise ValueError(f"{size} = {dims[size]}, expected {value}")


def _leaves(*inputs):
    """The inputs as new leaves that require grad (None, or a tensor that is not floating, as it is)."""
    return [x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]


def _direction(direction):
    """An hvp's direction: a dict from input names to tensors of their shapes (a name left out: zero there)."""
    if not isinstance(direction, dict):
        raise TypeError(f"direction: expected a dict from input names to tensors, got {type(direction).__name__}")
    unknown = [name for name in direction if name not in TANGENT_OF]
    if unknown:
        raise ValueError(f"direction: {unknown[0]!r} is no input; inputs: {', '.join(TANGENT_OF)}")
    return direction


def _along(out, grad_out, leaves, direction):
    """{name: the derivative of ∂⟨grad_out, out⟩/∂x_name along direction} over the leaves given: the gradients with
    create_graph, then the gradient of Σ ⟨direction[x], ∂f/∂x⟩ (zero where nothing moves)."""
    named = {name: x for name, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad}
    grads = torch.autograd.grad(out, list(named.values()), grad_out, create_graph=True, allow_unused=True)
    terms = [(g * direction[k]).sum() for k, g in zip(named, grads) if g is not None and direction.get(k) is not None]
    total = sum(terms, out.new_zeros(()))
    found = [None] * len(named)
    if total.requires_grad:
        found = torch.autograd.grad(total, list(named.values()), allow_unused=True)
    return {name: torch.zeros_like(x) if h is None else h for (name, x), h in zip(named.items(), found)}


def _additive(name, mask, like):
    """A bool mask (True = not allowed) as the additive mask (−inf where True, else 0); a float one as it is (one that
    requires grad gets its gradient, written tile by tile by the kernels as a learned bias's)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))


def _constant(x):
    """A constant of the spec (Spec.constants, given in its position or by its name) as the kernels take it: without
    a gradient, as the torch module takes it."""
    return x.detach() if isinstance(x, torch.Tensor) else x


def _mask(name, mask, attn_mask, key_padding_mask, query, per_head):
    """The additive mask the kernels read, or None: mask in its position or attn_mask by keyword (giving both is a
    TypeError), plus key_padding_mask ((..., m) bool, True = ignore the key). per_head: the scores have a heads axis
    (..., H, n, m), so a mask batched as the query is gets one of size 1 (torch's (B, 1, n, m) is taken as it is)."""
    if mask is not None and attn_mask is not None:
        raise TypeError(f"{name} and attn_mask are the same mask: give one of them")
    mask = _additive(name, mask, query) if attn_mask is None else _additive("attn_mask", attn_mask, query)
    if per_head and mask is not None and 2 < mask.dim() == query.dim():
        mask = mask.unsqueeze(-3)
    if key_padding_mask is None:
        return mask
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask: expected a bool tensor (True: ignore a key), got {key_padding_mask!r}")
    padding = _additive("key_padding_mask", key_padding_mask, query).unsqueeze(-2)  # (..., 1, m)
    if per_head and padding.dim() > 2:
        padding = padding.unsqueeze(-3)  # (..., 1, 1, m)
    return padding if mask is None else mask + padding


def _seed(training, rng, like):
    """Dropout's seed for one call: None where not training (no draw: the kernels drop nothing), else a 0-d int64
    tensor on like's device drawn from rng (a torch.Generator; None: torch's default one, so torch.manual_seed
    reproduces a call). The kernels draw the mask from it by Philox; the backward and the JVP read it, saved, and
    draw the same mask."""
    if type(training) is not bool:
        raise ValueError(f"training must be True or False, got {training!r}")
    if not training:
        return None
    device = like.device if rng is None else rng.device
    return torch.randint(2**62, (), generator=rng, device=device, dtype=torch.int64).to(like.device)


def _row(x):
    """A bias row: (1, k), or 1-D (k,) as torch holds one (viewed as the row); None (left out) stays None."""
    return x.unsqueeze(0) if x is not None and x.dim() == 1 else x


def _or_zero(x, like):
    """x, or a 0-d zero (adding nothing) where a bias is left out."""
    return torch.zeros((), dtype=like.dtype, device=like.device) if x is None else x


def _tangents(tangents):
    """jvp's tangents: a dict from input names to tensors (a name left out: zero there)."""
    if not isinstance(tangents, dict):
        raise TypeError(f"tangents: expected a dict from input names to tensors, got {type(tangents).__name__}")
    unknown = [name for name in tangents if name not in TANGENT_OF]
    if unknown:
        raise ValueError(f"tangents: {unknown[0]!r} is no input; inputs: {', '.join(TANGENT_OF)}")
    return tangents


def _duals(tangents, *inputs):
    """The inputs (TANGENT_OF's order) as forward-mode dual tensors with their tangents (None: zero)."""
    return [_dual(x, tangents.get(name)) for name, x in zip(TANGENT_OF, inputs)]


def _dual(x, tangent):
    """x with its tangent (forward mode); x itself where the tangent is None."""
    return x if tangent is None or x is None else forward_ad.make_dual(x, tangent)


def _by_sequence(table):
    """A table read at positions in a core whose heads the module splits (Q (…, H, n, d)), with the inputs' batch
    axes (one per sequence; per head or not): its heads axis inserted before its rows, (…, 1, rows, cols), so that
    its leading axes line up with the sequences' and it broadcasts over the heads, as the torch modules read it (a
    view: its gradient and tangent by autograd); a table without batch axes, or None, as it is."""
    return table if table is None or table.dim() < 3 else table.unsqueeze(-3)
