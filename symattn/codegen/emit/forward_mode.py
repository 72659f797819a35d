"""The forward mode of a generated module: ``jvp``, the output and its closed-form derivative along tangents.

``codegen.schedule.forward_mode`` schedules Ẏ = Σ_i ∂F/∂x_i [ẋ_i] as the first forward followed by one
tangent per forward value; ``build_context`` prints it into ``_jvp`` (inputs, then tangents, then the mask
and its tangent, then the options), and the public ``jvp(<inputs>, tangents, **options)`` takes the
tangents as a dict by input name (an input left out: zero). The JAX module also wraps its forward in a
``jax.custom_jvp`` whose rule is ``_jvp`` (``forward_jvp``), which ``jax.jvp``, ``jax.jacfwd`` and
``jax.hessian`` apply to. A spec with a node that has no forward rule has no ``jvp`` (None here).
"""

from __future__ import annotations

from symattn.codegen.backends import Backend
from symattn.codegen.emit import layout
from symattn.codegen.emit.context import build_context
from symattn.codegen.emit.nn_module import MASK_KEYWORDS
from symattn.codegen.emit.second_order import COPIED_INPUTS, _no_module, _wrapped_section
from symattn.codegen.emit.sections import _uses
from symattn.codegen.schedule.build import Schedule
from symattn.codegen.schedule.forward_mode import jvp_schedule
from symattn.errors import SymattnError

__all__ = ["forward_mode_context"]


_CACHE: dict[int, tuple[Schedule, tuple | None]] = {}  # by id: Specs hold dicts


def _jvp_schedule(first: Schedule) -> tuple | None:
    """The JVP's spec and schedule for a first schedule, made once for all its backends and variants (None: a
    node without a forward rule)."""
    held = _CACHE.get(id(first))
    if held is not None and held[0] is first:
        return held[1]
    try:
        found = jvp_schedule(first)
    except SymattnError:
        found = None
    _CACHE[id(first)] = (first, found)  # the schedule is kept alive, so its id is not reused
    return found


def forward_mode_context(
    first: Schedule, first_context: dict, backend: Backend, version: str, variant: str = "standard", printed=()
) -> dict | None:
    """What the templates need to print ``_jvp`` and ``jvp`` beside the first closed form (None: the spec has
    a node with no forward rule, or fixed constants among its inputs). The memory-efficient variant's goes
    through blocks of query rows like its forward (``rowblocks.plan``): Ȧ_b, Ṗ_b, Ȯ_b beside A_b, P_b, O_b."""
    if first.fixed:
        return None
    found = _jvp_schedule(first)
    if found is None:
        return None
    fm, sched = found
    try:  # (a memory-efficient cut its tangents do not fit)
        # torch.func's jacfwd runs the torch Function's jvp under vmap: nothing in place (Backend.vmapped)
        ctx = build_context(
            sched, backend, version, variant, first_context["class_name"], _no_module, not backend.vmapped
        )
    except SymattnError:
        return None
    mask = ctx["mask"]
    tangent_of = dict(fm.tangents)
    inputs = [str(x.name) for x in first.spec.inputs]
    mask_pair = [mask, tangent_of[mask]] if mask else []
    # (the memory-efficient variant's block_size among them, after causal, which its loop writes block by block)
    options = ctx["block_causal"] + [o["name"] for o in ctx["options"]]
    positional = [*inputs, *(tangent_of[x] for x in inputs), *mask_pair, *options]
    required = [x for x in inputs if x not in first.optional]
    maybe = [f"{x}=None" for x in inputs if x in first.optional]
    keywords = [o["name"] + ("=None" if o["default"] is not None else "") for o in ctx["options"]] + maybe
    keywords += list(MASK_KEYWORDS) if mask else []
    printer = backend.printer()
    zeros = [
        {"name": tangent_of[x.name], "zeros": printer.zeros_like(str(x.name))}
        for x in first.spec.inputs
        if str(x.name) not in first.optional
    ]
    printed = {*first_context["helpers"], *printed}  # the runtime helpers the module has already (printed: f₂'s)
    helpers = [h for h in ctx["helpers"] if h not in printed] + list(backend.forward_mode_helpers)
    lines = [line.value for sec in ctx["forward_sections"] for line in (*sec.get("lines", []), *sec.get("body", []))]
    arrays = [*inputs, *[mask] * bool(mask)]
    passed = [o["name"] for o in ctx["options"] if o["passed"]]
    custom_jvp = None
    if backend.custom_jvp:  # JAX: forward_jvp, the forward whose custom_jvp rule is _jvp
        signature = layout.define("forward_jvp", [*required, *["*"] * bool(keywords), *keywords], indent=0)
        custom_jvp = _custom_jvp(arrays, passed, options, tangent_of, positional) | {"signature": signature}
    return {
        "route": _route(required, keywords) if backend.routes else None,
        "custom_jvp": custom_jvp,
        **{key: ctx[key] for key in COPIED_INPUTS},
        "runtime": printer.runtime_source(helpers) + "\n\n\n" if helpers else "",
        "helpers": helpers,
        "needs_dtype": _uses("dtype", lines) or _uses("device", lines),
        "primal": str(first.output.name),
        "tangent_names": {x: tangent_of[x] for x in inputs},
        "tangents_tuple": layout.assign_tuple("OPTIONAL +", [f'"{tangent_of[x]}"' for x in inputs], 0)[
            len("OPTIONAL + = ") :
        ],
        "zeros": zeros,
        "sections": [_wrapped_section(sec) for sec in ctx["forward_sections"]],
        "expected": [x | {"optional": x["optional"] or x["name"] in tangent_of.values()} for x in ctx["expected"]],
        "define": layout.define("_jvp", positional, indent=0),
        "signature": layout.define("jvp", [*required, "tangents", *["*"] * bool(keywords), *keywords], indent=0),
        "call": layout.wrapped(
            "return _jvp",
            [
                *inputs,
                *(f'tangents.get("{x}")' for x in inputs),
                *[mask, "None"] * bool(mask),
                *options,
            ],
            "",
            indent=4,
            brackets="()",
        ),
    }


def _route(required: list[str], keywords: list[str]) -> dict:
    """jvp's hand-over on CUDA to the JVP kernel of the spec's Triton module (whose jvp takes the same arguments, and
    blocks of its own: block_size is not handed on): the call that decides (every tensor argument and tangent) and
    the call that hands over."""
    names = [k.partition("=")[0] for k in keywords]
    checked = [*required, *names, "*_tangents(tangents).values()"]
    handed = [*required, "tangents", *(f"{n}={n}" for n in names if n != "block_size")]
    return {
        "call": layout.wrapped("kernels = _kernels_for", checked, "", 4, "()"),
        "kernels_call": layout.wrapped("return kernels.jvp", handed, "", 8, "()"),
    }


def _custom_jvp(arrays: list, passed: list, options: list, tangent_of: dict, positional: list) -> dict:
    """JAX's forward_jvp: the custom_jvp rule _primal_jvp (the static options first, then the primals and their
    tangents) calling _jvp, and its entry's call. A passed option (a key) is a primal of no tangent, as in the
    custom_vjp."""
    static = [o for o in options if o not in passed]
    return {
        "define_rule": layout.define("_primal_jvp", [*static, "primals", "tangents"], indent=0),
        "unpack_primals": layout.unpacked([*arrays, *passed], "primals", 4),
        "unpack_tangents": layout.unpacked([*(tangent_of[x] for x in arrays), *["_"] * len(passed)], "tangents", 4),
        "call": layout.wrapped("return _jvp", positional, "", 4, "()"),
        "entry_call": layout.call("_forward_mode", [*arrays, *passed, *static], indent=4),
    }
