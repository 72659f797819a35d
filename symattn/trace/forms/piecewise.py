"""Rules for torch's piecewise-linear functions of a traced matrix: the records of ``symattn.lang.piecewise``.

- ``torch.clamp`` / ``clip`` / ``Tensor.clamp`` (min, max), ``clamp_min`` (min), ``clamp_max`` (max), number
  bounds: clamp(A, lo, hi), clamp′ = 1 on [lo, hi] as torch's clamp_backward; of a 0-d tensor, the identity where
  the clamp is inactive (``trace.algebra.clamp``, a learned logit scale's);
- ``F.hardtanh`` (min_val = −1, max_val = 1): hardtanh(A, lo, hi), clamp's value, derivative 1 on (lo, hi) as
  torch's hardtanh_backward;
- ``F.leaky_relu`` / ``nn.LeakyReLU`` (negative_slope = 0.01): LeakyReLU(A, a).

A bound or slope that is a tensor is refused in one line: the records' parameters are numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from sympy import Basic

from symattn.errors import SymattnError
from symattn.lang.piecewise import TORCH_SLOPE, Clamp, Hardtanh, LeakyRelu, parameter
from symattn.trace import algebra
from symattn.trace.layout import argument, matrix
from symattn.trace.tracer import Trace
from symattn.trace.values import Refused, Value

# torch's name → (the record, its parameters' (position after the input, keyword, default) in torch's signature)
SIGNATURES: dict[str, tuple[type, tuple[tuple[int, str, object], ...]]] = {
    Clamp.function: (Clamp, ((1, "min", None), (2, "max", None))),
    "clip": (Clamp, ((1, "min", None), (2, "max", None))),
    "clamp_min": (Clamp, ((1, "min", None), (-1, "", None))),
    "clamp_max": (Clamp, ((-1, "", None), (1, "max", None))),
    Hardtanh.function: (Hardtanh, ((1, "min_val", -1.0), (2, "max_val", 1.0))),
    LeakyRelu.function: (LeakyRelu, ((1, "negative_slope", float(TORCH_SLOPE)),)),
}


def _number(value: object, name: str, what: str) -> Basic | None:
    """A parameter given as a Python number (None: absent); a tensor refused in one line."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        raise Refused(f"{what} with a tensor {name}: only number bounds and slopes are read (a Python float or int)")
    try:
        return parameter(value, f"{what}'s {name}")
    except SymattnError as err:
        raise Refused(str(err)) from None


def rule(name: str) -> Callable[..., Value]:
    """The rule of torch's function called name (``SIGNATURES``): its record's node of a matrix."""
    record, signature = SIGNATURES[name]

    def read(t: Trace, args: tuple, kwargs: dict, result) -> Value:
        v = t.value(args[0])
        if v.is_scalar and record is Clamp:
            return algebra.clamp(t, args, kwargs, result)
        v = matrix(v, f"{name}'s input")
        found = [None if i < 0 else argument(args, kwargs, i, key, default) for i, key, default in signature]
        parameters = [_number(p, key, name) for p, (_, key, _) in zip(found, signature, strict=True)]
        try:
            node = record(v.expr, *parameters)
        except SymattnError as err:
            raise Refused(f"{name}: {err}") from None
        return Value(node, tuple(result.shape), v.heads)

    return read


# the op table's entries (trace.table): each name and its in-place form
OPS = {form: rule(name) for name in SIGNATURES for form in (name, f"{name}_")}
