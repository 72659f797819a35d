"""The generated entry points' arguments: the spec's inputs, then its constants, positionally in ``Spec`` order
(each by name too); a parameter of shape (1, k) also taken 1-D as torch holds it; a fixed constant also taken
as a bool; and the forward docstring's lines that say so.
"""

from __future__ import annotations

import textwrap

import sympy as sp

from symattn.codegen.backends import Backend
from symattn.codegen.emit import layout
from symattn.codegen.schedule.build import Schedule

# Spec.bool_forms of the additive mask whose bool means "allowed" where True (torch's SDPA, torch.where(mask, A, -inf))
ALLOWED_FORM = "additive_false"


def spec_order(sched: Schedule) -> list[str]:
    """The names generated forward takes positionally: the spec's inputs, then its constants, in the order the
    user's Spec lists them (the mask among the constants, in its place)."""
    return list(sched.order) or [str(x.name) for x in (*sched.spec.inputs, *sched.spec.constants)]


def positional_parameters(names: list[str], optional: frozenset[str] | set[str]) -> list[str]:
    """The parameters of a def taking names positionally (each by keyword too): the optional ones of the trailing
    run default to None; an optional one before a required one has no default (None is still allowed there)."""
    required = max((i + 1 for i, name in enumerate(names) if name not in optional), default=0)
    return names[:required] + [f"{name}=None" for name in names[required:]]


def row_parameters(sched: Schedule) -> list[str]:
    """The parameters (unbatched inputs) of shape (1, k): a bias, a LayerNorm's γ, β. Each may be given 1-D,
    (k,), as torch holds one; generated forward views it as the 1 × k row, and its gradient comes back (k,)."""
    return [str(x.name) for x in sched.spec.matrix_inputs if str(x.name) in sched.weights and x.shape[0] == 1]


def bool_forms(sched: Schedule) -> dict[str, str]:
    """How a bool array passed for each fixed constant becomes it (Spec.bool_forms; the mask's is read apart)."""
    return {name: form for name, form in sched.bool_forms if name in sched.fixed}


def named_call(target: str, function: str, names: list[str]) -> str:
    """target = function({"a": a, …}) in a function body, broken over lines as ruff format would."""
    items = [f'"{name}": {name}' for name in names]
    prefix, one = f"{target} = {function}(", "{" + ", ".join(items) + "}"
    if 4 + len(prefix) + len(one) + 1 <= layout.WIDTH:
        return f"{prefix}{one})"
    if 8 + len(one) <= layout.WIDTH:
        return f"{prefix}\n        {one}\n    )"
    body = "".join(f"            {item},\n" for item in items)
    return f"{prefix}\n        {{\n{body}        }}\n    )"


def entry(sched: Schedule, backend: Backend, public: bool) -> dict:
    """What the public forward does to its arguments before the closed form: a call on CUDA handed to the spec's
    Triton module where the backend routes (``routed``: the runtime helpers that decide and hand over, ``_constant``
    where the spec has constants), a fixed constant given as a bool made the matrix the spec holds, parameters given
    1-D viewed as rows (NumPy: remembered, so that backward returns their gradients 1-D)."""
    if not public:
        return {"routed": [], "bool_constants": [], "rows_call": "", "vectors_call": "", "vectors": False}
    first = str(sched.spec.matrix_inputs[0].name)
    converted = [
        layout.wrapped(f"{name} = _bool_constant", [name, f'"{form}"', first], "", 4, "()")
        for name, form in bool_forms(sched).items()
    ]
    rows = row_parameters(sched)
    named = [sp.Symbol(name) for name in rows]
    return {
        "routed": ["path", "_kernels_for", *["_constant"] * bool(sched.spec.constants)] if backend.routes else [],
        "bool_constants": converted,
        "rows_call": layout.checked_inputs(named, "_rows") if rows else "",
        # NumPy, whose backward is called by hand: the parameters given 1-D, their gradients returned 1-D
        "vectors_call": named_call("vector_inputs", "_vectors", rows) if rows and not backend.autodiff else "",
        "vectors": bool(rows) and not backend.autodiff,
    }


def arguments_doc(sched: Schedule, mask: str | None, variant: str, entry: dict) -> list[str]:
    """The forward docstring's lines on its arguments (indented, wrapped): the positional rule, the mask in its
    position and its keywords, the optional biases, the parameters taken 1-D, the constants taken as bools."""
    order = spec_order(sched)
    lines = [f"Arguments: {', '.join(order)}, in this order (the spec's inputs, then its constants), or by name."]
    if mask:
        truth = "True = allowed" if dict(sched.bool_forms).get(mask) == ALLOWED_FORM else "True = not allowed"
        differentiated = "" if variant == "memeff" else "; a float one is differentiated"
        lines.append(
            f"{mask}, the additive mask, in its position (a constant, no gradient): None (no mask), a float n × m or "
            f"batched (..., n, m) array added to the scores, or a bool ({truth}). attn_mask is the same mask by "
            f"keyword (bool: True = not allowed{differentiated}); giving both is a TypeError. key_padding_mask "
            "((..., m) bool: True = ignore the key) and causal add to it; a row whose keys are all masked gives "
            "zeros and zero gradients, never NaN."
        )
    biases = [str(x.name) for x in sched.spec.inputs if str(x.name) in sched.optional]
    if biases:
        lines.append(f"{', '.join(biases)}: optional biases (1 × columns, broadcast over the tokens), None: left out.")
    rows = row_parameters(sched) if entry["rows_call"] else []
    if rows:
        lines.append(
            f"{', '.join(rows)}: 1 × k, or 1-D (k,) as torch holds a bias (viewed as the row; its gradient comes "
            "back (k,))."
        )
    for name, form in bool_forms(sched).items():
        lines.append(f"{name}: a float matrix, or a bool array made one ({BOOL_FORM_TEXT[form]}).")
    return [
        line for text in lines for line in textwrap.wrap(text, 110, initial_indent="    ", subsequent_indent="    ")
    ]


# how _bool_constant makes each form of Spec.bool_forms, in words
BOOL_FORM_TEXT = {
    "additive": "-inf where True, else 0",
    "additive_false": "-inf where False, else 0",
    "keep": "1 where False, else 0",
    "keep_false": "1 where True, else 0",
}
