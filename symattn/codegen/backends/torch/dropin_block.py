"""The drop-in ``TransformerEncoderLayer``: torch's class computed by the generated closed form of the block.

Every configuration torch's layer takes is a member of the ``transformer_block`` family (``specs.block``):
norm_first (pre-LN X + MHA(LN₁(X)), … or post-LN LN₁(X + MHA(X)), …) × the feed-forward activation (GELU
exact or tanh, ReLU, SiLU). The generated module computes its own configuration (``CONFIGURATION``); another
is rendered once per process, in memory, by symattn's code generation (``_closed_form``). torch's
spellings of an activation (strings, functions, modules, a partial of F.gelu) are read by table; any other
callable by evaluating it against the candidates on a probe grid (``_probed_activation``).

Real code, linted and tested; code generation copies it beside ``dropin_runtime``'s (``codegen.dropins``).
``FUNCTION``, ``TRACED``, ``_apply``, ``_kernels_for``, ``SPEC`` and ``CONFIGURATION`` stand for the
generated module's own.
"""

from __future__ import annotations

from symattn.codegen.backends.torch.dropin_runtime import (
    _closed_form,
    _not_supported,
    _prepare,
    _projections,
    _sequences,
    _size,
    _torch_mask,
    torch,
)

_apply = _kernels_for = None  # the generated module's (see dropin_runtime)


class _SelfAttentionWeights(torch.nn.Module):
    """The attention weights of ``TransformerEncoderLayer`` under torch's names (``self_attn.in_proj_weight``, …)."""

    def __init__(self, embed_dim, num_heads, bias, batch_first, factory):
        super().__init__()
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.in_proj_weight = torch.nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        if bias:
            self.in_proj_bias = torch.nn.Parameter(torch.zeros(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        torch.nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            torch.nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self):
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, bias={self.in_proj_bias is not None}"


def _activation_candidates():
    """The block's activations by (activation, approximate), each with torch's function computing it."""
    F = torch.nn.functional
    return {
        ("gelu", "none"): F.gelu,
        ("gelu", "tanh"): lambda x: F.gelu(x, approximate="tanh"),
        ("relu", "none"): F.relu,
        ("silu", "none"): F.silu,
    }


def _named_activation(activation):
    """The block's (activation, approximate) of torch's spellings: "relu" and "gelu" (torch's strings), F.relu,
    F.gelu, F.silu, torch.relu, nn.ReLU(), nn.GELU(approximate=…), nn.SiLU(), functools.partial(F.gelu,
    approximate=…); None for any other callable."""
    F = torch.nn.functional
    functions = {F.relu: ("relu", "none"), torch.relu: ("relu", "none"), F.gelu: ("gelu", "none")}
    functions[F.silu] = ("silu", "none")
    modules = {torch.nn.ReLU: "relu", torch.nn.GELU: "gelu", torch.nn.SiLU: "silu"}  # by exact type: a subclass
    # may compute something else, and is probed
    if isinstance(activation, str):
        if activation not in ("relu", "gelu"):  # torch's own refusal, word for word
            raise RuntimeError(f"activation should be relu/gelu, not {activation}")
        return activation, "none"
    if type(activation) in modules:
        return modules[type(activation)], getattr(activation, "approximate", "none")
    keywords = getattr(activation, "keywords", None)
    if getattr(activation, "func", None) is F.gelu and not activation.args and set(keywords) <= {"approximate"}:
        return "gelu", keywords.get("approximate", "none")  # functools.partial(F.gelu, approximate=…)
    try:
        return functions.get(activation)
    except TypeError:  # an unhashable callable
        return None


def _probed_activation(activation):
    """The block's (activation, approximate) that activation computes, or None: the candidate whose values and
    derivatives it reproduces exactly (float64, bit for bit) on a grid of 201 points over [−8, 8] (step 0.08, 0 and
    negatives among them) — a lambda or function wrapping torch's F.relu, F.gelu or F.silu."""
    grid = torch.linspace(-8.0, 8.0, 201, dtype=torch.float64)
    for key, candidate in _activation_candidates().items():
        x, y = grid.clone().requires_grad_(True), grid.clone().requires_grad_(True)
        try:
            with torch.enable_grad():
                got = activation(x * 1.0)  # not the leaf: an in-place activation may write over its argument
                if not isinstance(got, torch.Tensor) or got.shape != x.shape or not got.requires_grad:
                    return None
                (slope,) = torch.autograd.grad(got.sum(), x)
        except Exception:  # a callable that cannot take a float64 tensor: nothing the block computes
            return None
        want = candidate(y)
        (want_slope,) = torch.autograd.grad(want.sum(), y)
        if torch.equal(got.detach(), want.detach()) and torch.equal(slope, want_slope):
            return key
    return None


def _block_activation(activation):
    """The block's (activation, approximate) of torch's activation argument; NotImplementedError naming an
    activation the block does not compute."""
    found = _named_activation(activation)
    if found is None and callable(activation):
        found = _probed_activation(activation)
    if found is None:
        shown = getattr(activation, "__name__", None) or repr(activation)
        why = "the block computes ReLU, GELU (exact or tanh) and SiLU (a callable is matched on a probe grid)"
        raise _not_supported("activation", shown, why)
    return found


class TransformerEncoderLayer(torch.nn.Module):
    """``torch.nn.TransformerEncoderLayer`` computed by the generated closed form: the same constructor (signature
    and defaults: dropout=0.1, activation=F.relu, norm_first=False), submodules (``self_attn``, ``linear1``,
    ``linear2``, ``norm1``, ``norm2``), state dict and ``forward(src, src_mask, src_key_padding_mask, is_causal)``.

    Computed, each configuration as torch computes it (float64 outputs and gradients within 1e-9 relative):
    post-LN (norm_first=False) X₁ = LN₁(X + MHA(X)), Z = LN₂(X₁ + FFN(X₁)); pre-LN (norm_first=True)
    Y = X + MHA(LN₁(X)), Z = Y + FFN(LN₂(Y)); FFN(u) = act(u W₁ + b₁) W₂ + b₂ with act ReLU ("relu", F.relu,
    nn.ReLU()), exact GELU ("gelu", F.gelu, nn.GELU()), tanh GELU (nn.GELU(approximate="tanh"),
    functools.partial(F.gelu, approximate="tanh")) or SiLU (F.silu, nn.SiLU()); any other callable (a lambda)
    is evaluated on a probe grid and taken for the one of these whose values and derivatives it reproduces
    bit for bit, else refused. bias=False, layer_norm_eps, batch_first both ways. Dropout p while training, where
    torch's layer drops out (the attention weights, the attention sublayer's output, the activation's output, the
    feed-forward output), four masks of torch's shapes drawn from torch's default generator in torch's order
    (``torch.manual_seed`` reproduces a run; not torch's bits: torch's layer draws some of its masks in the memory
    layout of transposed intermediates), the backward the exact derivative of the forward with those draws;
    eval() or dropout=0.0: no draw.
    The generated module computes pre-LN exact GELU (on CUDA by the spec's Triton module where its kernels
    apply); another configuration is rendered in memory on first use (about a second) and runs the torch ops.
    Not computed (a clear error): another activation, a LayerNorm without
    elementwise_affine or with eps differing between norm1 and norm2.
    """

    def __init__(
        self,
        d_model,
        nhead,
        dim_feedforward=2048,
        dropout=0.1,
        activation=torch.nn.functional.relu,
        layer_norm_eps=1e-5,
        batch_first=False,
        norm_first=False,
        bias=True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        d_model, nhead = _size("d_model", d_model), _size("nhead", nhead)
        if d_model % nhead:
            raise ValueError(f"d_model = {d_model} must be divisible by nhead = {nhead}")
        if not 0.0 <= float(dropout) <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        factory = {"device": device, "dtype": dtype}
        self.dropout, self.batch_first, self.norm_first = float(dropout), bool(batch_first), bool(norm_first)
        self.self_attn = _SelfAttentionWeights(d_model, nhead, bias, self.batch_first, factory)
        self.linear1 = torch.nn.Linear(d_model, _size("dim_feedforward", dim_feedforward), bias=bias, **factory)
        self.linear2 = torch.nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm1 = torch.nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = torch.nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        if isinstance(activation, str):  # as torch: the string's function
            _block_activation(activation)
            activation = getattr(torch.nn.functional, activation)
        self.activation = activation
        self._configure()

    def _configure(self):
        """The configuration of the family the layer computes, read from norm_first and activation (again when
        either was changed after construction), its closed form rendered now (never while compiling)."""
        name, approximate = _block_activation(self.activation)
        configuration = {"norm_first": self.norm_first, "activation": name, "approximate": approximate}
        self._configured = (self.norm_first, self.activation, configuration)
        _closed_form(configuration)
        if self.dropout > 0:  # train(): the member of the family that drops out
            _prepare(configuration | {"dropout": self.dropout})

    def extra_repr(self):
        name, approximate = self._configured[2]["activation"], self._configured[2]["approximate"]
        shown = name if approximate == "none" else f"{name}(approximate={approximate!r})"
        return (
            f"d_model={self.linear1.in_features}, nhead={self.self_attn.num_heads}, "
            f"dim_feedforward={self.linear1.out_features}, dropout={self.dropout}, activation={shown}, "
            f"layer_norm_eps={self.norm1.eps}, batch_first={self.batch_first}, norm_first={self.norm_first}"
        )

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        """The layer's output, of src's shape and layout (the class's docstring gives the math)."""
        if is_causal and src_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        for norm in (self.norm1, self.norm2):
            if norm.weight is None:
                raise _not_supported("elementwise_affine", False, "the block's LayerNorms are affine")
        if self.norm1.eps != self.norm2.eps:
            raise _not_supported("norm2.eps", self.norm2.eps, f"the block's LayerNorms share eps = {self.norm1.eps}")
        if self._configured[0] != self.norm_first or self._configured[1] is not self.activation:
            self._configure()
        drops = self.training and self.dropout > 0  # the four dropouts of torch's layer, drawn as torch draws
        configuration = self._configured[2] | ({"dropout": self.dropout} if drops else {})
        function, traced, kernels_apply, _ = _closed_form(configuration)
        (x,), batched = _sequences("TransformerEncoderLayer", self.batch_first, src)
        attn = self.self_attn
        (W_Q, W_K, W_V), (b_Q, b_K, b_V) = _projections(attn)
        row = lambda v: None if v is None else v.unsqueeze(0)  # noqa: E731 - (E,) -> the spec's 1 × E row
        shift = lambda norm: row(norm.bias) if norm.bias is not None else x.new_zeros(1, x.shape[-1])  # noqa: E731
        M = _torch_mask(src_mask, src_key_padding_mask, x, x, attn.num_heads)
        inputs = (  # the spec's order: X, the weights and norms, then the biases and M
            x, W_Q, W_K, W_V, attn.out_proj.weight.mT,
            row(self.norm1.weight), shift(self.norm1), row(self.norm2.weight), shift(self.norm2),
            self.linear1.weight.mT, self.linear2.weight.mT,
            b_Q, b_K, b_V, row(attn.out_proj.bias), row(self.linear1.bias), row(self.linear2.bias), M,
        )  # fmt: skip
        kernels = _kernels_for(*inputs) if kernels_apply else None
        if kernels is not None:  # CUDA: the spec's Triton module
            out = kernels.forward(*inputs, num_heads=attn.num_heads, eps=self.norm1.eps)
        else:
            drawn = (True, None) if drops else ()  # training, rng: torch's default generator, as torch's layer
            out = _apply(function, *inputs, False, attn.num_heads, self.norm1.eps, *drawn, traced=traced)[0]
        out = _autocast_output(out, x, self.norm_first)
        return out.transpose(0, 1) if batched and not self.batch_first else out


def _autocast_output(out, x, norm_first):
    """out in the dtype torch's layer returns under torch.autocast on x's device: pre-LN ends in the residual sum
    x + FFN(…), x's dtype promoted with autocast's; post-LN in a LayerNorm of that sum, whose dtype is autocast's
    policy on the device (float32 on CUDA, the input's on the CPU: read off a LayerNorm of one entry). Out of
    autocast, out as it is."""
    device = x.device.type
    if device == "meta" or not torch.is_autocast_enabled(device):
        return out
    dtype = torch.promote_types(x.dtype, torch.get_autocast_dtype(device))
    if not norm_first:
        dtype = torch.nn.functional.layer_norm(torch.zeros(1, 1, dtype=dtype, device=x.device), (1,)).dtype
    return out.to(dtype)
