"""The Triton module's lines whose length depends on the spec, laid out as ruff format lays them out (``emit.layout``):
signatures, calls, tuples and dicts, so that a rendered module is ruff-format clean without running ruff."""

from __future__ import annotations

import ast
import textwrap

from symattn.codegen.backends.triton.eager import eager_body
from symattn.codegen.emit import layout

WRAP = 110  # docstring lines


def wrapped_text(text: str, indent: int = 0) -> list[str]:
    """text as docstring lines of at most WRAP columns at indent."""
    return textwrap.wrap(text, WRAP - indent, break_long_words=False, break_on_hyphens=False)


def docs(ctx: dict) -> dict:
    """The docstrings' lines that hold the spec's math and names, wrapped."""
    cores = ctx["cores"]
    tiles = [t for c in cores for t in c["gradient_tiles"]]
    computed = "; ".join(
        f"{c['core_output']} = {c['normaliser_math']}{' V' if c['value'] else ''}, A = {c['logits_math']}, S = Q Kᵀ"
        + ("" if len(cores) == 1 else f" (Q = {c['query_math']}, K = {c['key_math']}, V = {c['value_math']})")
        for c in cores
    )
    core = (
        f"The kernels compute the n × m core{'s' if len(cores) > 1 else ''} {computed}, block by block: no n × m "
        "array is made" + (f" but the gradients of {', '.join(tiles)} (where they require grad)." if tiles else ".")
    )
    factors = "Q, K, V" if len(cores) > 1 else f"Q = {cores[0]['query_math']}, K = {cores[0]['key_math']}"
    if len(cores) == 1:
        factors += f", V = {cores[0]['value_math']}" if cores[0]["value"] else ""
    if ctx["rest_outside"]:
        around = (
            f"{factors} and what the output makes of the cores ({ctx['output']} = {ctx['rest_math']}) are torch "
            "code, differentiated by autograd."
        )
    else:
        around = f"{factors} are torch code, differentiated by autograd."
    order = "the spec's inputs, then its constants" if ctx["constants"] else "the spec's inputs"
    returns = (
        f"Returns {ctx['output']} of shape (..., {ctx['output_shape']}); the core by the Triton kernels, "
        "differentiable (their backward; forward mode by the JVP kernel: torch.func.jvp). "
        f"Arguments: {', '.join(ctx['input_names'])}, in this order ({order}), or by name."
    )
    given = ("the masks (they do not move), " if ctx["constants"] else "") + ("the options " if ctx["options"] else "")
    tangents = (
        "tangents: a dict from input names to tensors of their shapes (an input left out: zero there); "
        f"{given}and causal as forward takes them."
    )
    return {
        "about": [*wrapped_text(core), *wrapped_text(around)],
        "returns_doc": wrapped_text(returns, 4),
        "tangents_doc": wrapped_text(tangents, 4),
    }


def bare(code: str) -> str:
    """code without one pair of brackets around the whole of it (ruff drops them on an assignment's right side)."""
    if not (code.startswith("(") and code.endswith(")")):
        return code
    depth = 0
    for i, ch in enumerate(code):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(code) - 1:
            return code  # the first bracket closes before the end: (a) + (b)
    return code[1:-1]


def returned_tuple(items: list[str], indent: int) -> str:
    """return (items): () for none, (x,) for one, else as ruff format breaks a tuple."""
    if not items:
        return "return ()"
    if len(items) == 1:
        return f"return ({items[0]},)"
    return layout.wrapped("return ", items, "", indent, "()")


def returned_dict(pairs: list[tuple[str, str]], indent: int) -> str:
    """return {key: value, …} ({} for none), broken over lines as ruff format would."""
    return layout.wrapped("return ", [f"{k}: {v}" for k, v in pairs], "", indent, "{}")


def laid_out(ctx: dict) -> dict:
    """The context's spec-dependent lines, laid out: the signatures, the calls between forward, jvp and _compute, the
    inputs' axes, each core's factors and call, and the tuples of names."""
    call = ctx["call"].split(", ")
    keywords = [f"{k}={k}" for k in ["causal", *(["attn_mask", "key_padding_mask"] if ctx["additive_mask"] else [])]]
    constants = [c for c in ctx["constant_call"].split(", ") if c]
    factors, calls = [], []
    for core in ctx["cores"]:
        c = core["c"]
        named = (("core_q" + c, core["query"]), ("core_k" + c, core["key"]), ("core_v" + c, core["value"]))
        factors += [f"{name} = {layout.assigned(name, code, 4)}" for name, code in named if code is not None]
        factors += [core["seed"]] if core["seed"] else []  # dropout's seed, drawn once per call
        value = "None" if core["value"] is None else "core_v" + c  # a map core has no V
        tensors = ["_CORE" + c, "core_q" + c, "core_k" + c, value, "causal", "deterministic", "symbols"]
        tensors += core["tensor_arguments"]
        calls.append(layout.wrapped(f"{core['core_output']} = _kernels", tensors, "", 4, "()"))
    return {
        "define_forward": layout.define("forward", ctx["signature"].split(", "), 0),
        "define_jvp": layout.define("jvp", ctx["jvp_signature"].split(", "), 0),
        "define_compute": layout.define(
            "_compute", ["_kernels", *call, *(k.split("=")[0] for k in keywords), "deterministic=True"], 0
        ),
        "forward_call": layout.call("_compute", ["_core", *call, *keywords, "deterministic=deterministic"], 4),
        "jvp_call": layout.wrapped("out = _compute", ["_core_dual", "*duals", *constants, *keywords], "", 8, "()"),
        "duals": layout.wrapped("duals = _duals", ["tangents", *ctx["tangent_inputs"]], "", 8, "()"),
        "define_hvp": layout.define("hvp", ctx["hvp_signature"].split(", "), 0),
        "leaves": layout.wrapped("leaves = _leaves", ctx["tangent_inputs"], "", 8, "()"),
        "hvp_call": layout.wrapped("out = _compute", ["_core", "*leaves", *constants, *keywords], "", 8, "()"),
        "dimensions": layout.wrapped("dims = _dimensions", [x["name"] for x in ctx["matrices"]], "", 4, "()"),
        "factors": factors,
        "core_calls": calls,
        "rest_line": f"return {layout.assigned('return', ctx['rest'], 4)}",
        "symbols_line": layout.wrapped("symbols = ", [f'"{s}": {s}' for s in ctx["symbols"]], "", 4, "{}"),
        "tangent_of": layout.assign_tuple("TANGENT_OF", [f'"{name}"' for name in ctx["tangent_inputs"]], 0),
        "axes": [f'"{x["name"]}": {x["axes"]},' for x in ctx["matrices"]],
    } | docs(ctx)


def core_lines(ctx: dict, core: dict) -> dict:
    """One core's spec-dependent lines (``_triton_core.j2``), its names suffixed by core["c"]."""
    c, tiles = core["c"], core["tiles"]
    moving = [t for t in tiles if t["tangent"]]
    return {
        "define_coefficients": layout.define("_coefficients" + c, core["coefficient_parameters"], 0),
        "define_tangent_coefficients": layout.define("_tangent_coefficients" + c, core["tangent_parameters"], 0),
        "coefficients_return": returned_tuple([x["code"] for x in core["coefficients"]], 4),
        "tangent_coefficients_return": returned_tuple([x["code"] for x in core["tangent_coefficients"]], 4),
        "flags_return": returned_dict(
            [(f'"HAS_{t["name"]}"', f"tiles[{t['index']}] is not None") for t in tiles if t["optional"]], 4
        ),
        "tangent_flags_return": returned_dict(
            [(f'"TANGENT_{t["name"]}"', f"moving[{i}] is not None") for i, t in enumerate(moving)], 4
        ),
        "gradient_index": layout.assign_tuple(
            "GRADIENT_INDEX" + c, [str(t["index"]) for t in tiles if t["gradient"]], 0
        ),
        "gradient_flags": layout.assign_tuple(
            "GRADIENT_FLAGS" + c, [f'"GRAD_{t["name"]}"' for t in tiles if t["gradient"]], 0
        ),
        "bare_logits": bare(core["logits"]),
        "eager_body": eager_body(core),
    }


def deterministic_module(module: dict) -> dict:
    """The torch module's nn.Module fields (``nn_module.torch_module``) for the Triton module: its forward call passes
    ``deterministic=self.deterministic``, the class attribute that sets the backward's mode (the template's)."""
    (returned,) = ast.parse(module["module_call"].strip()).body
    call = returned.value
    arguments = [ast.unparse(a) for a in call.args] + [f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords]
    return module | {"module_call": layout.call("forward", [*arguments, "deterministic=self.deterministic"], 8)}
