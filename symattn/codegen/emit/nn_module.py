"""The nn.Module of a generated module, read off the schedule: its class name, constructor (options, head counts,
dimensions bound from weights, weights and biases), extra_repr and forward call; and the mask keywords every public
function takes. The torch module's context prints them, and a backend with a renderer of its own (Triton) takes
them without printing a statement (``module_fields``)."""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from symattn.codegen.backends import Backend
from symattn.codegen.emit import layout
from symattn.codegen.emit.arguments import positional_parameters, spec_order
from symattn.codegen.schedule.build import Schedule
from symattn.specs import Option

MASK_KEYWORDS = ("attn_mask=None", "key_padding_mask=None", "causal=False")
MASK_NAMES = tuple(k.partition("=")[0] for k in MASK_KEYWORDS)


def _extra_repr(names: list[str]) -> str:
    """extra_repr's return statement: "d_model=512, num_heads=8, …" from the module's attributes ("": none)."""
    fields = [f"{name}={{self.{name}}}" for name in names]
    line = 'return f"' + ", ".join(fields) + '"'
    if not names or 8 + len(line) <= layout.WIDTH:
        return line if names else ""
    body = "".join(f'{" " * 12}f"{field}{", " * (i < len(fields) - 1)}"\n' for i, field in enumerate(fields))
    return f"return (\n{body}{' ' * 8})"


# options every torch.nn.Module holds already (train() and eval() set training): the module passes its own, and its
# constructor does not take them
MODULE_FLAGS = frozenset({"training"})


def option_fields(printer, options: list[Option]) -> dict:
    """The options as the module's constructor and docstring take them, and the head counts that divide another."""
    by_name = {o.name: o for o in options}
    return {
        "divides_heads": [
            {"name": o.name, "symbol": o.symbol.name, "of": o.divides, "of_symbol": by_name[o.divides].symbol.name}
            for o in options
            if o.divides is not None
        ],
        "options": [
            {
                "name": o.name,
                "symbol": o.symbol.name,
                "integer": bool(o.symbol.is_integer),
                "passed": o.passed,
                "module_own": o.name in MODULE_FLAGS,
                "default": None if o.default is None else printer.doprint(o.default),
                "default_math": None if o.default is None else sp.sstr(o.default),
            }
            for o in options
        ],
    }


def module_fields(sched: Schedule, backend: Backend, class_name: str | None, module_parameters: Callable) -> dict:
    """The standard module's nn.Module read off the schedule, no statement printed: its class name, constructor
    (options, head counts, dimensions bound from weights, weights and biases), extra_repr and forward call. What a
    backend with a renderer of its own (Triton) shares with the torch module."""
    printer = backend.printer()
    options = list(sched.options)  # the standard variant's (memeff adds block_size)
    mask = None if sched.mask is None else str(sched.mask.name)
    return {
        "class_name": class_name_of(sched, class_name),
        "biases": [str(x.name) for x in sched.spec.inputs if str(x.name) in sched.optional],
        **option_fields(printer, options),
        **torch_module(sched, options, mask, module_parameters(sched, printer)),
    }


def class_name_of(sched: Schedule, class_name: str | None) -> str:
    """The nn.Module's name: the family's, or the spec's name in CamelCase."""
    return class_name or "".join(p.title() for p in sched.spec.name.split("_"))


def torch_module(sched: Schedule, options: list[Option], mask: str | None, parameters: tuple) -> dict:
    """The torch.nn.Module: constructor parameters, weights, the forward call, the mask's keywords."""
    s = sched.spec
    params, module_bindings, weights = parameters
    maybe = [x for x in s.inputs if str(x.name) in sched.optional]
    held = sched.weights - sched.fixed  # the module's own parameters; its forward takes the rest in Spec order
    taken = [name for name in spec_order(sched) if name not in held]
    stored = [*params, *["bias"] * bool(maybe)]  # kept on the module for its repr (options are kept anyway)
    built = [o for o in options if o.name not in MODULE_FLAGS]  # the constructor's options
    shown = [*params, *(o.name for o in built), *stored[len(params) :]]
    return {
        "stored_parameters": stored,
        "extra_repr": _extra_repr(shown),
        "module_bindings": module_bindings,
        "weights": weights,
        "weight_names": [w["name"] for w in weights],
        "module_doc": layout.module_doc(s.name, [w["name"] for w in weights]),
        "init_signature": layout.define(
            "__init__",
            ["self", *params]
            + ["*"] * bool(built)
            + [o.name + ("=None" if o.default is not None else "") for o in built]
            + ["bias=False"] * bool(maybe)
            + ["device=None", "dtype=None"] * bool(weights),
            indent=4,
        ),
        "module_call": layout.call(
            "forward",
            [f"self.{name}" if name in held else name for name in spec_order(sched)]
            + [f"{o.name}=self.{o.name}" for o in options]
            + [f"{k}={k}" for k in MASK_NAMES if mask],
            indent=8,
        ),
        "module_signature": layout.define(
            "forward",
            ["self", *positional_parameters(taken, sched.optional)] + (["*", *MASK_KEYWORDS] if mask else []),
            indent=4,
        ),
    }
