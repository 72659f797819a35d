"""Dropping the generated closed form back into the user's nn.Module: ``drop_in(module, *examples)``.

The module keeps its parameters, buffers, state_dict and optimizer; only its ``forward`` is replaced by a
call of the generated torch code (``symattn.generated``'s interface: the inputs, then the constants, in the
spec's order, the additive mask among them in its position), whose backward is the closed form. Parameters
are passed as they are: generated forward takes a 1-D bias in torch's layout (viewing it as the spec's 1 × d
row, so autograd hands its gradient back (d,)). The constants (masks) are rebuilt at each call by the trace's
constant program from the call's bool arguments and the module's buffers; a call at new shapes, or whose
arguments and buffers give another value where the code read one off a constant (``prefix.tolist()``: the
program's guards), traces the original forward once more (without gradients), kept per shape. A trace whose spec
is not the first's (a number read as a size's expression at one size, 0.5 = 1/√n at n = 4, and as itself at
another) gets generated code of its own: every call computes the spec of its own trace.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import linecache
import types

from symattn.codegen.generate import render
from symattn.errors import SymattnError
from symattn.lang.functions import TORCH, TRITON
from symattn.lang.positions import sequence_tables
from symattn.specs.spec import Spec
from symattn.trace.constants import sizes_of, spec_layout, spec_value
from symattn.trace.source import Traced, bound_arguments, spec_tensors, trace


def generated_module(traced_spec, *, second_order: bool = True) -> types.ModuleType:
    """The spec's generated torch module, rendered and imported in memory (``symattn generate --spec-file``
    writes the same code to a file); on CUDA it hands its calls to the spec's Triton module, rendered in memory at
    its first call there (``kernels_module``)."""
    module = in_memory(render(traced_spec, TORCH, second_order=second_order), f"{traced_spec.name}_torch")
    module._KERNELS_MAKER.append(functools.partial(kernels_module, traced_spec, second_order=second_order))
    return module


def kernels_module(traced_spec, *, second_order: bool = True) -> types.ModuleType | None:
    """The spec's generated Triton module, rendered and imported in memory; None where its kernels do not cover the
    spec (no n × m core: the torch module's ops run) or triton does not import."""
    try:
        source = render(traced_spec, TRITON, second_order=second_order)
    except SymattnError:
        return None
    try:
        return in_memory(source, f"{traced_spec.name}_triton")
    except ImportError:
        return None


def in_memory(source: str, name: str) -> types.ModuleType:
    """The module of source, executed under a file name of its own that ``linecache`` holds (triton.jit reads its
    kernels' source by ``inspect``; tracebacks show the generated lines)."""
    filename = f"<symattn: {name} {hashlib.sha256(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


class ClosedForm:
    """The traced function or module's forward computed by its generated code: called with the original
    forward's arguments, it returns the same output, and its backward is the generated closed form."""

    def __init__(self, fn, examples: tuple, *, second_order: bool = True, generated=None) -> None:
        self.fn = fn
        self.second_order = second_order
        with _own_draws():
            first = trace(fn, examples)
        self.spec = first.spec
        self.traced: dict[tuple, list[Traced]] = {(_mode(fn), *first.shapes): [first]}
        self.generated = generated or generated_module(self.spec, second_order=second_order)
        self.codes: list[tuple[Spec, types.ModuleType]] = [(self.spec, self.generated)]
        self.examples = tuple(_detached(a) for a in examples)
        self.autocast_dtypes: dict[tuple, object] = {}  # (device, autocast's dtype, arguments' dtypes) → output's

    def _traced_at(self, args: tuple) -> Traced:
        """The trace of these arguments: one at their shapes whose guards they pass, else a new one."""
        import torch

        # keyed by the module's mode too: a train() trace reads F.dropout as dropout, an eval() one as the identity
        shapes = (_mode(self.fn), *(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args))
        held = self.traced.setdefault(shapes, [])
        buffers = _buffers(self.fn)
        values = tuple(bound_arguments(self.fn, args).values())
        for traced in held:
            if traced.program.holds(values, buffers):
                return traced
        try:
            with _original_forward(self.fn), _own_draws():
                traced = trace(self.fn, tuple(_detached(a) for a in args))
        except RuntimeError as err:  # torch's, from the original code (a per-sequence buffer of another batch size)
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise SymattnError(f"drop_in: the original forward fails at these arguments {shapes[1:]}: {why}") from None
        held.insert(0, traced)
        del held[GUARDED_TRACES:]
        return traced

    def code(self, spec: Spec) -> types.ModuleType:
        """The generated module of a trace's spec: the first's when the spec is the same function."""
        for held, module in self.codes:
            if same_function(held, spec):
                return module
        module = generated_module(spec, second_order=self.second_order)
        self.codes.append((spec, module))
        return module

    def inputs(self, args: tuple, traced: Traced | None = None) -> list:
        """The spec's inputs for these arguments: the tensor arguments, then the module's parameters, each in its
        own layout (generated forward takes a bias (d,) as it is)."""
        import torch

        traced = traced or self._traced_at(args)
        bound = bound_arguments(self.fn, args)
        for name in traced.masks:  # the generated code gives the additive mask no gradient: never silently
            if torch.is_grad_enabled() and getattr(bound.get(name), "requires_grad", False):
                raise SymattnError(
                    f"drop_in: {name} requires grad, but is read as the additive mask M, a constant (no gradient)"
                )
        params = [self.fn.get_parameter(p) for p in traced.parameters]
        return spec_tensors(traced, [bound[n] for n in traced.arguments] + params)

    def constants(self, args: tuple, inputs: list, traced: Traced | None = None) -> dict:
        """The spec's constants for these arguments, by name, at the spec's matrix shapes."""
        traced = traced or self._traced_at(args)
        sizes = sizes_of(traced.spec, inputs)
        values = tuple(bound_arguments(self.fn, args).values())
        values = traced.program.replay(values, _buffers(self.fn), [c.ref for c in traced.constants])
        dtype = inputs[0].dtype
        return {str(c.symbol.name): spec_value(c, raw, dtype, sizes) for c, raw in zip(traced.constants, values)}

    def __call__(self, *args):
        import torch

        traced = self._traced_at(args)
        inputs = self.inputs(args, traced)
        constants = self.constants(args, inputs, traced)
        batch = tuple(inputs[0].shape[:-2])
        per_sequence = {str(x.name) for x in sequence_tables(traced.spec.output)}
        given = []  # the constants in the spec's order, after the inputs: the additive mask and those read at
        for c in traced.spec.constants:  # positions (one per sequence) with the inputs' batch axes, the rest without
            name = str(c.name)
            if name == traced.mask:
                value = constants[name]
                batched = value.ndim > 2 or batch
                given.append(torch.broadcast_to(value, (*batch, *value.shape[-2:])) if batched else value)
            elif name in per_sequence:
                given.append(_batched(constants[name], name, batch))
            else:
                given.append(_unbatched(constants[name], name))
        out = self.code(traced.spec).forward(*inputs, *given)
        out = out.transpose(0, 1) if traced.sequence_first[1] else out
        out = out.unflatten(-1, (traced.heads_first, -1)).transpose(-3, -2) if traced.split_output else out
        dtype = self._autocast_dtype(args, out.device.type)
        return out if dtype is None else out.to(dtype)

    def _autocast_dtype(self, args: tuple, device: str):
        """The dtype the original forward returns under the torch.autocast enabled on the device, or None out of it.
        The generated code runs in autocast's dtype from its arguments on; the original promotes where its code
        adds a float32 tensor to a product's (a residual stream x + f(x) stays float32, where torch's layer norm
        may keep or cast). Read off one run of the original at the trace's example, its arguments in the call's
        dtypes and device, without gradients, once per device, autocast dtype and arguments' dtypes."""
        import torch

        if device == "meta" or not torch.is_autocast_enabled(device):
            return None
        dtypes = tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args)
        key = (device, torch.get_autocast_dtype(device), dtypes)
        if key not in self.autocast_dtypes:
            example = [_like(e, a) for e, a in zip(self.examples, args)]
            with torch.no_grad(), _original_forward(self.fn), _own_draws():
                self.autocast_dtypes[key] = self.fn(*example).dtype
        return self.autocast_dtypes[key]


GUARDED_TRACES = 8  # the traces kept per shape for arguments whose guards differ (the latest first)


def same_function(a: Spec, b: Spec) -> bool:
    """Whether two traces' specs are the same function (the example's sizes aside)."""
    fields = ("inputs", "output", "options", "constants", "parameters", "bool_forms")  # intermediates: names
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _mode(fn) -> bool | None:
    """A module's training flag (None for a function): which trace of it a call reads."""
    return getattr(fn, "training", None)


@contextlib.contextmanager
def _own_draws():
    """Torch's generators as they were before the block: a trace's dropout draws nothing a run's seed reproduces."""
    import torch

    with torch.random.fork_rng():
        yield


def _buffers(fn) -> dict:
    return dict(fn.named_buffers()) if hasattr(fn, "named_buffers") else {}


def _batched(value, name: str, batch: tuple):
    """A constant one per sequence at the inputs' batch axes, broadcast as torch broadcasts it against them."""
    import torch

    while value.ndim > 2 + len(batch) and value.shape[0] == 1:
        value = value.squeeze(0)
    try:
        return torch.broadcast_to(value, (*batch, *value.shape[-2:]))
    except RuntimeError:
        raise SymattnError(
            f"drop_in: the constant {name} of shape {tuple(value.shape)} does not broadcast to the inputs' batch axes "
            f"{batch}"
        ) from None


def _unbatched(value, name: str):
    while value.ndim > 2 and value.shape[0] == 1:
        value = value.squeeze(0)
    if value.ndim > 2:
        raise SymattnError(f"drop_in: the constant {name} varies along batch axes {tuple(value.shape[:-2])}")
    return value


def _like(example, argument):
    """A tensor example on the argument's device, in its dtype where it is a float tensor."""
    if not hasattr(example, "to") or not hasattr(argument, "is_floating_point"):
        return example
    return example.to(argument.device, argument.dtype if argument.is_floating_point() else example.dtype)


def _detached(a):
    import torch

    return a.detach() if isinstance(a, torch.Tensor) else a


@contextlib.contextmanager
def _original_forward(module):
    """The module with its own forward while the block runs (a trace must not call the drop-in)."""
    replaced = getattr(module, "__dict__", {}).pop("forward", None)
    try:
        yield
    finally:
        if replaced is not None:
            module.forward = replaced


def drop_in(module, *example_inputs, second_order: bool = True, generated=None) -> ClosedForm:
    """Replace module.forward by the generated closed form of its traced spec; return the replacement.

    ``generated``: a module written by ``symattn generate --spec-file`` (default: rendered in memory);
    ``second_order=False`` leaves the second closed form out (renders faster; double backward then raises).
    ``undo(module)`` puts the
    original forward back.
    """
    replacement = ClosedForm(module, example_inputs, second_order=second_order, generated=generated)
    module.forward = replacement
    return replacement


def state_dict_for(traced: Traced, state_dict: dict) -> dict:
    """A traced module's state_dict as its generated nn.Module holds it: the parameters only (buffers are
    constants), keys with "." → "_" (q_proj.weight → q_proj_weight), a 1-D tensor as the 1 × d row; a parameter
    read in blocks (a fused projection) as its blocks, by the spec's names (c_attn_weight_0, …)."""
    values = spec_tensors(traced, [state_dict[p] for p in traced.parameters], len(traced.arguments))
    names = traced.spec.input_names[len(traced.spec.input_names) - len(values) :]
    return {name: spec_layout(value) for name, value in zip(names, values)}


def generated_instance(module, *example_inputs, second_order: bool = True):
    """The generated nn.Module of module's traced spec, at module's sizes, dtype and device, holding a copy of
    its parameters (``state_dict_for``). Its forward takes the spec's inputs and constants in the spec's order
    (a bool mask argument in its position) and the mask keywords (attn_mask, causal, …), not the original's
    other mask arguments; ``drop_in`` keeps the original's call instead."""
    import inspect

    import torch

    traced = trace(module, example_inputs)
    generated = generated_module(traced.spec, second_order=second_order)
    cls = next(
        v
        for v in vars(generated).values()
        if isinstance(v, type) and issubclass(v, torch.nn.Module) and v.__module__ == generated.__name__
    )
    params = [module.get_parameter(p) for p in traced.parameters]
    bound = bound_arguments(module, example_inputs)
    tensors = spec_tensors(traced, [bound[n] for n in traced.arguments] + params)
    sizes = {str(d): v for d, v in sizes_of(traced.spec, [spec_layout(t) for t in tensors]).items()}
    wanted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "device", "dtype")]
    instance = cls(**{n: sizes[n] for n in wanted}, device=params[0].device, dtype=params[0].dtype)
    instance.load_state_dict(state_dict_for(traced, module.state_dict()))
    return instance


def undo(module) -> None:
    """Give the module its own forward back."""
    module.__dict__.pop("forward", None)
