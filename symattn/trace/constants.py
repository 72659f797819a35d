"""The constant program: the torch calls of a trace that read no traced tensor, kept to be run again.

Masks and fixed tensors are built from the forward's bool arguments, the module's buffers and tensors
made inside the code (``torch.ones(n, n).triu(1)``). Each call on constants only is recorded with its
tensor arguments as references (to a forward argument, a buffer, or an earlier call's result), so that
``replay`` rebuilds every constant from new arguments without running the rest of the forward; ``FORMS``
and ``fitted`` make a spec constant of the rebuilt tensor (the additive mask M from a bool mask).

A constant written in place (``allowed[b, :, :p] = True``, ``mask.fill_(…)``) is a step too, and the tensor
written is that step's result from then on. A Python value read off a constant (``prefix.tolist()``,
``lengths[b].item()``, ``if mask.any():``) shaped the rest of the trace: it is a guard, and ``holds`` says
whether new arguments and buffers give the same values (else the trace is not theirs: ``drop_in`` traces again).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy as sp
import torch

from symattn.errors import SymattnError


@dataclass(frozen=True)
class Ref:
    """A tensor of the program: ("arg", i) the forward's i-th argument, ("item", (i, j)) the j-th tensor of a tuple
    argument, ("buffer", name), ("step", k) the result of the k-th recorded call, ("literal", k) a tensor held as
    it is."""

    kind: str
    key: object


@dataclass
class Program:
    """The recorded calls on constants, and where each constant tensor came from (by id)."""

    steps: list[tuple[object, tuple, dict]] = field(default_factory=list)
    sources: dict[int, Ref] = field(default_factory=dict)
    literals: list[torch.Tensor] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)  # the steps that write a tensor in place
    # the Python values read off constants: (the step the value is read after, the read as a step, the value)
    guards: list[tuple[int, tuple[object, tuple, dict], object]] = field(default_factory=list)

    def leaf(self, tensor: torch.Tensor, ref: Ref) -> None:
        """A tensor the program starts from: a forward argument or a buffer."""
        self.sources[id(tensor)] = ref
        self.kept.append(tensor)

    def ref(self, tensor: torch.Tensor) -> int:
        """The reference to a constant tensor (one seen for the first time is held as a literal)."""
        if id(tensor) not in self.sources:
            self.literals.append(tensor.detach().clone())
            self.leaf(tensor, Ref("literal", len(self.literals) - 1))
        return id(tensor)

    def record(self, func: object, args: tuple, kwargs: dict, result: object, name: str = "") -> None:
        """One call on constants, its tensor arguments replaced by references: a tensor made, the pieces of a
        tuple (``unbind``, ``split``, iterating a tensor) each a step of their own, or a tensor written in place
        (``__setitem__``, ``fill_``, ``masked_fill_``), which is the step's result from then on."""
        written = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        if name == "__setitem__":
            func, result = _set_item, args[0]
        self.steps.append((func, self._refs(args), self._refs(kwargs)))
        step = len(self.steps) - 1
        if written:
            self.writes.append(step)
        if isinstance(result, torch.Tensor):
            self.leaf(result, Ref("step", step))
            return
        for j, piece in enumerate(result):
            self.steps.append((operator.getitem, (Ref("step", step), j), {}))
            self.leaf(piece, Ref("step", len(self.steps) - 1))

    def guard(self, func: object, args: tuple, kwargs: dict, value: object) -> None:
        """A Python value read off constants (``item``, ``tolist``, ``__bool__``, ``__index__``): the trace holds
        for other arguments only where they give the same value."""
        self.guards.append((len(self.steps) - 1, (func, self._refs(args), self._refs(kwargs)), value))

    def _refs(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor):
            self.ref(obj)
            return self.sources[id(obj)]
        if isinstance(obj, (tuple, list)):
            return type(obj)(self._refs(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self._refs(v) for k, v in obj.items()}
        return obj

    def arguments(self, ref: int) -> set[int]:
        """The forward arguments (by position) that the constant tensor with id ``ref`` is made from."""
        found: set[int] = set()
        stack = [self.sources[ref]]
        while stack:
            obj = stack.pop()
            if isinstance(obj, Ref) and obj.kind in ("arg", "item"):
                found.add(obj.key if obj.kind == "arg" else obj.key[0])
            elif isinstance(obj, Ref) and obj.kind == "step":
                _, a, kw = self.steps[obj.key]
                stack.extend((a, kw))
            elif isinstance(obj, (tuple, list)):
                stack.extend(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
        return found

    def replay(self, args: tuple, buffers: Mapping[str, torch.Tensor], wanted: list[int]) -> list[torch.Tensor]:
        """The tensors with ids ``wanted`` (as seen at the trace), rebuilt from new arguments and buffers."""
        needed = {self.sources[i].key for i in wanted if self.sources[i].kind == "step"}
        value = self._run(args, buffers, max(needed | set(self.writes), default=-1))
        return [value(self.sources[i]) for i in wanted]

    def holds(self, args: tuple, buffers: Mapping[str, torch.Tensor]) -> bool:
        """Whether these arguments and buffers give every value the trace read off constants (its guards)."""
        if not self.guards:
            return True
        try:
            value = self._run(args, buffers, max(after for after, _, _ in self.guards))
        except SymattnError:  # a step that checks its tensor (forms.heads.first_along) refused these arguments
            return False
        for _, (func, a, kw), seen in self.guards:
            try:
                now = func(*value(a), **value(kw))
            except (RuntimeError, ValueError, IndexError, TypeError):
                return False
            if not _same(now, seen):
                return False
        return True

    def _run(self, args: tuple, buffers: Mapping[str, torch.Tensor], last: int):
        """Run the steps up to ``last``; the resolver of references to their values. A literal is copied when the
        program writes in place (a write must not reach the next replay)."""
        results: list[object] = []
        literals = [t.clone() for t in self.literals] if self.writes else self.literals

        def value(obj: object) -> object:
            if isinstance(obj, Ref):
                if obj.kind == "arg":
                    return args[obj.key]
                if obj.kind == "item":  # a tensor in a tuple argument: args[i][j]
                    return args[obj.key[0]][obj.key[1]]
                if obj.kind == "buffer":
                    return buffers[obj.key]
                if obj.kind == "step":
                    return results[obj.key]
                return literals[obj.key]
            if isinstance(obj, (tuple, list)):
                return type(obj)(value(x) for x in obj)
            if isinstance(obj, dict):
                return {k: value(v) for k, v in obj.items()}
            return obj

        for func, a, kw in self.steps[: last + 1]:
            results.append(func(*value(a), **value(kw)))
        return value


def _set_item(tensor: torch.Tensor, index: object, item: object) -> torch.Tensor:
    """``tensor[index] = item`` as a step: the tensor written."""
    tensor[index] = item
    return tensor


def _same(now: object, seen: object) -> bool:
    """Whether a value read off constants is the one read at the trace (a NumPy array compared entry by entry)."""
    if hasattr(seen, "shape") and hasattr(seen, "dtype"):
        return getattr(now, "shape", None) == seen.shape and bool((now == seen).all())
    try:
        return bool(now == seen)
    except (TypeError, ValueError, RuntimeError):
        return False


def spec_layout(tensor):
    """A tensor as the spec holds it: a 1-D (d,) as the 1 × d row (a view), anything else as it is."""
    return tensor.unsqueeze(0) if tensor.ndim == 1 else tensor


def sizes_of(spec, tensors) -> dict:
    """The dimensions' values, read off the inputs' shapes (a length c·s gives s = length / c)."""
    found: dict = {}
    for symbol, tensor in zip(spec.matrix_inputs, tensors):
        shape = (1, *tensor.shape) if tensor.ndim == 1 else tuple(tensor.shape[-2:])
        for length, size in zip(symbol.shape, shape):
            coeff, rest = sp.sympify(length).as_coeff_Mul()
            if rest.is_Symbol:
                found[rest] = int(size) // int(coeff)
    return found


FORMS = {
    "additive": lambda b, dtype: _zeros(b, dtype).masked_fill(b, float("-inf")),  # −∞ where True
    "additive_false": lambda b, dtype: _zeros(b, dtype).masked_fill(~b, float("-inf")),  # −∞ where False
    "keep": lambda b, dtype: (~b).to(dtype),  # 1 where False
    "keep_false": lambda b, dtype: b.to(dtype),  # 1 where True
    "as_is": lambda t, dtype: t.to(dtype),
}


def spec_value(constant, raw, dtype, sizes: dict, checked: bool = True):
    """A constant of the trace (``tracer.Constant``) made from its rebuilt tensor: the form applied (a bool as M or
    K), at the spec's matrix shape; a per-head one (``heads`` H, of shape (…, H, n, m) or broadcasting to it) laid
    out as the spec holds it, n × (H·m) with head h in columns h·m … (h+1)·m − 1."""
    rows, cols = (int(sp.sympify(x).xreplace(sizes)) for x in constant.symbol.shape)
    value = FORMS[constant.form](raw, dtype)
    name = str(constant.symbol.name)
    if constant.heads is None:  # (a constant per sequence keeps its batch axes as torch aligns them with the inputs')
        return fitted(value, rows, cols, name, constant.at_heads or not constant.batched)
    heads = constant.heads
    value = value.reshape((1,) * max(3 - value.ndim, 0) + tuple(value.shape))
    try:
        value = torch.broadcast_to(value, (*value.shape[:-3], heads, rows, cols // heads))
    except RuntimeError:
        raise SymattnError(
            f"drop_in: the per-head constant {name} of shape {tuple(value.shape)} is not {heads} × {rows} × "
            f"{cols // heads}"
        ) from None
    return value.transpose(-3, -2).reshape(*value.shape[:-3], rows, cols)


def _zeros(b, dtype):
    return torch.zeros(b.shape, dtype=dtype, device=b.device)


def fitted(value, rows: int, cols: int, name: str, heads_axis: bool = True):
    """A constant at the spec's matrix shape: a head axis of size 1 dropped (heads_axis: axis −3 is one; else every
    leading axis is a batch axis, kept), size-1 rows or columns broadcast."""
    while heads_axis and value.ndim > 2 and value.shape[-3] == 1:
        value = value.squeeze(-3)
    try:
        return torch.broadcast_to(value, (*value.shape[:-2], rows, cols))
    except RuntimeError:
        raise SymattnError(
            f"drop_in: the constant {name} of shape {tuple(value.shape)} is not {rows} × {cols}"
        ) from None
