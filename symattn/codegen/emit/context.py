"""The template context of a generated module: every expression, signature and helper already printed.

``build_context`` gathers, from small named parts, the values the Jinja templates lay out:
the header's math, the statements of the forward and backward sections (printed by the
backend's printer), the inputs' checks and bindings, the signatures and calls, and the
runtime helpers' source. The templates add only scaffolding.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable

import sympy as sp

from symattn.codegen.backends import Backend
from symattn.codegen.emit import arguments, layout
from symattn.codegen.emit.arguments import (
    ALLOWED_FORM,
    arguments_doc,
    positional_parameters,
    spec_order,
)
from symattn.codegen.emit.nn_module import MASK_KEYWORDS, class_name_of, option_fields, torch_module
from symattn.codegen.emit.saving import read_constants, saved_and_remade, saved_names
from symattn.codegen.emit.sections import Statement, _sections, _statements, _uses
from symattn.codegen.schedule.build import Assignment, Schedule
from symattn.derive.formats.latex import text
from symattn.lang.functions import Keep
from symattn.lang.graph import postorder
from symattn.lang.ops import SplitHeads
from symattn.lang.positions import Entries
from symattn.numeric.printers import helper_needs
from symattn.specs import Option

MADE_MASKS = (Entries, Keep)  # the nodes made in the forward whose entries may be −∞ (``masks``)

# The keywords of a module whose spec has an additive mask M (built from them at run time).

ModuleParameters = Callable[[Schedule, object], tuple[list[str], list[dict], list[dict]]]


def docstring_text(value: str) -> str:
    """value as it may stand inside a triple-quoted docstring: backslashes and quotes escaped."""
    return value.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _math(a: Assignment) -> str:
    """An assignment as a line of the docstring's math (plain unicode, as `symattn derive --format text`)."""
    return f"{a.target.name} = {text(a.value)}"


def _wrap(lines: list[str], width: int = 110) -> list[str]:
    """Math lines wrapped to fit the docstring, continuations indented."""
    out: list[str] = []
    for line in lines:
        out.extend(textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False) or [""])
    return out


def _shape_text(printer, x: sp.MatrixSymbol, weights: frozenset) -> str:
    if not isinstance(x, sp.MatrixSymbol):  # a trainable scalar: 0-d
        return "()"
    dims = ", ".join(printer.doprint(d) for d in x.shape)
    return f"({dims})" if str(x.name) in weights else f"(..., {dims})"


def _nonempty_call(sched: Schedule) -> str:
    """The check that every dimension read off the inputs is at least 1, but the query rows (the first input's)."""
    first = sched.spec.matrix_inputs[0]
    rows = first.shape[0] if str(first.name) not in sched.weights else None
    sizes = [b.symbol.name for b in sched.bindings if b.symbol != rows]
    if not sizes:
        return ""
    read = {b.input for b in sched.bindings}
    sources = [str(x.name) for x in sched.inputs if str(x.name) in read]  # the inputs the sizes are read off
    return layout.statement(
        "_nonempty",
        [
            layout.wrapped("", [f'"{name}": {name}' for name in sizes], "", indent=8, brackets="{}"),
            layout.wrapped("", [f'"{name}": {name}' for name in sources], "", indent=8, brackets="{}"),
        ],
        indent=4,
    )


def _bindings(sched: Schedule, printer) -> list[Statement]:
    """The dimensions read off the inputs' shapes (a quotient checked to divide)."""
    bindings = []
    for b in sched.bindings:
        read = f"{b.input}.shape[{b.axis}]"
        if b.divisor is None:
            bindings.append(Statement(b.symbol.name, read))
        else:
            divisor = printer.doprint(b.divisor)
            upto = "" if b.axis == -1 else f"[:{b.axis + 1}]"  # _quotient divides the last axis of what it is given
            read = f'_quotient("{b.input}", tuple({b.input}.shape{upto}), {divisor})'
            bindings.append(Statement(b.symbol.name, read))
    return bindings


def _header(sched: Schedule, printer, options: list[Option], variant: str) -> dict:
    """The module docstring's facts: inputs and shapes, options, the math of both passes."""
    s = sched.spec
    return {
        "spec": s.name,
        "summary": docstring_text(s.summary),
        "inputs": [
            {
                "name": str(x.name),
                "shape": _shape_text(printer, x, sched.weights),
                "weight": str(x.name) in sched.weights,
                "optional": str(x.name) in sched.optional,
            }
            for x in s.inputs
        ],
        **option_fields(printer, options),
        "variant_note": ", memory-efficient variant" if variant == "memeff" else "",
        "output": str(sched.output.name),
        "output_shape": ", ".join(printer.doprint(d) for d in sched.output.shape),
        "seed": str(sched.seed.name),
        "forward_math": _wrap(
            [f"{c.name} = {sp.sstr(v)}" for c, v in sched.constants] + [_math(a) for a in sched.forward]
        ),
        "backward_math": _wrap([_math(a) for a in sched.backward]),
        "ambiguous": any(str(a.target.name) in ("O", "I", "l") for a in (*sched.forward, *sched.backward)),
    }


def _checks(sched: Schedule, printer, backend: Backend, options: list[Option]) -> dict:
    """The inputs' checks and the dimensions and constants the body reads."""
    s = sched.spec
    return {
        "expected": [
            {
                "name": str(x.name),
                "dims": ", ".join(printer.doprint(d) for d in x.shape),
                "optional": str(x.name) in sched.optional,
            }
            for x in s.matrix_inputs
        ],
        "bindings": _bindings(sched, printer),
        "constants": [Statement(c.name, printer.doprint(v)) for c, v in sched.constants],
        "nonempty": _nonempty_call(sched),
        "checked_inputs": layout.checked_inputs(s.inputs, backend.check_inputs),
    }


def _runtime_helpers(
    printer,
    backend: Backend,
    checks: dict,
    options: list[Option],
    mask: str | None,
    mask_gradient: bool,
    entry: dict,
    public: bool,
) -> list[str]:
    """The runtime helpers the module calls: the expressions' (sorted), then the checks' and the routing's, then
    (sorted) the ones those call. public: the module's forward (not f₂'s), which reads its arguments (``_entry``,
    ``_one_mask``)."""
    names = [*sorted(printer.helpers_used), backend.check_inputs, "_check_shape"]
    names += ["_bool_constant"] * bool(entry["bool_constants"]) + ["_rows"] * bool(entry["rows_call"])
    names += ["_vectors", "_as_given"] * entry["vectors"] + ["_one_mask"] * bool(mask and public)
    names += ["_quotient"] * any(b.value.startswith("_quotient(") for b in checks["bindings"])
    names += ["_positive_int"] * any(o.symbol.is_integer for o in options)
    names += ["_nonempty"] * bool(checks["nonempty"])
    names += [*backend.helpers, *["_additive_mask"] * bool(mask)]
    names += [backend.mask_shape] * bool(mask_gradient) + entry["routed"]
    needed = {need for name in names for need in helper_needs(printer.runtime, name)}  # what the helpers call
    return names + sorted(needed - set(names))


def _function(
    sched: Schedule,
    options: list[Option],
    mask: str | None,
    class_name: str,
    backend: Backend,
    shared: set,
    block_causal: list[str],
    vectors: bool,
) -> dict:
    """The signatures and calls of forward and backward; shared: gradients returned as None when their input was.

    Generated forward takes the spec's inputs, then its constants, positionally in the user's Spec order (each by
    name too; ``positional_parameters``), then its options and the mask keywords, keyword-only.
    vectors: NumPy's backward returns the gradients of parameters given 1-D as vectors (``_as_given``)."""
    s = sched.spec
    maybe = [x for x in s.inputs if str(x.name) in sched.optional]  # optional inputs: None leaves their terms out
    trailing = block_causal + [o.name for o in options]  # after the inputs and M: no gradient
    positional = [str(x.name) for x in s.inputs] + ([mask] if mask else []) + trailing
    # a float attn_mask's gradient: under "attn_mask" (NumPy), as M's (torch, whose autograd carries it on)
    mask_grads = [(name if backend.autodiff else "attn_mask", t) for name, t in sched.constant_gradients]
    keywords = [o.name + ("=None" if o.default is not None else "") for o in options] + (
        list(MASK_KEYWORDS) if mask else []
    )
    signature = positional_parameters(spec_order(sched), sched.optional) + ["*"] * bool(keywords) + keywords
    traced = [f"traced=_{class_name}Traced"]  # its twin without jvp, which _apply applies while compiling
    returned = (
        "return " if not (maybe or mask_grads or vectors) or backend.autodiff else "grads = ",
        [
            f'"{name}": None if {guard} is None else {t.name}'
            if t in shared
            else f'"{name}": {_returned(sched, name, t)}'
            # a float attn_mask's gradient is computed when mask_shape (what backward has of it) is not None
            for name, guard, t in (
                *((name, name, t) for name, t in sched.gradients),
                *((name, "mask_shape", t) for name, t in mask_grads),
            )
        ],
    )
    passed = [p.partition("=")[0] for p in signature]  # forward's parameters, handed on as given (kernels_call)
    star, constant = passed.index("*") if "*" in passed else len(passed), {str(c.name) for c in s.constants}
    handed = [f"_constant({n})" if n in constant else n for n in passed[:star]]
    handed += [f"{n}={n}" for n in passed[star + 1 :] if n != "block_size"]  # memeff's own: the kernels have blocks
    return {
        "input_names": [str(x.name) for x in s.inputs],
        "signature": layout.define("forward", signature, indent=0),
        "route_call": layout.wrapped("kernels = _kernels_for", [n for n in passed if n != "*"], "", 4, "()"),
        "kernels_call": layout.wrapped("return kernels.forward", handed, "", 8, "()"),
        "apply_call": layout.wrapped("return _apply", [f"{class_name}Function", *positional, *traced], "[0]", 4, "()"),
        "return_gradients": layout.wrapped(*returned, "", indent=4, brackets="{}"),
        "returned_gradients": returned,  # (prefix, items): laid out again a level deeper (``emit.regimes``)
        "optional_names": "(" + ", ".join(f'"{x.name}"' for x in maybe) + ("," if len(maybe) == 1 else "") + ")",
        "biases": [str(x.name) for x in maybe],
        "drop_none": bool(maybe or mask_grads),
        "function_gradients": _function_gradients(sched, mask, bool(mask_grads), len(trailing)),
        "tensor_inputs": layout.wrapped(
            "inputs = _only_tensors", [str(x.name) for x in s.inputs] + [mask] * bool(mask), "", 8, brackets="()"
        ),
        "define_forward": layout.define("_forward", positional, indent=0),
        "define_function_forward": layout.define("forward", positional, indent=4),
        "call_forward": layout.wrapped(f"{sched.output.name}, saved = _forward", positional, "", 8, "()"),
        # an input returned as it is (Y = X) is returned as a view: a setup_context Function may not save it
        "return_distinct": layout.wrapped(
            "return _distinct",
            [str(sched.output.name), *(str(x.name) for x in s.inputs), *[mask] * bool(mask)],
            ", saved",
            8,
            "()",
        ),
        "define_setup_context": layout.define("setup_context", ["ctx", "inputs", "output"], indent=4),
        "unpack_inputs": layout.unpacked(positional, "inputs", 8),
        "remember": [
            layout.given_flags([str(x.name) for x in s.inputs] + [mask] * bool(mask), 8),
            layout.assign_tuple("ctx.options", trailing, 8),
        ],
        "trailing_count": len(trailing),
    }


def _function_gradients(sched: Schedule, mask: str | None, mask_gradient: bool, trailing: int) -> str:
    """The torch Function backward's tuple: one gradient per argument of apply (the inputs, M, then None for
    causal and the options)."""
    s = sched.spec
    return layout.assign_tuple(
        "gradients",
        [
            "None"  # a fixed constant: no gradient
            if str(x.name) in sched.fixed
            else f'grads["{x.name}"] if ctx.needs_input_grad[{i}] else None'  # a number: no gradient
            if str(x.name) in sched.scalar_inputs
            else f'grads["{x.name}"]'
            for i, x in enumerate(s.inputs)
        ]
        + ([f'grads["{mask}"]' if mask_gradient else "None"] if mask else [])
        + ["None"] * trailing,
        indent=8,
    )


def _returned(sched: Schedule, name: str, target: sp.MatrixSymbol) -> str:
    """The gradient as returned: a trainable scalar's, computed 1 × 1, as a 0-d value."""
    return f"{target.name}.reshape(())" if name in sched.scalar_inputs else str(target.name)


def _custom_vjp(sched: Schedule, options: list[Option], mask: str | None, block_causal: list[str]) -> dict:
    """The JAX module's jax.custom_vjp: its primal, forward and backward rules (causal, beside M where loops over
    blocks of rows write it, and the options static, by nondiff_argnums) and the public forward's call."""
    passed = [o.name for o in options if o.passed]  # a key: traced, never differentiated
    arrays = [str(x.name) for x in sched.spec.inputs] + ([mask] if mask else []) + passed
    static_names = block_causal + [o.name for o in options if not o.passed]
    positional = arrays + static_names
    in_order = arrays[: len(arrays) - len(passed)] + block_causal + [o.name for o in options]  # _forward's own
    static = ", ".join(str(i) for i in range(len(arrays), len(positional)))
    fixed = {*sched.fixed, *passed}
    cotangents = ["None" if name in fixed else f'grads["{name}"]' for name in arrays]  # None: a zero one
    return {
        "define_primal": layout.define("_primal", positional, indent=0),
        "define_primal_fwd": layout.define("_primal_fwd", positional, indent=0),
        "define_primal_bwd": layout.define("_primal_bwd", static_names + ["residuals", str(sched.seed.name)], indent=0),
        "primal_value": layout.wrapped("return _forward", in_order, "[0]", indent=4, brackets="()"),
        "primal_call": layout.wrapped(f"{sched.output.name}, saved = _forward", in_order, "", 4, brackets="()"),
        "nondiff_argnums": f"({static},)" if len(static_names) == 1 else f"({static})",
        "vjp_cotangents": layout.assign_tuple("cotangents", cotangents, indent=4),
        "vjp_call": layout.call("_differentiable", positional, indent=4),
    }


def _mask_calls(sched: Schedule, backend: Backend, blocked: bool, heads_axis: bool) -> dict:
    """How a function gets the additive mask M. ``mask_call`` builds it from the mask keywords. In a backend
    with loops over blocks of rows (NumPy, torch) M leaves the causal part out (by_blocks) and the inner
    functions (_forward, _jvp, _forward2) take ``causal`` beside it (``block_causal``): a loop writes it into each
    block of scores and skips the keys no row of the block sees; a function that takes M whole adds it first
    (``causal_call``)."""
    if sched.mask is None:
        return {"mask_call": "", "forward_mask_call": "", "causal_call": "", "block_causal": []}
    s, mask = sched.spec, str(sched.mask.name)
    query, key = str(s.inputs[0].name), next(str(x.name) for x in s.inputs if x.shape[0] == sched.mask.shape[1])
    rest = ["key_padding_mask", "causal", query, key, *["per_head=True"] * heads_axis]
    blocks = backend.loops
    allowed = ", allowed=True" if dict(sched.bool_forms).get(mask) == ALLOWED_FORM else ""  # a bool True = allowed
    # forward's: the mask in its position, or attn_mask (never both: _one_mask), then the other keywords
    given = f'_one_mask("{mask}", {mask}, attn_mask, {query}, {key}{allowed})'
    return {
        "mask_call": layout.wrapped(
            f"{mask} = _additive_mask", ["attn_mask", *rest] + ["by_blocks=True"] * blocks, "", 4, "()"
        ),
        "forward_mask_call": layout.wrapped(
            f"{mask} = _additive_mask", [given, *rest] + ["by_blocks=True"] * blocks, "", 4, "()"
        ),
        "causal_call": f"{mask} = with_causal({mask}, causal, {query}, {key})" if blocks and not blocked else "",
        "block_causal": ["causal"] * blocks,
    }


def build_context(
    sched: Schedule,
    backend: Backend,
    version: str,
    variant: str,
    class_name: str | None,
    module_parameters: ModuleParameters,
    inplace: bool = True,
) -> dict:
    """Everything a module template needs, every expression already printed.

    module_parameters gives the nn.Module's constructor parameters, the dimensions they bind and the
    weights' shapes, from the schedule and a fresh printer of the backend. ``inplace=False``: no value is
    written into a dying array (code that torch.func's vmap runs with some operands batched and others not).
    """
    printer = backend.printer()
    printer.inplace = backend.mutable and inplace
    mask_no_gradient = variant == "memeff" and bool(sched.constant_gradients)  # torch: a clear error instead
    if variant == "memeff" and sched.constant_gradients:  # blocks of rows: the mask gets no gradient there
        gradients = {t for _, t in sched.constant_gradients}
        backward = tuple(a for a in sched.backward if a.target not in gradients)
        sched = dataclasses.replace(sched, backward=backward, constant_gradients=())
    mask = None if sched.mask is None else str(sched.mask.name)
    printer.optional, printer.mask = sched.optional | {f"{name}_b" for name in sched.optional}, mask
    printer.weights = sched.weights
    # a mask made in the forward (of positions, or computed per call: keep) may mask whole rows: zeros, as M's
    printer.masked_rows = any(isinstance(x, MADE_MASKS) and x.masks for a in sched.forward for x in postorder(a.value))
    sections = _sections(sched, printer, mask, variant, backend)
    options = sections["options"]
    class_name = class_name_of(sched, class_name)
    checks = _checks(sched, printer, backend, options)
    public = variant in ("standard", "memeff")  # the module's own forward (not f₂'s, variant "whole")
    entry = arguments.entry(sched, backend, public)
    helpers = _runtime_helpers(printer, backend, checks, options, mask, bool(sched.constant_gradients), entry, public)
    heads_axis = any(isinstance(n, SplitHeads) for a in sched.forward for n in sp.preorder_traversal(a.value))
    masks = _mask_calls(sched, backend, sections["blocked"], heads_axis)
    return {
        "version": version,
        "backend": backend.name,
        "target": backend,
        "class_name": class_name,
        "mask": mask,
        **_header(sched, printer, options, variant),
        **checks,
        "forward_sections": sections["forward_sections"],
        "backward_sections": sections["backward_sections"],
        **saved_and_remade(sched, saved_names(sched, sections, mask, variant), checks["constants"], printer),
        "constants": read_constants(checks["constants"], sections["forward_sections"]),
        "every_constant": checks["constants"],
        "needs_dtype": _uses("dtype", [line.value for line in _statements(sections)]),
        **_function(
            sched, options, mask, class_name, backend, sections["shared"], masks["block_causal"], entry["vectors"]
        ),
        **entry,
        "arguments_doc": arguments_doc(sched, mask, variant, entry),
        **torch_module(sched, options, mask, module_parameters(sched, backend.printer())),
        **_custom_vjp(sched, options, mask, masks["block_causal"]),
        "helpers": helpers,
        "runtime": printer.runtime_source(helpers),
        "mask_gradient": backend.mask_shape if sched.constant_gradients else "",
        "mask_no_gradient": mask_no_gradient,
        **masks,
    }
