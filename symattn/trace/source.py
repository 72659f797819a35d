"""``from_torch``: a PyTorch function, or an nn.Module's forward, traced into a symattn Spec.

Naming (CONTRACT.md, "From PyTorch code"): function arguments are inputs by their parameter names; a
module's parameters follow, by their state_dict names with "." → "_" (q_proj.weight → q_proj_weight,
in torch's layout; a bias (d,) is the spec's 1 × d row, which generated forward takes 1-D as it is); a 0-d
tensor is a trainable scalar; bool (and integer) tensor arguments, buffers and tensors made inside are
constants. A bool argument used as it is as a mask (``masked_fill(mask, -inf)``, ``torch.where``, a bool
``attn_mask``) is the constant named by its parameter, first among the constants in the arguments' order,
its form (Spec.bool_forms) telling generated forward how to read the bool; the tensors of a tuple argument
((cos, sin) tables) are constants; an input read in blocks (a fused projection split along its features) is
its blocks, each an input of its own (``forms.blocks``); intermediates take the names of the user's local
variables; dimensions are n (the first input's rows), m (another input's rows), d_head (a head's width) and
d_<input> (the other axes, by the first input that has them).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.dims import dim
from symattn.specs import Spec

if TYPE_CHECKING:  # torch is imported when a trace runs, not with symattn
    from symattn.trace.constants import Program
    from symattn.trace.tracer import Constant, Trace


class MisreadMask(SymattnError):
    """A float argument read as an additive mask is used otherwise too (it would lose its gradient)."""


@dataclass
class Traced:
    """A trace's spec and what the drop-in needs to call the generated code the way the original is called."""

    spec: Spec
    program: Program
    constants: list[Constant]
    arguments: tuple[str, ...]  # the forward's tensor arguments that are inputs, in order
    parameters: tuple[str, ...]  # the module's parameters (state_dict names), in the spec's order
    shapes: tuple  # the examples' shapes (a new shape rebuilds the constants by a new trace)
    masks: tuple[str, ...] = ()  # the float arguments read as additive masks (constants: no gradient)
    upcast: tuple[str, ...] = ()  # file:line of each softmax the code computes in float32 (softmax(…, dtype=…))
    # the inputs read in blocks (a split fused projection), by position in arguments + parameters: each block's torch
    # axis and range, in the order the spec's inputs hold them (``forms.blocks``; ``spec_tensors`` makes them)
    views: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    # (the 3-D float arguments, the output) in the (n, B, c) layout: the drop-in hands the generated code the
    # arguments' transpose(0, 1) and transposes its output back (torch's batch_first=False attention)
    sequence_first: tuple[bool, bool] = (False, False)
    mask: str | None = None  # the spec's additive mask constant, by name (``split_constants``): the drop-in batches it
    # the parameters read per head as tables, by position in arguments + parameters: (H, a, b), each head's first a
    # rows and b columns laid out a × (H·b) (``forms.head_parameters.spec_layout``)
    layouts: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    heads_first: int | None = None  # H: the float arguments (…, H, n, d) are split_heads(X, H) of X (…, n, H·d)
    split_output: bool = False  # the output is per head (…, H, n, d_v): the drop-in splits generated code's back


def block_sources(traced: Traced) -> dict[str, tuple[str, int, int, int]]:
    """The spec's inputs that are blocks, by name: (the input they are a block of, its torch axis, start, stop)."""
    parents = [_own_name(a) for a in traced.arguments] + [_own_name(p.replace(".", "_")) for p in traced.parameters]
    names = iter(traced.spec.input_names)
    found: dict[str, tuple[str, int, int, int]] = {}
    for i, parent in enumerate(parents):
        if i not in traced.views:
            next(names)
            continue
        for axis, a, b in traced.views[i]:
            found[next(names)] = (parent, axis, a, b)
    return found


def bound_arguments(fn, args: tuple) -> dict:
    """The forward's parameters by name for these positional arguments, as the trace bound them: a ``*args``
    parameter holds the tuple of the rest (the constant program's references number the parameters)."""
    import torch

    if isinstance(fn, torch.nn.Module):  # (the class's forward: the module's own may be a drop-in's)
        return dict(list(inspect.signature(type(fn).forward).bind(fn, *args).arguments.items())[1:])
    return dict(inspect.signature(fn).bind(*args).arguments)


def spec_tensors(traced: Traced, tensors: list, offset: int = 0) -> list:
    """The spec's input tensors from the traced inputs' (the arguments', then the parameters', in order; the first
    given at position offset): one read in blocks as its blocks, views of it (``narrow``), so that autograd hands
    its gradient back whole; a 3-D argument of a sequence-first trace as its transpose(0, 1), (B, n, c))."""
    from symattn.trace.forms.head_parameters import spec_layout

    out: list = []
    for i, x in enumerate(tensors, offset):
        if traced.sequence_first[0] and i < len(traced.arguments) and x.ndim == 3:
            x = x.transpose(0, 1)
        if traced.heads_first and i < len(traced.arguments) and x.ndim > 2 and x.shape[-3] == traced.heads_first:
            x = x.transpose(-3, -2).flatten(-2)  # (…, H, n, d) → (…, n, H·d), the spec's X
        if i in traced.layouts:
            x = spec_layout(x, traced.layouts[i])
        elif i >= len(traced.arguments) and x.ndim > 2:  # a parameter (1, …, 1, r, c): its matrix; (unused) its first
            x = x.reshape(x.shape[-2:]) if x.shape[:-2].numel() == 1 else x[(0,) * (x.ndim - 2)]
        out.extend([x.narrow(axis, a, b - a) for axis, a, b in traced.views[i]] if i in traced.views else [x])
    return out


def from_torch(fn, *example_inputs, name: str | None = None) -> Spec:
    """The spec of a PyTorch function or nn.Module's forward, traced at the example inputs."""
    return trace(fn, example_inputs, name).spec


def trace(fn, examples: tuple, name: str | None = None) -> Traced:
    """Run fn on the examples under the tracer and build the spec (see the module docstring); again, with a float
    argument a constant, when the code adds that argument as it is to per-head values (or slices it): an additive
    mask (``tracer.MaskArgument``)."""
    from symattn.trace.forms.head_parameters import HeadsFirst
    from symattn.trace.tracer import MaskArgument, SequenceFirst

    masks: set[str] = set()
    first, heads = False, None  # sequence first (tracer.SequenceFirst); heads first (head_parameters.HeadsFirst)
    refusals: list[SymattnError] = []  # a slice's: the error to give if the sliced argument is no mask after all
    tentative: set[str] = set()  # added to another such argument: masks unless their sum is used otherwise
    inputs: set[str] = set()  # tried as masks and used otherwise: inputs, never again masks
    while True:
        try:
            return _trace(fn, examples, name, masks, inputs, first, heads)
        except SequenceFirst:
            first = True
        except HeadsFirst as signal:
            heads = signal.heads
        except MaskArgument as signal:
            if signal.name in masks:  # (a constant is never traced: it cannot signal twice)
                raise SymattnError(f"from_torch: the mask argument {signal.name} is traced") from None
            masks.add(signal.name)
            tentative |= {signal.name} if signal.tentative else set()
            refusals += [signal.refusal] if signal.refusal is not None else []
        except MisreadMask:
            if tentative & masks:  # float arguments added together but no mask: inputs again, as they were
                masks -= tentative
                inputs |= tentative
                continue
            if refusals:  # a sliced argument that is no additive mask after all: the slice's refusal
                raise refusals[0] from None
            raise


def _trace(
    fn,
    examples: tuple,
    name: str | None,
    masks: set[str],
    inputs: set[str] = frozenset(),
    sequence_first: bool = False,
    heads: int | None = None,
) -> Traced:
    """One trace, the float arguments named in masks constants (additive masks), the others inputs (those named in
    inputs never tried as masks); sequence_first: the 3-D float arguments (n, B, c); heads: H, the float arguments
    (…, H, n, d) already split into heads (``forms.head_parameters.HeadsFirst``)."""
    import torch

    from symattn.trace.constants import Ref
    from symattn.trace.forms import shift
    from symattn.trace.forms.head_parameters import merged, split_arguments
    from symattn.trace.state import state_kept
    from symattn.trace.table import OPS, PER_TOKEN
    from symattn.trace.tracer import Mode, NameTaker, Trace

    module = fn if isinstance(fn, torch.nn.Module) else None
    forward = module.forward if module is not None else fn
    if not callable(forward):
        raise SymattnError(f"from_torch takes a function or an nn.Module, got {type(fn).__name__}")
    try:
        bound = inspect.signature(forward).bind(*examples)
    except TypeError as err:
        raise SymattnError(f"from_torch: the examples do not fit {_qualname(fn)}: {err}") from None
    t = Trace(ops=OPS, follow=shift.follow, per_token=PER_TOKEN, sequence_first=sequence_first, heads_first=heads)
    arguments, demoted = _arguments(t, bound.arguments, masks, inputs)
    split_arguments(t, bound.arguments, arguments)
    params = list(module.named_parameters()) if module is not None else []
    for pname, p in params:
        t.add_input(_own_name(pname.replace(".", "_")), p)
    if module is not None:
        for bname, b in module.named_buffers():
            t.program.leaf(b, Ref("buffer", bname))
    # each call runs without gradients (Mode): the code's own no_grad is seen; the module's state is left as it was
    with state_kept(module), torch.enable_grad(), NameTaker(t), Mode(t):
        out = fn(*examples)
    if not isinstance(out, torch.Tensor):
        raise SymattnError(f"from_torch: {_qualname(fn)} returns a {type(out).__name__}; trace one returning a tensor")
    if not t.traced(out):
        raise SymattnError(f"from_torch: the output of {_qualname(fn)} does not depend on its float inputs")
    output = _output(fn, merged(t, t.values[id(out)]), sequence_first)
    used = _shared(t, params, output.expr)
    t.constants = [c for c in t.constants if c.symbol in used]  # (a slice's S merged into a rotation R: gone)
    first = t.inputs[0][0] if t.inputs else ""
    views = _blocked(t, output.expr)
    mask_positions = {i for i, pname in enumerate(bound.arguments) if pname in demoted}
    for c in t.constants:  # a float argument read as an additive mask is nothing else (it would lose its gradient)
        if c.form == "as_is" and not c.added and c.ref in t.program.sources:
            if t.program.arguments(c.ref) & mask_positions:
                raise MisreadMask(
                    f"from_torch: {_qualname(fn)} adds its float argument {', '.join(demoted)} to per-head scores "
                    "as an additive mask (or slices it) and uses it otherwise too: an additive mask is a constant"
                )
    _order_constants(t)
    rename = _dimension_names(t, {_own_name(p) for p in arguments}, first)
    own = [_own_name(p.replace(".", "_")) for p, _ in params]
    spec = _spec(t, output, rename, name or _snake(_qualname(fn)), fn, own, examples, views)
    for c in t.constants:
        c.symbol = c.symbol.xreplace(rename)
    shapes = tuple(tuple(e.shape) if isinstance(e, torch.Tensor) else None for e in examples)
    names = [n for n, _ in t.inputs]
    ranges = {names.index(n): tuple((b.axis, b.start, b.stop) for b in blocks) for n, blocks in views.items()}
    params_ = tuple(p for p, _ in params)
    traced = Traced(spec, t.program, t.constants, tuple(arguments), params_, shapes, tuple(demoted), tuple(t.upcast))
    traced.views, traced.layouts = ranges, {names.index(n): layout for n, layout in t.head_layouts.items()}
    traced.sequence_first, traced.heads_first = (sequence_first, output.pending == "seq_first"), heads
    traced.split_output = output.layout == ("merged_heads",)  # (head_parameters.merged)
    from symattn.codegen.schedule.build import split_constants  # (codegen loads only when a trace needs it)

    additive, _ = split_constants(spec)
    traced.mask = None if additive is None else str(additive.name)
    return traced


def _shared(t: Trace, params: list, output: Basic) -> set:
    """The symbols the output reads; a parameter among them that has leading axes refused: a parameter of the spec
    is one matrix shared by every sequence and head (its gradient summed over them)."""
    used = output.free_symbols if hasattr(output, "free_symbols") else set()
    symbols = dict(t.inputs)
    for pname, p in params:
        name = _own_name(pname.replace(".", "_"))
        if p.ndim > 2 and p.shape[:-2].numel() > 1 and name not in t.head_layouts and symbols.get(name) in used:
            raise SymattnError(
                f"from_torch: the parameter {pname} of shape {tuple(p.shape)} has leading axes: a parameter is one "
                "matrix shared by every sequence and head (one constant per sequence is a buffer)"
            )
    return used


def _order_constants(t: Trace) -> None:
    """The spec's order of the trace's constants, in place (see the comments)."""
    # the bool arguments' constants first, in the arguments' order (the generated forward takes them there), then
    # the constants made from buffers and inside the code, in the order the trace made them (spec and Traced alike);
    # of those added to the scores, one per sequence first (the additive mask is the first, which generated code
    # takes batched)
    order = {name: i for i, name in enumerate(t.masks.values())}
    t.constants.sort(key=lambda c: order.get(str(c.symbol.name), len(order)))
    slots = [k for k, c in enumerate(t.constants) if c.added]
    for k, c in zip(slots, sorted((t.constants[k] for k in slots), key=lambda c: not c.batched)):
        t.constants[k] = c


def _output(fn, output, first: bool = False):
    """The output's value, if it is a whole matrix per sequence (sequence first where the arguments are); else one
    line saying what it is."""
    from symattn.trace.forms import shift
    from symattn.trace.values import GUARDED

    if output.shift is not None:
        raise SymattnError(f"from_torch: the output of {_qualname(fn)} holds a row max; {shift.WHY}")
    if output.pending in GUARDED and not (first and output.pending == "seq_first"):
        raise SymattnError(f"from_torch: {_qualname(fn)} returns {GUARDED[output.pending]}")
    if output.pending not in (None, "seq_first") or output.heads is not None or output.is_scalar:
        raise SymattnError(
            f"from_torch: {_qualname(fn)} returns per-head (or 0-d) values; merge the heads back (transpose(1, 2), "
            "then view/reshape to (…, n, H·d))"
        )
    return output


def _blocked(t: Trace, output: Basic) -> dict[str, list]:
    """The inputs read in blocks, by name: their blocks in the order the spec's inputs hold them (rows, then columns,
    each by its start). An input read both whole and in blocks is refused (its blocks would not be all of it)."""
    views: dict[str, list] = {}
    for b in sorted(t.blocks, key=lambda b: (b.axis, b.start)):
        views.setdefault(b.parent, []).append(b)
    whole = {str(s.name) for s in output.free_symbols if getattr(s, "name", None) in views}
    if whole:
        raise SymattnError(f"from_torch: {', '.join(sorted(whole))} is read both whole and in blocks (a split)")
    return views


def _arguments(t: Trace, bound: dict, masks: set[str], inputs: set[str]) -> tuple[list[str], list[str]]:
    """The forward's tensor arguments entered into the trace: (the inputs', the additive masks' parameter names)."""
    import torch

    from symattn.trace.constants import Ref

    arguments: list[str] = []
    demoted: list[str] = []
    for i, (pname, value) in enumerate(bound.items()):
        if isinstance(value, (tuple, list)):  # (cos, sin) tables: constants, rebuilt from the call's own
            for j, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    t.program.leaf(item, Ref("item", (i, j)))
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_floating_point() and _own_name(pname) in masks:  # an additive mask: a constant, named by it
            t.program.leaf(value, Ref("arg", i))
            t.masks[id(value)] = _own_name(pname)
            t.demoted.add(i)
            demoted.append(pname)
        elif value.is_floating_point():
            # with batch axes, after the first, not asking for a gradient: perhaps an additive mask (a constant)
            if arguments and value.ndim > 2 and not value.requires_grad and _own_name(pname) not in inputs:
                t.floats[id(value)] = _own_name(pname)
            batch = value.shape[1:2] if t.sequence_first and value.ndim == 3 else value.shape[:-2]
            t.batch = t.batch if arguments else tuple(batch)
            t.add_input(_own_name(pname), value, argument=True)
            arguments.append(pname)
        else:
            t.program.leaf(value, Ref("arg", i))
            if value.dtype == torch.bool:  # a mask: the constant it is (Trace.mask_argument) takes its name
                t.masks[id(value)] = _own_name(pname)
    return arguments, demoted


def _spec(t: Trace, output, rename: dict, name: str, fn, params: list[str], examples: tuple, views: dict) -> Spec:
    import torch

    def expanded(pairs: list) -> list:
        """(name, symbol) pairs, an input read in blocks replaced by its blocks."""
        out: list = []
        for n, s in pairs:
            out.extend([(str(b.symbol.name), b.symbol) for b in views[n]] if n in views else [(n, s)])
        return out

    inputs = tuple(s.xreplace(rename) for _, s in expanded(t.inputs))
    out = output.expr.xreplace(rename)
    taken = (
        {str(s.name) for s in inputs} | {str(c.symbol.name) for c in t.constants} | {str(d) for d in rename.values()}
    )
    taken |= _reserved()
    named: list[tuple[str, Basic]] = []
    seen: set[Basic] = set()
    known = {*inputs, *(c.symbol.xreplace(rename) for c in t.constants), *rename.values()}
    for v in t.order:
        label = t.names.get(id(v))
        expr = v.expr.xreplace(rename) if label else None
        if label is None or not isinstance(expr, MatrixExpr) or isinstance(expr, MatrixSymbol) or expr in seen:
            continue
        if any(str(getattr(x, "name", "")) in views for x in expr.free_symbols):  # a fused value, before its split
            continue
        if not expr.free_symbols <= known:  # a slice merged into a rotation (its S is no constant of the spec)
            continue
        seen.add(expr)
        label = _unique(label, taken)
        taken.add(label)
        named.append((label, expr))
    tensors = [e for e in examples if isinstance(e, torch.Tensor) and e.is_floating_point()]
    batched = max((e.ndim for e in tensors), default=0)
    unbatched = [n for (n, _), e in zip(t.inputs, tensors) if e.ndim <= 2 and e.ndim < batched]
    unbatched = [n for n, _ in expanded([(n, None) for n in unbatched])]
    params = [n for n, _ in expanded([(n, None) for n in params])]
    forward = type(fn).forward if isinstance(fn, torch.nn.Module) else fn
    code = getattr(inspect.unwrap(forward), "__code__", None)
    source = Path(code.co_filename).name if code is not None else "?"
    summary = f"{_qualname(fn)} traced from {source}"
    masks = set(t.masks.values())  # the constants that are bool arguments, in the order ``trace`` put them
    try:
        return Spec(
            name,
            summary,
            inputs,
            out,
            tuple(named),
            constants=tuple(c.symbol.xreplace(rename) for c in t.constants),
            parameters=tuple(unbatched + params),
            bool_forms={
                str(c.symbol.name): c.form for c in t.constants if str(c.symbol.name) in masks and c.form != "as_is"
            },
        )
    except SymattnError as err:
        raise SymattnError(f"from_torch: the traced spec is refused: {err}") from None


def _dimension_names(t: Trace, arguments: set[str], first: str) -> dict:
    """t_0, t_1, … renamed: n, m, d_head, d_<input> (see the module docstring), each name used once; the
    rows of the forward's other tensor arguments are m (keys, values), a parameter's axes d_<parameter>."""
    used = {str(s.name) for _, s in t.inputs} | {str(c.symbol.name) for c in t.constants} | _reserved()
    used |= {str(b.symbol.name) for b in t.blocks}
    rename: dict = {}
    for symbol in sorted(t.dims.sizes, key=lambda s: int(str(s.name).split("_")[1])):
        kind, owner = t.dims.hints[symbol]
        if kind == "rows" and owner == first:
            base = "n"
        elif kind == "rows" and owner in arguments:
            base = "m"
        elif kind == "head":
            base = "d_head"
        else:
            base = "d_" + re.sub(r"_(weight|bias)$", "", owner)
        label = _unique(base, used)
        used.add(label)
        rename[symbol] = dim(label)
    return rename


def _unique(label: str, taken: set[str]) -> str:
    """label, or label_2, label_3, … : the first not taken."""
    if label not in taken:
        return label
    return next(f"{label}_{i}" for i in range(2, 10**6) if f"{label}_{i}" not in taken)


def _own_name(name: str) -> str:
    """A name the spec can take: G or a name of the generated code (inputs, ctx) gets a trailing underscore."""
    return name + "_" if name in _reserved() else name


def _reserved() -> set[str]:
    """The names a spec may not give: G, and the generated code's own (ctx, grad_out, its helpers)."""
    from symattn.codegen.generate import reserved_names  # (codegen loads only when a trace needs it)
    from symattn.specs.validate import RESERVED

    return set(RESERVED) | set(reserved_names())


def _qualname(fn) -> str:
    import torch

    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", getattr(fn, "__name__", type(fn).__name__))


def _snake(name: str) -> str:
    """A spec name from a function's or class's name: MultiHeadAttention → multi_head_attention."""
    name = re.sub(r"[^0-9A-Za-z_]", "_", name.rsplit(".", 1)[-1])
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return name if name.isidentifier() else f"traced_{name}"
