"""Running the user's PyTorch code once on its examples, each torch call seen through ``__torch_function__``.

A ``TorchFunctionMode`` sees every call at the level the user wrote it (``F.linear``, ``Tensor.transpose``,
``F.layer_norm``), on real tensors, so Python around the calls (``math.sqrt(q.size(-1))``, shape checks,
branches on options) runs as usual. A call on a traced tensor is translated by its rule in ``table.OPS``;
a call on constants only is kept in the constant program (``constants.Program``) that rebuilds masks; any
other call is refused with symattn's one-line error naming the operation and the user's file:line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import sympy as sp
import torch
from sympy import Basic, MatrixSymbol
from torch.overrides import TorchFunctionMode

from symattn.errors import SymattnError
from symattn.lang.lazy import scalar
from symattn.trace import frames
from symattn.trace.constants import Program
from symattn.trace.forms import positions
from symattn.trace.forms.torch_attention import DECOMPOSED, SEQUENCE_FIRST, UNREAD_LAYOUT
from symattn.trace.values import GUARDED, KEEPS, Dims, Refused, Value, literal, number, stopped


def op_name(func: object) -> str:
    """The name a torch call is known by in the table: ``matmul``, ``add_``, ``mT`` (a property), ``linear``."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # Tensor.mT, Tensor.T, Tensor.shape
        return owner.__name__
    return getattr(func, "__name__", type(func).__name__)


def tensors_in(obj: object) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments (nested in tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


@dataclass
class Constant:
    """A spec constant: its symbol, and how it is made from the constant program's tensor ``ref`` (an id).

    ``form``: "additive" (−∞ where the bool is True, else 0: the additive mask M), "additive_false" (−∞ where
    False), "keep" (1 where the bool is False, else 0), "keep_false" (1 where True), "as_is" (a float tensor).
    """

    symbol: MatrixSymbol
    ref: int
    form: str
    added: bool = False  # a float constant added to values of its shape (an additive mask M), not a fixed one
    heads: int | None = None  # H for a per-head constant: the spec's n × (H·m), split into the H blocks (…, H, n, m)
    batched: bool = False  # its leading axis varies (a mask per sequence): the additive mask, before a fixed one
    at_heads: bool = False  # it met per-head values: its axis −3 is the heads' (size 1), the axes before it the batch


@dataclass
class Trace:
    """The state of one trace: the values of traced tensors, the dimensions, the constants, the names."""

    dims: Dims = field(init=False)
    values: dict[int, Value] = field(default_factory=dict)  # by id() of the tensor
    order: list[Value] = field(default_factory=list)  # every value made, in order
    names: dict[int, str] = field(default_factory=dict)  # by id() of the Value
    inputs: list[tuple[str, Basic]] = field(default_factory=list)
    constants: list[Constant] = field(default_factory=list)
    program: Program = field(default_factory=Program)
    ops: dict = field(default_factory=dict)  # the op table (table.OPS): torch operation name → rule
    # the rule of a call on values that hold a row max (forms.shift.follow): (trace, name, rule, args, kwargs, result)
    follow: Callable | None = None
    per_token: dict = field(default_factory=dict)  # table.PER_TOKEN: the operations read sequence first, too
    sequence_first: bool = False  # the 3-D float arguments are (n, B, c) (torch's batch_first=False attention)
    heads_first: int | None = None  # H: the float arguments (…, H, n, d) are already split into H heads
    kept: list[object] = field(default_factory=list)  # every tensor seen, alive: ids stay unique
    known: dict[int, Value] = field(default_factory=dict)  # the inputs' and constants' own values (alive), by id
    # the forward's bool tensor arguments (by id): their names, in argument order, and the first input's batch axes;
    # float arguments read as additive masks (``MaskArgument``) are among them
    masks: dict[int, str] = field(default_factory=dict)
    batch: tuple[int, ...] = ()
    # the forward's float tensor arguments with batch axes after the first (by id): their names; one added as it is
    # to per-head values, or sliced, is an additive mask (``MaskArgument``)
    floats: dict[int, str] = field(default_factory=dict)
    demoted: set[int] = field(default_factory=set)  # the positions of the float arguments read as additive masks
    blocks: list = field(default_factory=list)  # the inputs' blocks read by a split (``forms.blocks.Block``)
    widths: dict[tuple, Basic] = field(default_factory=dict)  # the blocks' lengths, by (start, stop, heads)
    selections: dict[str, torch.Tensor] = field(default_factory=dict)  # a slice's constant S by name: its values
    upcast: list[str] = field(default_factory=list)  # file:line of each softmax computed in float32 (dtype=…)
    read: dict[int, Basic] = field(default_factory=dict)  # the matrix lengths the code read (size, shape), by value
    dtype: torch.dtype = torch.float32  # the first floating input's: the precision the traced code runs at
    drawn: set = field(default_factory=set)  # the dropout masks made (``layout.drawn``): one per draw
    head_layouts: dict = field(default_factory=dict)  # parameters read per head, by name: (H, a, b) (forms.head_…)

    def __post_init__(self) -> None:
        self.dims = Dims(self._substitute)

    def _substitute(self, mapping: dict) -> None:
        for v in self.order:
            v.substitute(mapping)
        self.inputs = [(name, s.xreplace(mapping)) for name, s in self.inputs]
        for c in self.constants:
            c.symbol = c.symbol.xreplace(mapping)
        for b in self.blocks:
            b.symbol = b.symbol.xreplace(mapping)
        self.widths = {k: w.xreplace(mapping) for k, w in self.widths.items()}
        self.read = {k: sp.sympify(w).xreplace(mapping) for k, w in self.read.items()}

    # inputs

    def add_input(self, name: str, tensor: torch.Tensor, argument: bool = False) -> None:
        """A differentiated input: a 0-d tensor is a trainable scalar, a 1-D one a 1 × d row, else a matrix (a 3-D
        argument of a sequence-first trace (n, B, c): each sequence's matrix is x[:, b, :])."""
        if not self.inputs and tensor.is_floating_point():
            self.dtype = tensor.dtype
        first = argument and self.sequence_first and tensor.ndim == 3
        if tensor.ndim == 0:
            symbol = scalar(name)
        else:
            shape = (1, *tensor.shape) if tensor.ndim == 1 else tuple(tensor.shape[::2] if first else tensor.shape[-2:])
            rows = self.dims.fresh(shape[0], ("rows", name))
            symbol = MatrixSymbol(name, rows, self.dims.fresh(shape[1], ("cols", name)))
        self.inputs.append((name, symbol))
        self.bind(tensor, Value(symbol, tuple(tensor.shape), pending="seq_first" if first else None))
        value = self.values[id(tensor)]
        self.known[id(value)] = value

    def bind(self, tensor: torch.Tensor, value: Value) -> Value:
        self.kept.append(tensor)
        self.values[id(tensor)] = value
        self.order.append(value)
        return value

    def traced(self, obj: object) -> bool:
        return isinstance(obj, torch.Tensor) and id(obj) in self.values

    # operands

    def value(self, obj: object, prefer: tuple = ()) -> Value:
        """The value of an operand: a traced tensor's, a Python number's, or a constant tensor's (0-d: its number)."""
        if isinstance(obj, torch.Tensor):
            if id(obj) in self.values:
                return self.values[id(obj)]
            if obj.dtype == torch.bool:
                raise Refused("a bool tensor is a mask: it enters through masked_fill(mask, -inf) or torch.where")
            if obj.ndim == 0:
                return Value(number(obj.item(), self.dims, prefer, self.read), ())
            return self.constant(obj, "as_is")
        return Value(number(obj, self.dims, prefer, self.read), ())

    def note_sizes(self, tensor: torch.Tensor, args: tuple, kwargs: dict, result: object) -> None:
        """A size the code read off a traced tensor (``size``, ``shape``): of its last two axes, a length of the
        matrix (not a batch or head axis, nor 1), kept by its example value (``read``) so that a number equal to it
        in arithmetic is that length (x / k.size(-2): 1/m, right at every length)."""
        value = self.values[id(tensor)]
        if value.pending is not None or value.is_scalar:
            return
        ndim = len(value.shape)
        lengths = {ndim - 2: value.rows, ndim - 1: value.cols} if ndim > 1 else {0: value.cols}
        if isinstance(result, int):  # size(dim)
            axis = args[1] if len(args) > 1 else kwargs.get("dim")
            found = {} if axis is None else {axis % ndim: result}
        else:
            found = dict(enumerate(result))
        for axis, size in found.items():
            length = lengths.get(axis)
            if size > 1 and length is not None and not sp.sympify(length).is_number:
                self.read[int(size)] = length

    def constant(self, tensor: torch.Tensor, form: str, like: Value | None = None) -> Value:
        """A spec constant made from a constant tensor: of like's matrix shape (a mask), else of its own."""
        if like is not None:
            rows, cols = like.rows, like.cols
        else:
            shape = (1, *tensor.shape) if tensor.ndim == 1 else tuple(tensor.shape[-2:])
            rows, cols = (self.dims.fresh(size, ("rows" if i == 0 else "cols", "C")) for i, size in enumerate(shape))
        argument = self.mask_argument(tensor, form, like)
        if isinstance(argument, Constant):  # the same bool argument, the same way again: the same constant
            self.kept.append(tensor)
            return Value(argument.symbol, like.shape)
        if argument is None:  # made of positions (torch.arange): computed where used, no n × m argument
            found = positions.read(self.program, tensor, form, (rows, cols), self, self.dtype)
            if found is not None:
                value = Value(found, tuple(tensor.shape) if like is None else like.shape)
                if form == "as_is" and like is None:
                    self.bind(tensor, value)
                else:
                    self.kept.append(tensor)
                return value
        additive = form.startswith("additive") or (form == "as_is" and like is not None)  # a float M added to like
        label = "M" if additive else "K" if form.startswith("keep") else "C"
        taken = {c.symbol.name for c in self.constants} | set(self.masks.values())
        name = argument or next(n for n in (label, *(f"{label}_{i}" for i in range(2, 99))) if n not in taken)
        symbol = MatrixSymbol(name, rows, cols)
        self.constants.append(
            Constant(
                symbol,
                self.program.ref(tensor),
                form,
                added=form == "as_is" and like is not None,
                batched=tensor.ndim > 2 and tensor.shape[0] > 1,
                at_heads=like is not None and like.heads is not None,
            )
        )
        value = Value(symbol, tuple(tensor.shape) if like is None else like.shape)
        self.known[id(value)] = value
        if form == "as_is" and like is None:
            self.bind(tensor, value)
        else:
            self.kept.append(tensor)
        return value

    def mask_argument(self, tensor: torch.Tensor, form: str, like: Value | None) -> str | Constant | None:
        """A bool argument of the forward used as it is as a mask: the constant is the argument, named by its
        parameter (or, met again in the same form, the constant it already is). Only where the generated modules
        take the argument as it is: of the masked values' last two sizes, with no batch axes or (an additive mask,
        which generated forward takes batched) the first input's; otherwise (and for a tensor made from it:
        ``mask == 0``, ``mask[:, None, :]``) a constant M, K, … as before, which the generated modules take as
        its additive (or 0/1) matrix."""
        name = self.masks.get(id(tensor))
        if name is None or like is None or name in {n for n, _ in self.inputs}:
            return None
        if (form == "as_is") != tensor.is_floating_point():  # a float mask argument is added as it is, a bool read
            return None
        additive = form.startswith("additive") or form == "as_is"
        shape, batches = tuple(tensor.shape), ((), self.batch) if additive else ((),)
        if shape[-2:] != tuple(like.shape[-2:]) or shape[:-2] not in batches:
            return None
        held = next((c for c in self.constants if c.symbol.name == name), None)
        if held is None:
            return name
        same = held.form == form and held.symbol.shape == (like.rows, like.cols)
        return held if same else None

    def position_number(self, x: int | float, lengths: Iterable[int] | None = None) -> Basic:
        """A number in a formula of positions: an int equal to a length the code read as that length (where lengths
        are given, only one of them: the axes' of the tensor made, so that a bucket count equal to the model's
        width stays a number), a float as itself (a slope is no dimension's expression)."""
        if isinstance(x, int) and (lengths is None or x in lengths):
            return number(x, self.dims, read=self.read)
        return literal(x) if isinstance(x, float) else sp.Integer(x)

    def number(self, obj: object) -> Basic:
        """A number operand that is no dimension's expression (eps, a fill value)."""
        if isinstance(obj, torch.Tensor) and self.traced(obj):
            raise Refused("a traced tensor where a fixed number is expected")
        return literal(obj.item() if isinstance(obj, torch.Tensor) else obj)

    # names

    def take_names(self, variables: Iterable[tuple[str, object]]) -> None:
        """Name the values bound to these (name, object) local variables: the first name a value is seen under;
        not the inputs' or constants' own values, nor numbers, nor a view halfway into heads."""
        for name, obj in variables:
            if isinstance(obj, torch.Tensor) and id(obj) in self.values and name.isidentifier():
                v = self.values[id(obj)]
                fresh = id(v) not in self.names and id(v) not in self.known and not name.startswith("_")
                if fresh and v.pending is None and not v.is_scalar:
                    self.names[id(v)] = name


class SequenceFirst(Exception):  # a signal to trace again, not an error
    """torch's attention met a 3-D argument (or a value made of it on each token) in the (B, n, c) reading, where it
    reads (n, B, c): the code is sequence first (batch_first=False). Traced again with its 3-D float arguments
    (n, B, c) (``Trace.sequence_first``)."""


class MaskArgument(Exception):  # a signal to trace again, not an error
    """A float argument with batch axes is added as it is to per-head values (or sliced): an additive mask, as
    eager attention adds a float (B, 1, 1, m) or (B, 1, n, m) attention_mask to its scores. The trace starts
    again with the argument a constant (``source.trace``), so that what the code does with it is kept in the
    constant program and the sum is scores + M."""

    def __init__(self, name: str, why: str = "", tentative: bool = False) -> None:
        super().__init__(name)
        self.name, self.why, self.tentative = name, why, tentative  # tentative: added to another mask, not yet used
        self.refusal: SymattnError | None = None  # with why: the error if the argument is no additive mask after all


class Mode(TorchFunctionMode):
    """Every torch call of the traced code: run it, then translate it (see the module docstring)."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._C._set_grad_enabled:  # the code's torch.no_grad() entered or left: as it says
            return func(*args, **kwargs)
        # the trace runs with gradients on (source.trace), each call without: the code's own torch.no_grad() is seen
        no_grad = not torch.is_grad_enabled()
        decomposed = DECOMPOSED.get(func)
        if decomposed is not None and any(self.trace.traced(t) for t in (*tensors_in(args), *tensors_in(kwargs))):
            return self.decompose(func, decomposed, args, kwargs)
        with torch.no_grad():
            result = func(*args, **kwargs)
        record(self.trace, func, args, kwargs, result, no_grad)
        return result

    def decompose(self, func, decomposed, args: tuple, kwargs: dict):
        """torch's function as its computation in the reader's forms (``forms.torch_attention``), run under this
        mode; a piece of the result the computation leaves untraced (attention weights) is held unread."""
        for k in SEQUENCE_FIRST.get(func, ()):
            x = args[k] if k < len(args) else None
            if self.trace.traced(x) and x.dim() == 3 and self.trace.values[id(x)].pending != "seq_first":
                if not self.trace.sequence_first:
                    raise SequenceFirst()
                raise error(op_name(func), UNREAD_LAYOUT)
        try:
            with self:
                result = decomposed(*args, **kwargs)
        except Refused as err:
            raise error(op_name(func), str(err)) from None
        for piece in result:
            if isinstance(piece, torch.Tensor) and not self.trace.traced(piece):
                self.trace.bind(
                    piece, Value(MatrixSymbol("unread", *piece.shape[-2:]), tuple(piece.shape), pending="unread")
                )
        return result


def record(trace: Trace, func: object, args: tuple, kwargs: dict, result: object, no_grad: bool = False) -> None:
    """Translate one call: by its rule when it reads a traced tensor, into the constant program when not. A call on
    traced tensors under the code's torch.no_grad() makes a stop-gradient, sg(A); a random call is refused
    (a closed form would freeze or redraw the draw: a wrong result without a word)."""
    name = op_name(func)
    if name in RANDOM:
        raise error(name, "it is random; a closed form of a random function is not the function")
    operands = [t for t in (*tensors_in(args), *tensors_in(kwargs)) if trace.traced(t)]
    if not operands:
        pieces = isinstance(result, (tuple, list)) and result and all(isinstance(x, torch.Tensor) for x in result)
        if isinstance(result, torch.Tensor) or pieces or (result is None and name == "__setitem__"):
            trace.program.record(func, args, kwargs, result, name)
        elif result is not None and name not in UNREAD and any(True for _ in tensors_in(args)):
            trace.program.guard(func, args, kwargs, result)
        return
    trace.take_names(frames.local_names())
    rule = trace.ops.get(name)
    several = isinstance(result, (tuple, list)) and any(True for _ in tensors_in(result))
    if not isinstance(result, torch.Tensor) and not several:
        if name in ("size", "shape") and isinstance(result, int | tuple):
            trace.note_sizes(operands[0], args, kwargs, result)
        return  # a size, a shape, a dtype
    tokens: list[Value] = []  # the operands sequence first, read as (B, n, c) by an operation on each token
    for state in {trace.values[id(x)].pending for x in operands} & GUARDED.keys():
        if state == "seq_first" and name in trace.per_token and name not in KEEPS[state]:
            tokens = sequence_first(trace, name, args, kwargs)
        elif name not in KEEPS.get(state, ()):
            raise error(name, GUARDED[state])
    if several and not getattr(rule, "several", False):
        if name in ORDER_STATISTICS:  # (a median: its place changes with the length)
            raise error(name, "an order statistic other than topk, sort and kthvalue over the last axis is not read")
        raise error(name, "it returns several tensors; read are the pieces of a fused projection's features")
    if rule is None:
        raise error(name, "this operation is not in symattn's language")
    shifted = any(trace.values[id(x)].shift is not None for x in operands)
    try:
        for v in tokens:
            v.pending = None
        value = trace.follow(trace, name, rule, args, kwargs, result) if shifted else rule(trace, args, kwargs, result)
        if tokens:
            value.pending = "seq_first"
    except Refused as err:
        raise error(name, str(err)) from None
    except MaskArgument as signal:
        signal.refusal = error(name, signal.why) if signal.why else None
        raise
    finally:
        for v in tokens:
            v.pending = "seq_first"
    if no_grad and value is not None:  # made under the code's torch.no_grad(): a stop-gradient
        try:
            value = tuple(stopped(v) for v in value) if several else stopped(value)
        except Refused as err:
            raise error(name, str(err)) from None
    if several:
        for piece, v in zip(result, value):
            trace.bind(piece, v)
    elif value is not None:
        trace.bind(result, value)


def sequence_first(trace: Trace, name: str, args: tuple, kwargs: dict) -> list[Value]:
    """The values sequence first, (n, B, c), among the data arguments of an operation on each token
    (``Trace.per_token``): read as (B, n, c) when every other data argument is a number or broadcast along both
    leading axes (a row of features, (c,) or (1, 1, c)), and no weight is sequence first."""
    data = args[: trace.per_token[name]]
    if trace.per_token[name] == 2 and len(args) < 2:
        data = (*data, kwargs.get("other"))
    tokens = []
    for x in (*tensors_in(data), *tensors_in(args[len(data) :]), *tensors_in(kwargs)):
        v = trace.values.get(id(x)) if trace.traced(x) else None
        if v is not None and v.pending == "seq_first":
            if not any(x is d for d in data):
                raise error(name, f"a weight {GUARDED['seq_first']}")
            tokens.append(v)
        elif any(x is d for d in data) and x.ndim > 1 and x[..., 0].numel() != 1:
            raise error(name, f"a tensor of shape {tuple(x.shape)} meets {GUARDED['seq_first']}")
    return tokens


# the order statistics (values and indices) without a rule: topk, sort and kthvalue have theirs (``forms.masks``)
ORDER_STATISTICS = frozenset({"median", "nanmedian", "mode", "msort", "argsort"})

# the random torch calls (by op_name): a fresh draw on every call, which no closed form computes (dropout while
# training has its rule, layout.dropout)
RANDOM = frozenset(
    {"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal", "bernoulli"}
    | {"multinomial", "poisson", "normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "cauchy_"}
    | {"log_normal_", "random_", "rrelu", "rrelu_", "binomial", "native_dropout"}
)


# Python values of a constant that say nothing of its entries' values (a guard on them would trace every call)
UNREAD = frozenset({"data_ptr", "untyped_storage", "storage", "__repr__", "__str__", "__format__", "__hash__"})


def error(name: str, why: str) -> SymattnError:
    """symattn's one-line error: the operation, why, and the user's file:line."""
    where = frames.location()
    return SymattnError(f"from_torch: cannot trace {name}: {why}" + (f" (at {where})" if where else ""))


class NameTaker:
    """A profile hook that names the values bound to a user frame's locals as the frame returns."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.previous = None

    def __enter__(self) -> NameTaker:
        self.previous = sys.getprofile()
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self.previous)

    def hook(self, frame, event, arg) -> None:
        if event == "return" and frames.is_user(frame):
            self.trace.take_names(list(frame.f_locals.items()))
