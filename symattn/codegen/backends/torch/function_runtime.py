"""Runtime helpers of the generated PyTorch modules' autograd Functions: apply (with the twin dynamo traces and
autocast), the precision of a 16-bit run (statistics and n × m arrays in float32, each rounded once, right before
a product), the first closed form's gradients guarded against a second derivative, the second closed form's
Function (``_Backward``: its backward and its jvp), the forward mode's tangent (``_tangent``), and the route of a
call on CUDA to the fused kernels of the spec's Triton module beside the generated one (``path``, ``_kernels_for``).

Real code, linted and tested; ``TorchMatrixPrinter`` copies the source of the ones a module calls (read with
``ast``) into it. The names below stand for the generated module's own constants and closed forms. Generating
code reads this module's source only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
except ImportError:  # pragma: no cover - generating a torch module reads this source, it needs no torch
    from types import SimpleNamespace

    torch = SimpleNamespace(autograd=SimpleNamespace(Function=object))

SPEC = ""  # the spec's name, for error messages
# A module with a second closed form: the Function's tensor inputs (the mask last), the directions of the
# inputs and the name of the first cotangent in _forward2, and its two closed forms.
INPUTS: tuple[str, ...] = ()
DIRECTION_OF: dict[str, str] = {}
TANGENT_OF: dict[str, str] = {}  # input name -> its tangent's (the forward mode's)
COTANGENT = ""
KERNELS = True  # the generated module's switch: forward on CUDA runs the fused kernels where they apply (path())
_KERNELS_MODULE: list = []  # the generated module's cache of its Triton module, once looked for (None: none imports)
_KERNELS_MAKER: list = []  # a module rendered in memory (drop_in): what makes its Triton module (None: it has none)
_RING: list = []  # the generated module's route for a drop-in's call inside context parallelism (symattn.distributed)


def _backward(saved, grad_out):  # pragma: no cover - stands for the generated module's own
    raise NotImplementedError


def _forward2(*inputs):  # pragma: no cover - stands for the generated module's own
    raise NotImplementedError


def _backward2(saved, grad_out):  # pragma: no cover - stands for the generated module's own
    raise NotImplementedError


class _Last(torch.autograd.Function):
    """The identity on derivatives made under create_graph=True, tied to what they depend on: differentiating them
    again raises with its message, since the generated closed forms go no further (in the setup_context style,
    so that torch.func's transforms apply it too)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(message, count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def _apply(function, *args, traced=None):
    """function.apply(*args), a tensor given a second time given as a view of itself (self-attention's Q = K = V):
    torch.compile refuses an autograd.Function given one tensor twice; the gradients reach it through both.
    Compiling (torch.compile, torch.export), traced instead: the Function's twin without jvp, which dynamo
    traces. Under torch.autocast the arguments are cast as autocast casts a product's (``_autocast``)."""
    if traced is not None and torch.compiler.is_compiling():
        function = traced
    args, autocast = _autocast(args)
    given = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and any(arg is seen for seen in given):
            arg = arg.view_as(arg)
        given.append(arg)
    if autocast is None:
        return function.apply(*given)
    with torch.autocast(autocast, enabled=False):
        return function.apply(*given)


def _autocast(args):
    """(args, device type) under torch.autocast on the arguments' device: each float32 tensor cast to autocast's
    dtype (float64 and integer, bool tensors as they are), as autocast casts the operands of a product, outside
    the Function (autograd carries each gradient back to its input's dtype through the cast); the Function then
    runs with autocast off, in that dtype. Not under autocast: (args, None)."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    if device in (None, "meta") or not torch.is_autocast_enabled(device):  # meta: shapes only, no autocast
        return args, None
    low = torch.get_autocast_dtype(device)
    cast = [a.to(low) if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a for a in args]
    return cast, device


def narrow_matmul(a, b):
    """a @ b, where a factor may be a float32 n × m array of a 16-bit run (P, dS of ``_wide_matmul``): the product
    of ``_alike``'s factors, rounded to the 16-bit dtype; in eager code the float32 product is kept as the result's
    float32_value, which a statistic of it reads (D = rowsum(dO ⊙ O), ``row_dot``: O = P V before its rounding, as
    autograd's rowsum(P ⊙ dP) in float32 is). Factors of one dtype (float32, float64 runs): a @ b."""
    a, b, dtype = _alike(a, b)
    product = a @ b
    if product.dtype == dtype:
        return product
    rounded = product.to(dtype)
    if not (torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(product)):
        rounded.float32_value = product  # (eager code: traced or transformed, a tensor holds no attribute)
    return rounded


def joined_rows(blocks):
    """The blocks of rows in the list stacked back into one tensor (one block: itself, no copy), their float32
    values (``narrow_matmul``) joined alike where every block has one."""
    if len(blocks) == 1:
        return blocks[0]
    whole = torch.cat(blocks, dim=-2)
    if all(hasattr(b, "float32_value") for b in blocks):
        whole.float32_value = torch.cat([b.float32_value for b in blocks], dim=-2)
    return whole


def _alike(a, b):
    """(a, b, the product's dtype) for factors of two dtypes, a float32 array of a 16-bit run beside a 16-bit one:
    on the CPU both float32 (a float32 GEMM is as fast as a bfloat16 one there, ten times a float16 one, and the
    float32 array is never rounded: the product is, once), elsewhere the float32 one rounded to the 16-bit dtype
    right before the product (its one rounding; the GEMM accumulates in float32). Of one dtype: as they are."""
    if a.dtype == b.dtype:
        return a, b, a.dtype
    low = a.dtype if a.element_size() < b.element_size() else b.dtype
    if a.device.type == "cpu":
        return a.float(), b.float(), low
    return a.to(low), b.to(low), low


def row_dot(a, b):
    """rowsum(a ⊙ b) as a column (..., n, 1), such as D = rowsum(dO ⊙ O): in float32 for 16-bit a or b (a
    statistic, kept as SDPA keeps it), of a product's float32 value where it has one, else in their dtype."""
    if a.dtype in (torch.bfloat16, torch.float16) or b.dtype in (torch.bfloat16, torch.float16):
        a, b = (getattr(x, "float32_value", x).float() for x in (a, b))  # a product before its rounding
    return (a * b).sum(dim=-1, keepdim=True)


def add_blocks(total, part):
    """total + part, a sum over the blocks of rows (a weight's gradient, dW_Q += rows(Q_b)ᵀ rows(dQ_b)); total is 0
    before the first block. 16-bit parts are summed in float32 (an accumulation) and the sum rounded once: the
    total is the float32 sum (its attribute float32_sum) rounded. Traced or transformed, or wider: total + part."""
    if part.dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        return part if isinstance(total, int) else total + part
    if torch._C._functorch.is_functorch_wrapped_tensor(part):
        return part if isinstance(total, int) else total + part
    into = part.float() if isinstance(total, int) else total.float32_sum.add_(part)
    total = into.to(part.dtype)
    total.float32_sum = into
    return total


def _distinct(output, *inputs):
    """The output, or a view of it where it is one of the inputs returned as it is (Y = X): a Function in the
    setup_context style may not save for backward an input that it returns."""
    return output.view_as(output) if any(output is x for x in inputs) else output


def _only_tensors(*values):
    """The values that are tensors (an absent bias or mask is None)."""
    return [value for value in values if isinstance(value, torch.Tensor)]


def _first_order(ctx, grad_out, gradients):
    """The gradients a backward returns; under create_graph=True each is tied to the inputs and grad_out,
    so that a second derivative raises instead of silently being wrong (as torch's once_differentiable)."""
    message = (
        f"{SPEC}: double backward is not supported: the generated backward is the closed-form first derivative "
        "and no second derivative is derived, so gradients made with create_graph=True cannot be differentiated again"
    )
    return _tie(gradients, (*ctx.saved_tensors[len(ctx.tensor_names) :], grad_out), message)


def _tie(gradients, sources, message):
    """gradients as they are, or under create_graph=True each tied by _Last (an identity whose backward raises
    with message) to the sources that require grad, so that differentiating them once more raises."""
    if not torch.is_grad_enabled():
        return gradients
    sources = [t for t in sources if t is not None and t.requires_grad]
    present = [g for g in gradients if g is not None]
    if not sources or not present:
        return gradients
    tied = iter(_Last.apply(message, len(present), *present, *sources))
    return tuple(None if g is None else next(tied) for g in gradients)


class _Held:
    """What _Backward is given besides tensors (the first closed form's value names and constants, the options, the
    number of inputs): one argument torch.func's transforms pass along as it is, never looked into."""

    def __init__(self, names, constants, options, count):
        self.names, self.constants, self.options, self.count = names, constants, options, count


class _Backward(torch.autograd.Function):
    """The first closed form as an autograd Function, used under create_graph=True: its backward is the
    second closed form. For the cotangents V_i of the gradients g_i(x, G), the gradients of the scalar
    f₂ = Σ_i tr(V_iᵀ g_i) with respect to every input x and to G (_forward2, _backward2) are exactly what
    autograd asks of it; its jvp (torch.func.hessian, jacfwd over jacrev) is the same Hessian along the
    inputs' tangents plus g(x, Ġ) (the gradients are linear in G). apply(held, G, *inputs, *saved values):
    INPUTS names the inputs (the additive mask last, where there is one), held.names the saved values."""

    generate_vmap_rule = True

    @staticmethod
    def forward(held, grad_out, *tensors):
        inputs, saved = _split(held, tensors)
        grads = _backward(saved, grad_out)
        out = []
        for name, x in zip(INPUTS, inputs):
            g = None if x is None else grads.get(name)  # (the memory-efficient variant gives M none)
            if g is not None and any(g is t for t in (grad_out, *inputs, *out)):  # an output is a new tensor
                g = g.clone()
            out.append(g)
        return tuple(out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        held, grad_out, *tensors = inputs
        ctx.set_materialize_grads(False)  # a gradient nobody differentiates has no cotangent: a zero direction
        ctx.save_for_backward(grad_out, *tensors)
        ctx.save_for_forward(grad_out, *tensors)
        ctx.held = held

    @staticmethod
    def backward(ctx, *cotangents):
        grad_out, *tensors = ctx.saved_tensors
        inputs, _ = _split(ctx.held, tensors)
        with torch.no_grad():
            grads = _hessian(ctx.held, grad_out, inputs, cotangents)
        gradients = [grads[COTANGENT], *(None if x is None else grads.get(name) for name, x in zip(INPUTS, inputs))]
        third = (
            f"{SPEC}: a third derivative is not supported: the generated closed forms are the first and second "
            "derivatives, so second derivatives made with create_graph=True cannot be differentiated again"
        )
        gradients = _tie(_shaped(gradients, (grad_out, *inputs)), (grad_out, *inputs, *cotangents), third)
        return (None, *gradients, *[None] * (len(tensors) - len(inputs)))

    @staticmethod
    def jvp(ctx, _held, grad_out_t, *tangents):
        _first_forward_mode()
        grad_out, *tensors = ctx.saved_tensors
        inputs, saved = _split(ctx.held, tensors)
        out = [None] * len(inputs)
        if any(t is not None for t in tangents[: len(inputs)]):
            grads = _hessian(ctx.held, grad_out, inputs, tangents[: len(inputs)])
            out = [None if x is None else grads.get(name) for name, x in zip(INPUTS, inputs)]
        if grad_out_t is not None:  # the gradients are linear in G: their tangent along Ġ is g(x, Ġ)
            linear = _backward(saved, grad_out_t)
            out = [g if x is None else _plus(g, linear.get(name)) for name, x, g in zip(INPUTS, inputs, out)]
        return tuple(_shaped(out, inputs))


def _split(held, tensors):
    """_Backward's tensors as (the inputs, the first closed form's saved values by name)."""
    inputs, values = list(tensors[: held.count]), tensors[held.count :]
    return inputs, dict(zip(held.names, values), **held.constants)


def _hessian(held, grad_out, inputs, directions):
    """The second closed form's gradients for the directions (a tangent or cotangent per input, None: zero):
    Σ_j ∂²tr(Gᵀ F)/∂x ∂x_j [V_j] under each input's name, and ∂f₂/∂G under COTANGENT's."""
    count = len(DIRECTION_OF)
    if len(inputs) > count and directions[count] is not None:
        raise RuntimeError(
            f"{SPEC}: the gradient of a float attn_mask cannot be differentiated again (no second derivative "
            "through it is derived); the gradients of the other inputs can"
        )
    _same_draws(held.constants, "a second derivative under create_graph=True", "hvp()")
    value, saved = _forward2(*inputs[:count], grad_out, *directions[:count], *inputs[count:], *held.options)
    return _backward2(saved, torch.ones_like(value))


def _plus(a, b):
    """a + b, where a None is zero."""
    return b if a is None else a if b is None else a + b


def _shaped(gradients, like):
    """Each gradient in the shape of its tensor: one made of unbatched values only is the same for every batch."""
    out = list(gradients)
    for i, (g, x) in enumerate(zip(out, like)):
        if g is not None and g.shape != x.shape:
            out[i] = g.expand(x.shape) if g.dim() <= x.dim() else g.sum_to_size(x.shape)
    return out


def _first_forward_mode():
    """Raise under forward mode over forward mode (torch.func.jvp of jvp, jacfwd of jacfwd): a jvp reads the
    inputs saved for it, which carry no tangent of an outer forward level, so a nested one would be wrong."""
    interpreters = torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()  # (import torch loads it)
    levels = [i for i in interpreters if i.key() == torch._C._functorch.TransformType.Jvp]
    if len(levels) > 1:
        raise RuntimeError(
            f"{SPEC}: forward mode over forward mode (jvp of jvp, jacfwd of jacfwd) is not supported: the "
            "generated jvp is a first derivative; for second derivatives use torch.func.hessian (jacfwd over "
            "jacrev) or jacrev of jacrev, both closed form"
        )


def _same_draws(constants, what, instead):
    """Refuse what recomputes the forward from the inputs where the call drew (dropout while training): the
    recomputation would draw another mask than the forward's (the module's own jvp() and hvp() draw once)."""
    training = constants.get("training", False)  # the option of a spec that drops out; None: its default, True
    if training is None or training:
        raise RuntimeError(
            f"{SPEC}: {what} of a call with dropout while training is not supported (its recomputed forward would "
            f"draw another mask); call this module's {instead}, which draws once, or run in eval (training=False)"
        )


def _tangent(jvp, ctx, tangents):
    """The output's tangent by jvp(<inputs>, <their tangents>, <M, Ṁ>, <options>) (a generated _jvp), the inputs
    as setup_context saved them (an absent one None) and tangents one per argument of apply."""
    _first_forward_mode()
    _same_draws(ctx.constants, "forward-mode AD (torch.func.jvp, jacfwd)", "jvp()")
    saved = iter(ctx.saved_tensors[len(ctx.tensor_names) :])
    inputs = [next(saved) if given else None for given in ctx.given]
    count = len(TANGENT_OF)
    return jvp(*inputs[:count], *tangents[:count], *inputs[count:], *tangents[count : len(inputs)], *ctx.options)[1]


def _second_order(ctx, saved, grad_out, options, spec_options):
    """A backward's gradients under create_graph=True, as outputs of _Backward (so that they are differentiable
    by the second closed form), then None for each of the options; the first spec_options of them are the
    second closed form's (a memory-efficient Function's block_size is not)."""
    tensors = iter(ctx.saved_tensors[len(ctx.tensor_names) :])
    inputs = [next(tensors) if given else None for given in ctx.given]
    held = _Held(ctx.tensor_names, ctx.constants, ctx.options[:spec_options], len(inputs))
    values = [saved[name] for name in ctx.tensor_names]
    return (*_Backward.apply(held, grad_out, *inputs, *values), *[None] * options)


def path(*args, **kwargs):
    """Which code forward(*args, **kwargs) runs: "triton", the fused kernels of the spec's Triton module beside this
    one (SPEC + "_triton"), or "torch: <why not>". The kernels run where KERNELS is True, every tensor argument is on
    CUDA, a plain tensor (or parameter) of float16, bfloat16 or float32, the call is eager (not traced by torch.compile
    or export, nor under a torch.func transform) and the Triton module imports (triton installed; generated with
    --backend triton)."""
    return _route([*args, *kwargs.values()])[1]


def _kernels_for(*arguments):
    """The Triton module forward hands the call to, or None: the torch ops run (path)."""
    return _route(arguments)[0]


def _route(arguments):
    """(the Triton module or None, the path's name and why); inside context parallelism's call of a drop-in, its
    ring, which takes the call whatever the device."""
    if _RING:
        return _RING[-1], "context parallel: the ring"
    if torch.compiler.is_compiling():
        return None, "torch: traced by torch.compile or export"
    tensors = [x for x in arguments if isinstance(x, torch.Tensor)]
    if not KERNELS:
        return None, "torch: KERNELS is False"
    if not tensors or not all(_kernel_device(x) for x in tensors):
        return None, "torch: not every tensor is on CUDA"
    if any(torch._C._functorch.is_functorch_wrapped_tensor(x) for x in tensors):
        return None, "torch: under a torch.func transform"
    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in tensors):
        return None, "torch: a tensor subclass (DTensor, fake tensors)"
    if any(x.is_floating_point() and x.dtype not in (torch.float16, torch.bfloat16, torch.float32) for x in tensors):
        return None, "torch: a float64 tensor"
    module = _kernels_module()
    if module is None:
        return None, f"torch: no {SPEC}_triton module imports beside this one"
    return module, "triton"


def _kernel_device(x):
    """Is x on the device the kernels run on (CUDA)?"""
    return x.is_cuda


def _kernels_module():
    """The spec's Triton module beside this one (same package), or None; a module rendered in memory (drop_in) has
    its Triton module made by _KERNELS_MAKER, once, at its first call on CUDA."""
    if not _KERNELS_MODULE and _KERNELS_MAKER:
        _KERNELS_MODULE.append(_KERNELS_MAKER[0]())
    if not _KERNELS_MODULE:
        import importlib

        package = __name__.rpartition(".")[0]
        try:
            found = importlib.import_module(f"{package}.{SPEC}_triton" if package else f"{SPEC}_triton")
        except Exception:  # not generated, triton not installed or failing to load: the torch ops run
            found = None
        _KERNELS_MODULE.append(found)
    return _KERNELS_MODULE[0]


def _constant(x):
    """A constant handed to the kernels as this module takes one in its position: without a gradient."""
    return x.detach() if isinstance(x, torch.Tensor) else x
