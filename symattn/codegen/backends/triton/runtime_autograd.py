# ruff: noqa: E741 (O, the attention output, is the derivation's name)
"""Runtime helpers of the generated Triton modules' autograd Functions: how a core runs (the Function or its traced
twin, Q, K, V under autocast, a dual O by the JVP kernel), its backward under create_graph (the eager core
differentiated) and under forward mode (refused), and the torch.func scaffolding around the kernels (vmap's axis
taken as one more batch axis, merged into the batch·head axis and split back, tensors unwrapped to their storage).

Real code, linted and tested; ``module.render_triton`` copies the source of the ones a module calls (read with
``ast``, ``runtime_functions``) into it. ``SPEC`` stands for the generated module's own. Generating code reads this
module's source only, so it imports without torch.
"""

from __future__ import annotations

try:
    import torch
    from torch.autograd import forward_ad
except ImportError:  # pragma: no cover - generating a Triton module reads this source, it needs no torch
    torch = forward_ad = None

SPEC = ""  # the spec's name, for error messages


def _signature_kept(function):
    """function (an autograd.Function) with its forward's signature computed once: Function.apply binds its
    arguments by it on every call, which would otherwise compute it again each time (host time a GPU waits for)."""
    import inspect

    function.forward.__signature__ = inspect.signature(function.forward)
    return function


def _first_forward_mode():
    """A RuntimeError under forward mode over forward mode (torch.func.jvp of jvp): the kernel's tangent is a first
    derivative, carrying no tangent of an outer level, so a nested one would be silently wrong."""
    interpreters = torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()
    if sum(i.key() == torch._C._functorch.TransformType.Jvp for i in interpreters) > 1:
        raise RuntimeError(f"{SPEC}: forward mode over forward mode (jvp of jvp) is not supported by the kernels")


def _second_derivative(grad, saved):
    """Is a backward asked to be differentiable (create_graph=True: double backward, reverse over reverse)? Not under
    torch.func's grad or vjp, which ask it of every backward (their levels unwrapped, the kernels run), also where
    vjp's function is called after the transform (its saved inputs still wrapped)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return torch.is_grad_enabled() and not any(wrapped(x) for x in (grad, *saved) if x is not None)


def _reverse_only():
    """A RuntimeError where a backward runs under forward mode (torch.func.hessian, jacfwd of jacrev, jvp of grad):
    the kernels' backward has no tangent of its own; hvp (reverse over reverse) gives second derivatives."""
    interpreters = torch._functorch.pyfunctorch.retrieve_all_functorch_interpreters()
    if any(i.key() == torch._C._functorch.TransformType.Jvp for i in interpreters):
        raise RuntimeError(
            f"{SPEC}: forward mode over the kernels' backward (hessian, jacfwd of jacrev) is not "
            "supported; hvp gives second derivatives (reverse over reverse)"
        )


def _untransformed(grad, saved):
    """Does a backward run outside torch.func's transforms on plain tensors (grad and the saved ones, None or not
    wrapped by a transform, live or dead)? Then it needs none of the transforms' scaffolding: one check."""
    if torch._C._are_functorch_transforms_active():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not wrapped(grad) and not any(x is not None and wrapped(x) for x in saved)


def _recomputed(ctx, grad, saved, eager, kept):
    """A Function's gradients as differentiable torch ops: its core recomputed by eager (the n × m arrays in memory)
    from the saved inputs (saved: ctx.saved_tensors) and differentiated by autograd with create_graph, so a second
    derivative flows through."""
    Q, K, V, _, *rest = saved
    tensors = _tensors(ctx, rest[kept:])
    inputs = [Q, K, V, None, None, None, *tensors]  # the Function's: causal, deterministic, symbols have none
    wanted = [i for i, x in enumerate(inputs) if x is not None and ctx.needs_input_grad[i]]
    out = eager(Q, K, V, ctx.causal, ctx.symbols, tensors)
    found = torch.autograd.grad(out, [inputs[i] for i in wanted], grad, create_graph=True, allow_unused=True)
    grads = [None] * len(inputs)
    for i, value in zip(wanted, found):
        grads[i] = value
    return tuple(grads)


def _tensors(ctx, present):
    """A core Function's tiles and trainable scalars (its *tensors) from the saved ones present: None where absent."""
    present = iter(present)
    return [None if absent else next(present) for absent in ctx.absent]


def _batched(x):
    """Is x a tensor batched by torch.func.vmap at its outermost level?"""
    return isinstance(x, torch.Tensor) and torch._C._functorch.is_batchedtensor(x)


def _to_batch(x):
    """x without torch.func's grad and jvp wrappers down to a tensor batched by vmap, or to the plain tensor."""
    while isinstance(x, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x) and not _batched(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _physical(x):
    """A batched tensor's values with vmap's axis first (a plain tensor: as it is)."""
    if not _batched(x):
        return x
    return torch._C._functorch.get_unwrapped(x).movedim(torch._C._functorch.maybe_get_bdim(x), 0)


def _vmapped_core(function, info, in_dims, arguments):
    """function.apply(Q, K, V, causal, deterministic, symbols, *tensors) under torch.func.vmap: vmap's axis of each
    tensor moved first (a size-1 axis where it has none: the kernels broadcast batch axes) as one more leading batch
    axis of the core; O and the statistics returned with it first. A batched trainable scalar is refused (the kernels
    read one value)."""
    moved = []
    for x, dim in zip(arguments, in_dims):
        if isinstance(x, torch.Tensor) and dim is not None:
            _no_batched_scalar(x.dim() == 1)  # a trainable scalar (0-d), batched: (size,)
            x = x.movedim(dim, 0)
        elif isinstance(x, torch.Tensor) and x.dim():
            x = x.unsqueeze(0)
        moved.append(x)
    O, *kept = function.apply(*moved)
    kept = [x.reshape(info.batch_size, -1, *x.shape[1:]) for x in kept]  # the statistics: (batch·heads, …) flat
    return (O, *kept), (0,) * (1 + len(kept))


def _no_vmapped_draws(seed):
    """A RuntimeError where torch.func.vmap (a vmapped call, jacrev, per-sample gradients) meets a core that drew its
    dropout mask (seed, None where it drew none): the kernels key their draws by the flat batch·head, which vmap's axis
    merged into it would shift, so the backward would read another mask than the forward's."""
    if seed is not None:
        raise RuntimeError(
            f"{SPEC}: dropout while training under torch.func.vmap (jacrev, per-sample gradients) is not supported by "
            "the kernels; give the batch as a batch axis, or run in eval (training=False)"
        )


def _no_batched_scalar(batched):
    """A RuntimeError where vmap batches a trainable scalar (batched: the kernels take one value of each)."""
    if batched:
        raise RuntimeError(f"{SPEC}: a trainable scalar batched by torch.func.vmap is not supported by the kernels")


def _merged(x, dim, size):
    """An op argument with vmap's axis (dim; None: none, the argument expanded) merged into its first axis, the
    batch·head axis the kernels step through; contiguous where they read it so."""
    if x is None or (dim is None and x.numel() == 0):
        return x
    x = x.expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
    return x.reshape(size * x.shape[1], *x.shape[2:]).contiguous()


def _split(results, size):
    """An op's results (their first axis batch·head, flat) with vmap's axis split off first; an empty one as it is."""
    dims = [0 if x.numel() else None for x in results]
    return [x if dim is None else x.reshape(size, -1, *x.shape[1:]) for x, dim in zip(results, dims)], dims


def _jvp_operands(saved, tangents):
    """The JVP kernel's operands: the saved inputs and the tangents as plain tensors, and vmap's level (None: none).
    Under vmap (jacfwd; one level) its axis is one more leading batch axis: first where a tensor is batched, else a
    size-1 axis (Q, K, V expanded to the batch: their tangents are)."""
    saved, moving = [_to_batch(x) for x in saved], [_to_batch(x) for x in tangents]
    batched = [x for x in (*saved, *moving) if _batched(x)]
    if not batched:
        return [_plain(x) for x in saved], [_plain(x) for x in moving], None
    if len({torch._C._functorch.maybe_get_level(x) for x in batched}) > 1 or any(
        torch._C._functorch.is_functorch_wrapped_tensor(_physical(x)) for x in batched
    ):
        raise RuntimeError(f"{SPEC}: the JVP kernel runs under one torch.func.vmap (jacfwd), not nested ones")
    size, level = _physical(batched[0]).shape[0], torch._C._functorch.maybe_get_level(batched[0])

    def leading(x, expand):
        if x is None:
            return None
        if _batched(x):
            _no_batched_scalar(x.dim() == 0)  # a trainable scalar's value or tangent
            return _physical(x)
        x = _plain(x)
        return x if x.dim() == 0 else x.expand(size, *x.shape) if expand else x.unsqueeze(0)

    return [leading(x, i < 3) for i, x in enumerate(saved)], [leading(x, False) for x in moving], level


def _rebatched(x, level):
    """x (vmap's axis first) as a tensor batched at level; None: x as it is."""
    return x if level is None else torch._C._functorch._add_batch_dim(x, 0, level)


def _plain(x):
    """x without torch.func's wrappers (a jvp or grad level: the kernels read its storage); None stays None."""
    while x is not None and torch._C._functorch.is_functorch_wrapped_tensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    return x


def _core(kernels, Q, K, V, *arguments):
    """O of a core (kernels: its _CORE) by the forward kernel (its backward by the backward kernels, its tangent by
    the JVP kernel)."""
    if torch.compiler.is_compiling():
        return kernels[1].apply(*_autocast(Q, K, V), *arguments)[0]
    if torch._C._are_functorch_transforms_active():  # torch.func: its custom_function_call
        return kernels[0].apply(*_autocast(Q, K, V), *arguments)[0]
    return _applied(kernels[0], *_autocast(Q, K, V), *arguments)[0]


def _applied(function, *arguments):
    """function.apply(*arguments) outside torch.func's transforms and torch.compile, without Function.apply's Python
    (binding the arguments to forward's signature, a pass over them): autograd's own apply, each tensor unwrapped
    where a transform that has ended left it wrapped, as Function.apply does."""
    dead = torch._C._functorch.unwrap_if_dead
    arguments = [dead(x) if isinstance(x, torch.Tensor) else x for x in arguments]
    return super(torch.autograd.Function, function).apply(*arguments)


def _autocast(Q, K, V):
    """Q, K, V as the kernels take them: under torch.autocast on their device each float32 one cast to autocast's
    dtype, as autocast casts a product's operands (autograd carries the gradients back through the cast; the n × m
    tiles and the statistics stay float32 in the kernels); else as given."""
    device = Q.device.type
    if device == "meta" or not torch.is_autocast_enabled(device):
        return Q, K, V
    low = torch.get_autocast_dtype(device)
    return tuple(x.to(low) if x is not None and x.dtype == torch.float32 else x for x in (Q, K, V))


def _core_dual(kernels, Q, K, V, causal, deterministic, symbols, *tensors):
    """O as a dual tensor (O, Ȯ) of forward-mode autograd from the dual Q, K, V and tensors: one JVP kernel launch
    (deterministic, the backward's mode, unread: no backward)."""
    pairs = [(None, None) if x is None else forward_ad.unpack_dual(x) for x in _autocast(Q, K, V)]  # V None: a map
    (Q, Q_t), (K, K_t), (V, V_t) = pairs
    primals = [None if x is None else forward_ad.unpack_dual(x) for x in tensors]
    tensors, tangents = [None if x is None else x[0] for x in primals], [None if x is None else x[1] for x in primals]
    O, O_t = kernels[2](Q, K, V, (Q_t, K_t, V_t), causal, symbols, tensors, tangents)
    return forward_ad.make_dual(O, O_t)
