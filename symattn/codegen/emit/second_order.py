"""The second closed form of a generated module: f₂'s forward and backward, printed beside the first.

``specs.second_order`` states f₂ = Σ_i tr(V_iᵀ g_i(x, G)), g_i the first gradients (its inputs,
the derivation ``derive --order 2`` prints); ``codegen.tangents`` schedules it as the first
schedule run forward, then the tangents of its gradients along the directions V_i (forward over
reverse), and ``build_context`` prints it. Its pieces go into the module the first closed form is
rendered in: ``_forward2`` and ``_backward2`` (the double backward of the torch module, and
``hvp``, a Hessian-vector product, in both backends). A spec whose schedule has a node with no
differential rule has no second closed form: ``second_order_context`` gives None and the torch
module keeps raising on double backward.
"""

from __future__ import annotations

import dataclasses

from sympy import MatrixSymbol

from symattn.codegen.backends import Backend
from symattn.codegen.emit import layout
from symattn.codegen.emit.context import build_context
from symattn.codegen.emit.nn_module import MASK_KEYWORDS
from symattn.codegen.emit.sections import _uses
from symattn.codegen.schedule.build import Schedule
from symattn.codegen.schedule.tangents import tangent_schedule
from symattn.errors import SymattnError
from symattn.specs.second_order import SecondOrder, second_order_spec

__all__ = ["second_order_context", "second_order_schedule"]


_CACHE: dict[int, tuple[Schedule, tuple[SecondOrder, Schedule] | None]] = {}  # by id: Specs hold dicts


def second_order_schedule(first: Schedule) -> tuple[SecondOrder, Schedule] | None:
    """f₂ and its schedule for a first schedule (None when some node of the gradients has no rule)."""
    held = _CACHE.get(id(first))
    if held is not None and held[0] is first:
        return held[1]
    if first.fixed:  # fixed constants among the inputs: the second form's Function has no place for them yet
        return None
    try:
        so = second_order_spec(first.spec)
        found = so, tangent_schedule(first, so)
    except SymattnError:  # a node of the first gradients that has no rule itself: no second closed form
        found = None
    _CACHE[id(first)] = (first, found)  # the schedule is kept alive, so its id is not reused
    return found


def _no_module(sched, printer) -> tuple[list, list, list]:
    return [], [], []  # f₂ has no nn.Module of its own


def _hvp_signature(first: Schedule, mask: str | None) -> str:
    """def hvp(<required inputs>, grad_out, direction, *, <options>, <biases>, <mask keywords>):"""
    s = first.spec
    required = [str(x.name) for x in s.inputs if str(x.name) not in first.optional]
    maybe = [f"{x.name}=None" for x in s.inputs if str(x.name) in first.optional]
    options = [o.name + ("=None" if o.default is not None else "") for o in first.options]
    keywords = options + maybe + (list(MASK_KEYWORDS) if mask else [])
    return layout.define("hvp", [*required, "grad_out", "direction", *["*"] * bool(keywords), *keywords], indent=0)


def second_order_context(first: Schedule, first_context: dict, backend: Backend, version: str) -> dict | None:
    """What the templates need to print the second closed form beside the first (None: there is none, or the
    backend's own autodiff differentiates the first closed form again: ``Backend.second_order_helpers``)."""
    found = second_order_schedule(first) if backend.second_order_helpers is not None else None
    if found is None:
        return None
    so, sched = found
    # torch.func's hessian (jacfwd over jacrev) runs it under vmap: nothing in place (Backend.vmapped)
    ctx = build_context(sched, backend, version, "whole", first_context["class_name"], _no_module, not backend.vmapped)
    mask = ctx["mask"]
    printer = backend.printer()
    extra = [h for h in ctx["helpers"] if h not in first_context["helpers"]] + list(backend.second_order_helpers)
    inputs = [str(x.name) for x in so.spec.inputs]
    options = ctx["block_causal"] + [o.name for o in sched.options]
    positional = inputs + [mask] * bool(mask) + options
    first_names = [str(x.name) for x in first.spec.inputs]
    shapes = {x["name"]: x["shape"] for x in ctx["inputs"] if x["name"] not in first_names}
    # a zero direction has its input's shape, batch axes included (a bias, maybe absent, has none)
    scalar_directions = {str(x.name) for x in so.spec.inputs if not isinstance(x, MatrixSymbol)}
    directions = [
        {
            "name": v,
            "zeros": printer.doprint(_zeros(so, v)) if x in first.weights else printer.zeros_like(x),
            "input": x,
            "scalar": v in scalar_directions,  # made 0 before the scalars derived from it (c = τ_v/2)
        }
        for x, v in so.directions
    ]
    sections = [_wrapped_section(sec) for sec in (*ctx["forward_sections"], *ctx["backward_sections"])]
    texts = [f"{line.target} = {line.value}" for sec in sections for line in sec.get("lines", [])]
    texts.append(ctx["checked_inputs"])  # the inputs unpacked in one line: long for a spec with many
    return {
        "long_lines": any(_too_long(text) for text in texts),
        "shapes": shapes,
        "directions": directions,
        "direction_names": layout.assign_tuple("OPTIONAL +", [f'"{d["name"]}"' for d in directions], 0)[
            len("OPTIONAL + = ") :
        ],
        "runtime": printer.runtime_source(extra) if extra else "",
        "helpers": extra,
        "define_forward": layout.define("_forward2", positional, indent=0),
        "forward_call": layout.wrapped(
            "value, saved = _forward2",
            [
                *first_names,
                "grad_out",
                *(f'direction.get("{x}")' for x, _ in so.directions),
                *[mask] * bool(mask),
                *options,
            ],
            "",
            indent=4,
            brackets="()",
        ),
        "option_names": options,
        "cotangent": so.cotangent,
        "hvp_signature": _hvp_signature(first, mask),
        "input_names": first_names,
        "mask_shape": f"{backend.mask_shape}({mask})" if backend.autodiff else "None",
        "ones_like": f"{printer.module_alias}.ones_like",
        "function_inputs": layout.wrapped("", [f'"{x}"' for x in [*first_names, *[mask] * bool(mask)]], ",", 0, "()")
        if len(first_names) + bool(mask) == 1
        else layout.wrapped("", [f'"{x}"' for x in [*first_names, *[mask] * bool(mask)]], "", 0, "()"),
        "first_options": first_context["trailing_count"],
        **{key: ctx[key] for key in COPIED},
        "saved": list(dict.fromkeys(ctx["saved"])),  # an optional input saved once
        "forward_sections": [_wrapped_section(sec) for sec in ctx["forward_sections"]],
        "backward_sections": [_wrapped_section(sec) for sec in ctx["backward_sections"]],
        "needs_dtype": any(
            _uses("dtype", [line.value]) for sec in ctx["backward_sections"] for line in sec.get("lines", [])
        ),
        "expected": [x | {"optional": x["optional"] or x["name"] in so.direction_names} for x in ctx["expected"]],
    }


# the entries of the first context that a derived one (f₂'s, the JVP's) hands its templates as they are
COPIED_INPUTS = (
    "mask",
    "causal_call",
    "options",
    "divides_heads",
    "bindings",
    "constants",
    "nonempty",
    "checked_inputs",
    "output",
)
# f₂'s: and what returns its gradients
COPIED = (
    *COPIED_INPUTS,
    *("return_gradients", "returned_gradients", "backward_constants", "drop_none", "mask_gradient", "seed"),
)


def _too_long(text: str, indent: int = 4) -> bool:
    """Does a statement at indent overflow a line? (Its continuation lines carry their own indentation.)"""
    first, *rest = text.split("\n")
    return indent + len(first) > layout.WIDTH or any(len(line) > layout.WIDTH for line in rest)


def _wrapped_section(section: dict, indent: int = 4) -> dict:
    """A section whose statements too long for a line are broken as ruff format would (``layout.assigned``)."""
    if section.get("loop"):
        return section
    lines = [
        dataclasses.replace(line, value=layout.assigned(str(line.target), line.value, indent))
        for line in section["lines"]
    ]
    return section | {"lines": lines}


def _zeros(so: SecondOrder, name: str):
    """A zero direction: the ZeroMatrix of its input's shape, 0 for a trainable scalar (None in a call means zero)."""
    from sympy import Integer, ZeroMatrix

    x = next(x for x in so.spec.inputs if str(x.name) == name)
    return ZeroMatrix(*x.shape) if isinstance(x, MatrixSymbol) else Integer(0)
