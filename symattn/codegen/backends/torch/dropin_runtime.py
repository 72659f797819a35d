"""Drop-in torch modules of generated PyTorch modules: torch's own classes, computed by the closed form.

``MultiheadAttention`` takes ``torch.nn.MultiheadAttention``'s constructor, parameters (names, shapes,
torch's (out, in) layout), state dict and ``forward``; ``TransformerEncoderLayer`` (``dropin_block``, with
the helpers here) takes ``torch.nn.TransformerEncoderLayer``'s, every configuration. Each maps torch's
weights onto the spec's math layout with views (W_Q = in_proj_weight[:E]ᵀ, b_Q = in_proj_bias[:E] as a
1 × E row), which autograd carries back to torch's parameters, and calls the generated Function.

Real code, linted and tested; a spec family names the classes its torch module carries
(``specs.Family.dropins``) and code generation copies their source with the helpers they call
(``codegen.dropins``) to the end of the module. ``FUNCTION``, ``_forward`` and ``_backward``
stand for the generated module's own autograd Function and passes; ``SPEC`` for its spec's name.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a torch module reads this source, it needs no torch
    from types import SimpleNamespace

    torch = SimpleNamespace(
        autograd=SimpleNamespace(Function=object, function=SimpleNamespace(once_differentiable=lambda f: f)),
        nn=SimpleNamespace(Module=object),
    )

FUNCTION = None  # the generated module's autograd Function (its apply takes the spec's inputs, M, causal, options;
# returns the output and the saved values)
TRACED = None  # its twin without jvp, which _apply applies while compiling
_forward = _backward = None  # the generated module's forward pass (out, saved) and closed-form backward
SPEC = ""  # the spec's name, for error messages
_apply = None  # function_runtime._apply, as the generated module carries it: Function.apply, Q = K = V allowed
narrow_matmul = None  # function_runtime.narrow_matmul, as the generated module carries it
_kernels_for = None  # the generated module's: the spec's Triton module where its kernels take a call (path())
CONFIGURATION: dict = {}  # the generated module's: the family options of the configuration it computes
_CONFIGURED: dict = {}  # the generated module's: a configuration's items → its closed form, rendered once


def _not_supported(option, value, why):
    """The error of a torch option the closed form does not compute."""
    return NotImplementedError(f"{SPEC}: {option}={value!r} is not supported: {why}")


def _size(name, value):
    """value as a Python int >= 1 (not a bool)."""
    # value.__index__(), not type(value).__index__: torch.compile traces the one, not the other
    if type(value).__name__ in ("bool", "bool_") or not hasattr(value, "__index__") or value.__index__() < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value.__index__()


def _closed_form(configuration):
    """(Function, traced Function, whether the spec's Triton module computes it, the Function returning the
    attention weights too of another module that has one, None for this module's own) of a configuration of the
    spec's family (the block's norm_first and activation, a dropout while training): this module's own where it
    is its own (``CONFIGURATION``); else the torch module of that member of the family, rendered by symattn's
    code generation and executed in memory, once per process (about a second), its kernels off: the spec's
    Triton module beside this one computes this module's configuration only."""
    if configuration == CONFIGURATION:
        return FUNCTION, TRACED, True, None
    key = tuple(sorted(configuration.items()))
    if key not in _CONFIGURED:
        import linecache
        import re
        import sys
        import types

        try:
            from symattn.codegen.generate import render
        except ImportError as error:  # this module copied away from symattn
            raise _not_supported("configuration", configuration, f"symattn renders it, and {error}") from None
        text = render(SPEC, "torch", configuration=configuration)
        suffix = re.sub(r"\W", "_", "_".join(str(v).lower() for v in configuration.values()))  # 0.1 → 0_1
        name = f"{__name__}_{suffix}"
        module = types.ModuleType(name)
        module.__file__ = f"<symattn: {SPEC} {configuration}>"
        linecache.cache[module.__file__] = (len(text), None, text.splitlines(True), module.__file__)
        sys.modules[name] = module  # its classes found by name (pickle, torch.compile)
        exec(compile(text, module.__file__, "exec"), module.__dict__)
        module.KERNELS = False
        _CONFIGURED[key] = module.FUNCTION, module.TRACED, False, getattr(module, "_AttentionWeights", None)
    return _CONFIGURED[key]


def _prepare(configuration):
    """Render a configuration's closed form now, at construction (never while compiling); where symattn cannot
    render it (this module copied away from symattn), the call that needs it refuses instead (train(), dropout)."""
    try:
        _closed_form(configuration)
    except NotImplementedError:
        pass


def _float_mask(name, mask, dtype):
    """torch's mask convention as an additive float mask: bool True → −∞ (not allowed), float → added."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a bool or floating-point tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if not mask.is_floating_point():
        raise ValueError(f"{name}: expected a bool or floating-point tensor, got {mask.dtype}")
    return mask.to(dtype)


def _torch_mask(attn_mask, key_padding_mask, query, key, heads):
    """The additive mask M of torch's attn_mask and key_padding_mask, broadcast against (..., H, L, S) scores.

    query (..., L, E) and key (..., S, E) with batch () or (N,); attn_mask (L, S) or (N·H, L, S) (unbatched:
    (H, L, S)); key_padding_mask (N, S) (unbatched: (S,)). None when neither is given.
    """
    batch, L, S = tuple(query.shape[:-2]), query.shape[-2], key.shape[-2]
    mask = None
    if attn_mask is not None:
        shapes = ((L, S), ((batch[0] if batch else 1) * heads, L, S))
        if not isinstance(attn_mask, torch.Tensor) or tuple(attn_mask.shape) not in shapes:
            got = tuple(attn_mask.shape) if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__
            expected = f"(L, S) = {shapes[0]} or (N * num_heads, L, S) = {shapes[1]}"
            raise ValueError(f"attn_mask: expected shape {expected}, got {got}")
        mask = _float_mask("attn_mask", attn_mask, query.dtype)
        mask = mask.reshape(*batch, heads, L, S) if mask.dim() == 3 else mask
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (*batch, S):
            got = key_padding_mask
            got = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"key_padding_mask: expected shape (N, S) = {(*batch, S)} (unbatched: (S,)), got {got}")
        padding = _float_mask("key_padding_mask", key_padding_mask, query.dtype)
        padding = padding.reshape(*batch, 1, 1, S)
        mask = padding if mask is None else mask + padding
    return mask


def _sequences(name, batch_first, *tensors):
    """The inputs as (N, L, E) (batch_first or not) or unbatched (L, E); and whether they were batched."""
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name}: expected torch.Tensor inputs, got {[type(t).__name__ for t in tensors]}")
    ranks = {t.dim() for t in tensors}
    if ranks not in ({2}, {3}):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"{name}: expected all 3-D (batched) or all 2-D (unbatched) inputs, got shapes {shapes}")
    batched = ranks == {3}
    if batched and not batch_first:
        tensors = tuple(t.transpose(0, 1) for t in tensors)
    return tensors, batched


def _projections(self):
    """The spec's W_Q, W_K, W_V (E_in × E) and b_Q, b_K, b_V (1 × E, or None): views of torch's parameters."""
    E = self.embed_dim
    if self.in_proj_weight is not None:
        weights = self.in_proj_weight.view(3, E, E).transpose(-1, -2).unbind(0)
    else:
        weights = (self.q_proj_weight.mT, self.k_proj_weight.mT, self.v_proj_weight.mT)
    biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.view(3, 1, E).unbind(0)
    return weights, biases


class _AttentionWeights(torch.autograd.Function):
    """The generated closed form returning the per-head attention weights too: P_h, or with dropout while training
    (drawn: training, rng) the weights D_h = Z_h ⊙ P_h that multiply V_h, Z_h the mask of the call.

    A gradient G_W on the weights is G_P = G_W (⊙ Z_h) on P_h, which adds, in closed form,
    dA_h = P_h ⊙ (G_P − (P_h ⊙ G_P) 𝟏𝟏ᵀ), dQ_h = scale dA_h K_h, dK_h = scale dA_hᵀ Q_h, carried through the
    projections Q W_Q + 𝟏 b_Q and K W_K + 𝟏 b_K (and M).
    """

    @staticmethod
    def forward(ctx, Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, M, causal, heads, *drawn):
        ctx.set_materialize_grads(False)
        Y, saved = _forward(Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, M, causal, heads, None, *drawn)
        tensors = [name for name, value in saved.items() if isinstance(value, torch.Tensor)]
        ctx.save_for_backward(*(saved[name] for name in tensors))
        ctx.tensor_names, ctx.shape, ctx.drawn = tensors, Y.shape, len(drawn)
        ctx.constants = {name: value for name, value in saved.items() if name not in tensors}
        weights = saved["P_h"] * saved["Z_h"] if "Z_h" in saved else saved["P_h"]
        return Y, weights.to(Y.dtype)  # (a 16-bit run keeps P_h in float32: the weights in Y's dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_weights):
        saved = dict(zip(ctx.tensor_names, ctx.saved_tensors), **ctx.constants)
        if grad_out is None:
            grad_out = saved["P_h"].new_zeros(ctx.shape)
        grads = _backward(saved, grad_out)
        if grad_weights is not None:
            _add_weights_gradient(grads, saved, grad_weights)
        names = ("Q", "K", "V", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "M")
        return (*(grads[name] for name in names), None, None, *(None,) * ctx.drawn)


def _add_weights_gradient(grads, saved, grad_weights):
    """grads (the closed form's, keyed by input) plus the terms of a gradient G_W on the weights (P_h, or Z_h ⊙ P_h
    with dropout: G_P = Z_h ⊙ G_W on P_h)."""
    P, scale = saved["P_h"], 1 / saved["d_k"] ** 0.5  # the closed form's scale, made again as its backward does
    if "Z_h" in saved:
        grad_weights = grad_weights * saved["Z_h"]
    dA = P * (grad_weights - (P * grad_weights).sum(dim=-1, keepdim=True))
    products = (
        ("Q", "W_Q", "b_Q", narrow_matmul(dA, saved["K_h"])),
        ("K", "W_K", "b_K", narrow_matmul(dA.mT, saved["Q_h"])),
    )
    for x, w, b, d in products:  # (narrow_matmul: dA of a 16-bit run is float32, rounded before its products)
        d = scale * d.transpose(-2, -3).flatten(-2)  # the heads merged: (..., rows, H · d_k)
        grads[x] = grads[x] + d @ saved[w].mT
        grads[w] = grads[w] + saved[x].reshape(-1, saved[x].shape[-1]).mT @ d.reshape(-1, d.shape[-1])
        if grads[b] is not None:
            grads[b] = grads[b] + d.reshape(-1, d.shape[-1]).sum(dim=0, keepdim=True)
    if grads["M"] is not None:
        grads["M"] = grads["M"] + dA.sum_to_size(saved["mask_shape"])


class MultiheadAttention(torch.nn.Module):
    """``torch.nn.MultiheadAttention`` computed by the generated closed form: the same constructor, parameters
    (``in_proj_weight`` 3E × E or ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``), state dict and
    ``forward(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
    -> (output, weights or None)``.

    Dropout p on the weights while training (D_h = P_h ⊙ Z_p(P_h), the weights returned with need_weights), the
    mask drawn from torch's default generator as torch draws it (``torch.manual_seed`` reproduces a run), the
    backward the exact derivative of the forward with those draws; eval() or dropout=0.0: no draw.

    Not computed (a clear error): add_bias_kv, add_zero_attn.
    A row whose keys are all masked gives zeros, where torch gives NaN. With need_weights the weights
    are differentiable (their gradient in closed form too) and a second derivative raises.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if add_bias_kv:
            raise _not_supported("add_bias_kv", add_bias_kv, "the closed form has no learned key/value row")
        if add_zero_attn:
            raise _not_supported("add_zero_attn", add_zero_attn, "the closed form has no zero key/value row")
        self.embed_dim, self.num_heads = _size("embed_dim", embed_dim), _size("num_heads", num_heads)
        self.kdim = self.embed_dim if kdim is None else _size("kdim", kdim)
        self.vdim = self.embed_dim if vdim is None else _size("vdim", vdim)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        if not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        self.dropout, self.batch_first, self.head_dim = float(dropout), bool(batch_first), embed_dim // num_heads
        if self.dropout > 0:  # train(): the member of the family that drops out the weights
            _prepare({"dropout": self.dropout})
        self._qkv_same_embed_dim = self.kdim == self.vdim == self.embed_dim
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        E, factory = self.embed_dim, {"device": device, "dtype": dtype}
        if self._qkv_same_embed_dim:
            self.in_proj_weight = torch.nn.Parameter(torch.empty(3 * E, E, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = torch.nn.Parameter(torch.empty(E, E, **factory))
            self.k_proj_weight = torch.nn.Parameter(torch.empty(E, self.kdim, **factory))
            self.v_proj_weight = torch.nn.Parameter(torch.empty(E, self.vdim, **factory))
        if bias:
            self.in_proj_bias = torch.nn.Parameter(torch.empty(3 * E, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = torch.nn.Linear(E, E, bias=bias, **factory)
        self._reset_parameters()

    def _reset_parameters(self):
        """As torch: Xavier-uniform input projections, zero biases (out_proj.weight keeps Linear's init)."""
        for weight in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if weight is not None:
                torch.nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            torch.nn.init.zeros_(self.in_proj_bias)
            torch.nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self):
        kdim = "" if self.kdim == self.embed_dim else f", kdim={self.kdim}"
        vdim = "" if self.vdim == self.embed_dim else f", vdim={self.vdim}"
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"bias={self.in_proj_bias is not None}{kdim}{vdim}, batch_first={self.batch_first}"
        )

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        """(output, weights): output as the inputs' layout; weights (N, L, S) averaged over the heads, or
        (N, H, L, S) per head (unbatched: no N), or None without need_weights (then, on CUDA, by the spec's Triton
        module where its kernels apply: path())."""
        drops = self.training and self.dropout > 0  # D_h = P_h ⊙ Z_p(P_h), drawn as torch draws it
        if is_causal and attn_mask is None:  # torch's contract: is_causal is a hint that attn_mask is causal
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        (query, key, value), batched = _sequences("MultiheadAttention", self.batch_first, query, key, value)
        (W_Q, W_K, W_V), (b_Q, b_K, b_V) = _projections(self)
        if self.kdim != self.embed_dim:  # the spec's K is E wide: projected here, the spec's W_K the identity
            key, W_K, b_K = torch.nn.functional.linear(key, self.k_proj_weight, b_K), _identity(W_Q), None
        if self.vdim != self.embed_dim:
            value, W_V, b_V = torch.nn.functional.linear(value, self.v_proj_weight, b_V), _identity(W_Q), None
        W_O, b_O = self.out_proj.weight.mT, None if self.out_proj.bias is None else self.out_proj.bias.unsqueeze(0)
        M = _torch_mask(attn_mask, key_padding_mask, query, key, self.num_heads)
        # M whole (torch's masks, the causal one among them), so no causal flag beside it
        inputs = (query, key, value, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, M, False, self.num_heads)
        function, traced, kernels_apply, with_weights = _closed_form({"dropout": self.dropout} if drops else {})
        kernels = None if need_weights or not kernels_apply else _kernels_for(*inputs[:12])
        drawn = (True, None) if drops else ()  # training, rng: torch's default generator, as torch's module
        if need_weights:
            out, weights = _apply(with_weights or _AttentionWeights, *inputs, *drawn)
            weights = weights.mean(dim=-3) if average_attn_weights else weights
        elif kernels is not None:  # CUDA: the spec's Triton module, its inputs and M in the spec's order (no weights)
            out, weights = kernels.forward(*inputs[:12], num_heads=self.num_heads), None
        else:
            out, weights = _apply(function, *inputs, None, *drawn, traced=traced)[0], None
        return (out.transpose(0, 1) if batched and not self.batch_first else out), weights


def _identity(square):
    """The identity of a square matrix's size, dtype and device (no gradient)."""
    return torch.eye(square.shape[0], dtype=square.dtype, device=square.device)
