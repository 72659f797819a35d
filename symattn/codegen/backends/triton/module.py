"""The Triton module of a spec: its cores' kernels, launches and autograd Functions (``templates/_triton_core.j2``,
once per core, the entrywise lines printed by ``printer``), the torch code around them
(``templates/triton_module.py.j2``) and the runtime helpers both call, copied from their modules (``runtime_*.py``).

Q, K, V and what the spec's output makes of O are printed by the torch backend's printer and differentiated by
autograd; the core O = N(A) V is a ``torch.autograd.Function`` whose forward and backward launch the kernels.
"""

from __future__ import annotations

import re

import jinja2
import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
from symattn.codegen.backends.triton.bindings import binding_lines, lines_of
from symattn.codegen.backends.triton.core import Core, find_cores, mixed_rows
from symattn.codegen.backends.triton.eager import ring_record
from symattn.codegen.backends.triton.lines import bare, core_lines, deterministic_module, laid_out
from symattn.codegen.backends.triton.positions import eager_grid, index_checks, kernel_grid
from symattn.codegen.backends.triton.printer import (
    Printed,
    dropout_draws,
    print_core,
    tangent_symbol,
    tangent_tile_name,
    tile_name,
)
from symattn.codegen.backends.triton.runtime import TRITON_RUNTIME, called_helpers
from symattn.codegen.emit.block_maps import test_code
from symattn.codegen.schedule.build import split_constants
from symattn.codegen.schedule.dag import is_weight
from symattn.derive.formats.latex import text as plain_text
from symattn.errors import SymattnError
from symattn.lang.graph import postorder
from symattn.lang.ops import LogSoftmax, RowSoftmax, SplitHeads
from symattn.lang.piecewise import RNG, TRAINING
from symattn.numeric.printers import runtime_source
from symattn.optimize.mask_structure import hidden
from symattn.specs import Option, Spec, family
from symattn.specs.spec import drawn_options

TEMPLATE = "triton_module.py.j2"
CORE_TEMPLATE = "_triton_core.j2"  # one core's kernels and Function, rendered once per core
# the docstring of the options a spec that drops out takes (``drawn_options``)
DRAWN = {
    TRAINING: "default True: dropout draws its mask (False: no draw, the spec without dropout)",
    RNG: "the torch.Generator dropout's seed is drawn from (default None: torch's default one)",
}
# P = N(A) of each normaliser
NORMALISED = {
    "row softmax": f"{RowSoftmax.text}(A)",
    "row sum": "A ⊘ rowsum(A) 𝟏ᵀ",
    "none": "A",
    "log-softmax": f"{LogSoftmax.text}(A)",
}


def triton_spec(source: str | Spec) -> tuple[Spec, tuple[Option, ...]]:
    """The spec of a built-in (by name, every optional part on: its mask) or a user's Spec, and its options."""
    if isinstance(source, Spec):
        spec, options = source, ()
    else:
        found = family(source)
        spec, options = found.generated_spec(found.masks)
    return spec, (*options, *drawn_options(spec, options))  # training and rng, where the spec drops out


def triton_context(spec: Spec, options: tuple[Option, ...], version: str) -> dict:
    """Everything ``triton_module.py.j2`` needs, every expression already printed; ``cores``: each core's context
    for ``_triton_core.j2`` (its kernels and Function, its names suffixed by its number where there are several)."""
    found = find_cores(spec)
    constants = frozenset(str(x.name) for x in spec.constants)
    torch_printer = TorchMatrixPrinter()
    printed = [print_core(core, constants) for core in found.cores]
    every = [c for p in printed for c in (*p.coefficients, *p.tangent_coefficients)]
    scalars = {str(x) for core in found.cores for x in core.scalars}
    scalars |= {str(tangent_symbol(x)) for core in found.cores for x in core.scalars}
    symbols = sorted({str(s) for c in every for s in sp.sympify(c).free_symbols} - scalars)
    bound = {line.binds for line in lines_of(spec, options, torch_printer.doprint)}
    missing = [s for s in symbols if s not in bound and s not in {o.name for o in options}]
    if missing:
        raise SymattnError(f"{spec.name}: the Triton module has no value for {', '.join(sorted(set(missing)))}")
    several = len(found.cores) > 1
    cores = [
        _core_context(core, p, str(i + 1) if several else "", constants, symbols, torch_printer)
        for i, (core, p) in enumerate(zip(found.cores, printed))
    ]
    rest = torch_printer.doprint(found.rest)
    code = [rest, *(c[k] for c in cores for k in ("query", "key", "value", "seed") if c[k] is not None)]
    read = {name for name in bound if name in symbols or any(re.search(rf"\b{name}\b", c) for c in code)}
    return {
        "version": version,
        "spec": spec.name,
        "summary": spec.summary,
        "cores": cores,
        # the online softmax's exponentials and its row statistic, base 2: A₂ = log₂(e)·A (``printer.in_base_2``)
        "exp_call": "tl.exp2",
        "log_call": "tl.log2",
        "rest_math": plain_text(found.rest),
        "mixed_rows": repr(mixed_rows(found)),
        "rest_outside": several or found.rest != found.cores[0].output,
        "output": next((name for name, e in spec.intermediates if e == spec.output), "the output"),
        "output_shape": ", ".join(map(str, spec.output.shape)),
        "inputs": _inputs(spec),
        "matrices": [{"name": str(x.name), "axes": _axes(x)} for x in spec.matrix_inputs],
        "bindings": binding_lines(spec, options, torch_printer.doprint, read),
        "spec_scalars": [str(x) for x in spec.inputs if isinstance(x, sp.Symbol)],
        "symbols": symbols,
        "constants": [str(x.name) for x in spec.constants],
        "options": [{"name": o.name, "default_math": DRAWN.get(o.name) or _default(o.default)} for o in options],
        "per_head": any(c["per_head"] for c in cores),
        "index_checks": index_checks(tuple(core.logits for core in found.cores), torch_printer.helper),
        "rest": rest,
        "helpers": torch_printer.helper_source() if torch_printer.helpers_used else "",
        "torch_helpers": sorted(torch_printer.helpers_used),
    } | _calls(spec, options)


def _default(value: Basic | None) -> str:
    """An option's default as the docstring writes it."""
    return "required" if value is None else f"default {plain_text(value)}"


def _core_context(core: Core, printed: Printed, c: str, constants: frozenset[str], symbols: list[str], printer) -> dict:
    """One core's part of the context: its kernels' printed steps, its tiles and scalars, Q, K and V printed by the
    torch printer; c, the suffix of its names ("" for a spec's one core)."""
    scalars = [str(x) for x in core.scalars]
    tiles = [
        {
            "name": str(t.name),
            "tile": tile_name(t),
            "index": i,
            "optional": str(t.name) in constants,
            "gradient": printed.tile_gradients.get(str(t.name)),
            "kept": str(t.name) in printed.tiles_kept,  # its gradient tile needs the mask's where
            "tangent": None if str(t.name) in constants else tangent_tile_name(t),
        }
        for i, t in enumerate(core.tiles)
    ]
    first = len(tiles) + len(scalars)  # the tables' places among the Function's tensors: after the scalars
    tables = [
        {
            "name": str(t.name),
            "index": first + i,
            "place": i,
            "reads": printed.table_gradients.get(str(t.name), ()),
            "learned": str(t.name) not in constants,
        }
        for i, t in enumerate(core.tables)
    ]
    coefficient_code, tangent_code = (
        [{"name": name, "code": printer.doprint(e), "math": plain_text(e)} for e, name in found.items()]
        for found in (printed.coefficients, printed.tangent_coefficients)
    )
    for i, x in enumerate(coefficient_code + tangent_code):
        x["index"] = i  # its place in the kernels' C (the JVP's: the tangent ones after)
    return _read_by_kernel(
        _core_fields(core, printed, c, symbols, printer, tiles, tables, coefficient_code, tangent_code)
        | {"ring": _ring(core, constants)}
    )


def _read_by_kernel(context: dict) -> dict:
    """The context with the scalar arguments the forward and JVP kernels read (``forward_coefficients``,
    ``jvp_coefficients``): those whose names their spec-dependent lines print (A, its shared calls, the tiles of
    positions, the key window; and Ȧ's), so that no kernel loads one it does not read (the backward reads them all)."""
    window = context["window"] or {}
    forward = [
        context["logits"],
        *context["logits_lines"],
        *context["positions"],
        *(x for v in window.values() for x in v),
    ]
    tangent = [context["logits_tangent"], *context["tangent_lines"], *context["tangent_positions"]]

    def read(found: list[dict], texts: list[str]) -> list[dict]:
        return [x for x in found if any(re.search(rf"\b{x['name']}\b", t) for t in texts)]

    every = context["coefficients"] + context["tangent_coefficients"]
    return context | {"forward_coefficients": read(every, forward), "jvp_coefficients": read(every, forward + tangent)}


def _core_fields(core, printed, c, symbols, printer, tiles, tables, coefficient_code, tangent_code) -> dict:
    """The fields of one core's context (``_core_context``)."""
    scalars = [str(x) for x in core.scalars]
    scalar_tangents = [str(tangent_symbol(x)) for x in core.scalars]
    per_head = any(isinstance(x, SplitHeads) for x in postorder(core.query))
    return {
        "c": c,
        "normaliser": core.normaliser,
        "grouped": core.grouped,
        "normalised": core.normaliser == "row softmax",
        "normaliser_math": NORMALISED[core.normaliser],
        "logits_math": plain_text(core.logits),
        "query_math": plain_text(core.query),
        "key_math": plain_text(core.key),
        "value_math": "" if core.value is None else plain_text(core.value),
        "gradient_tiles": [t["name"] for t in tiles if t["gradient"]],
        "core_output": str(core.output.name),
        "scalars": [{"name": name, "partial": printed.scalar_partials[name]} for name in scalars],
        "coefficient_parameters": symbols + scalars,
        "coefficients": coefficient_code,
        "tangent_coefficients": tangent_code,
        "tangent_parameters": symbols + scalars + scalar_tangents,
        "scalar_tangents": scalar_tangents,
        "logits_tangent": printed.logits_tangent,
        "tiles": tiles,
        "tables": tables,
        "tensor_names": [t["name"] for t in tiles]
        + scalars
        + [t["name"] for t in tables]
        + ([f"core_seed{c}"] if core.dropout is not None else []),
        # the kernels' call: a table read in a core whose heads the module splits, its heads axis inserted
        # (``_by_sequence``: one per sequence, broadcast over the heads)
        "tensor_arguments": [t["name"] for t in tiles]
        + scalars
        + [f"_by_sequence({t['name']})" if per_head else t["name"] for t in tables]
        + ([f"core_seed{c}"] if core.dropout is not None else []),
        # dropout of the weights: its draws' code, and the seed's line (drawn per call, the core's last tensor)
        "dropout": None if core.dropout is None else dropout_draws(core.dropout),
        "seed": None if core.dropout is None else f"core_seed{c} = _seed({TRAINING}, {RNG}, core_q{c})",
        "logits": printed.logits,
        "eager_logits": bare(printed.eager_logits),
        "scores_gradient": printed.scores_gradient,
        "scores_scale": printed.scores_scale,
        "scores_kept": printed.scores_kept,
        "logits_lines": [_bare_line(x) for x in printed.logits_lines],
        "gradient_lines": [_bare_line(x) for x in printed.gradient_lines],
        "tangent_lines": [_bare_line(x) for x in printed.tangent_lines],
        "per_head": per_head,
        **_positions(printed),
        "block_map": _block_map(core, printed, printer),
        "query": printer.doprint(core.query),
        "key": printer.doprint(core.key),
        "value": None if core.value is None else printer.doprint(core.value),  # None: a map, O = N(A)
    }


def _block_map(core: Core, printed: Printed, printer) -> dict | None:
    """The code of a core's block map (``positions.block_map_formula``; None: none): its test and reads printed by
    the torch printer (``emit.block_maps.test_code``) over its tables, each bound from the kernels' tables (``first``:
    one of them, whose dtype and device the map takes)."""
    if printed.block_map is None:
        return None
    formula = printed.block_map
    read = sorted({e.parent for e in formula.atoms(MatrixElement)}, key=str)
    named = {t: MatrixSymbol(f"table_{t.name}", *t.shape) for t in read}
    bounds, empty, full, reads = test_code(formula.xreplace(named), printer, "n", "m")
    places = {str(t.name): i for i, t in enumerate(core.tables)}  # (the formula's tables sized n and m: by name)
    return {
        "bounds": bounds,
        "empty": empty,
        "full": full,
        "reads": reads,
        "classes": printer.helper("block_classes"),
        "tables": [f"{named[t].name} = _narrowed(tables[{places[str(t.name)]}])" for t in read],
        "first": str(named[read[0]].name),
        "math": str(hidden(printed.block_map)),
    }


def _ring(core: Core, constants: frozenset[str]) -> dict:
    """What context parallelism reads of a core (``symattn.distributed``): its normaliser, the names of its query and
    key lengths (a formula reading them reads the whole sequence's there; None: not a dimension's name), whether it
    drops out, which of its tiles is the additive mask a key_padding_mask adds to (None: none) and how many of its
    tensors are n × m tiles (its first; scalars and tables after them); ``merge``: its
    eager form gives a block of keys' share (a map's output is n × m: none)."""
    rows = ", ".join(f'"{x}"' if isinstance(x, sp.Symbol) else "None" for x in (core.query.shape[0], core.key.shape[0]))
    masks = [i for i, t in enumerate(core.tiles) if str(t.name) in constants]
    mask = masks[0] if len(masks) == 1 else None
    dropout = core.dropout is not None
    fields = f'"rows": ({rows}), "dropout": {dropout}, "mask": {mask}, "tiles": {len(core.tiles)}'
    record = f'{{"normaliser": "{core.normaliser}", {fields}}}'
    return {"merge": core.value is not None and ring_record(core.normaliser), "record": record}


def _positions(printed: Printed) -> dict:
    """The lines making a core's tiles of positions (``positions``): the grids of the tile's positions (a transposed
    tile's too), then each tile; those only the JVP reads; those only the tables' gradients read; the eager core's.
    Empty where the core reads none."""

    def lines(found: tuple[tuple[str, str], ...], flag: str) -> list[str]:
        return [_position_line(name, code, printed.open_positions.get(name), flag) for name, code in found]

    kernel, transposed = lines(printed.positions, "MASKED"), lines(printed.positions, "part != 1")
    eager = [f"{name} = {bare(code)}" for name, code in printed.eager_positions]
    window = printed.window
    return {
        "positions": kernel and kernel_grid(printed.heads) + kernel,
        "transposed_positions": transposed and kernel_grid(printed.heads, transposed=True) + transposed,
        "tangent_positions": lines(printed.tangent_positions, "MASKED"),
        "gradient_positions": lines(printed.gradient_positions, "MASKED"),
        "eager_positions": eager and eager_grid(printed.eager_heads) + eager,
        "window": window
        and {
            "key_bounds": [bare(x) for x in window.keys],
            "row_bounds": [bare(x) for x in window.rows],
            "key_parts": [_bare_line(x) for x in window.key_parts],
            "row_parts": [_bare_line(x) for x in window.row_parts],
        },
    }


def _bare_line(line: str) -> str:
    """name = code, without one pair of brackets around the code (as ruff writes it)."""
    name, code = line.split(" = ", 1)
    return f"{name} = {bare(code)}"


def _position_line(name: str, code: str, open_code: str | None, flag: str) -> str:
    """A tile of positions: its formula; a mask's on the tiles the flag marks (the others every row sees whole:
    its −∞ never reached, its where left out) and its code without −∞ on the others."""
    if open_code is None:
        return f"{name} = {bare(code)}"
    return (
        f"if {flag}:\n    {name} = {bare(code)}\nelse:  # a tile every row sees whole\n    {name} = {bare(open_code)}"
    )


def _calls(spec: Spec, options: tuple[Option, ...]) -> dict:
    """The module's signatures and the calls between its functions: forward's and jvp's parameters, the bias rows that
    may be left out, the parameter rows also taken 1-D (viewed), the mask keywords (a spec with an additive mask,
    ``split_constants``: the torch module's) and how they are passed on."""
    rows, mask = _rows(spec), split_constants(spec)[0]
    masks = "" if mask is None else str(mask.name)
    given = [str(x.name) for x in (*spec.inputs, *spec.constants)]
    return {
        "signature": _signature(spec, options, rows),
        "jvp_signature": _jvp_signature(spec, options, rows),
        "hvp_signature": _jvp_signature(spec, options, rows).replace("tangents, *", "grad_out, direction, *", 1),
        "rows": rows,
        "viewed": [str(x.name) for x in spec.matrix_inputs if is_weight(x, spec.parameters) and x.shape[0] == 1],
        "additive_mask": masks,
        "mask_call": ", attn_mask=attn_mask, key_padding_mask=key_padding_mask" if masks else "",
        "tangent_inputs": [str(x.name) for x in spec.inputs],
        "constant_call": "".join(f"{name}={name}, " for name in given[len(spec.inputs) :] + [o.name for o in options]),
        "call": ", ".join([*given, *(o.name for o in options)]),
        "input_names": given,
    }


def _axes(x: Basic) -> str:
    """The Python tuple of x's two axes: a dimension's name (a string) or an int."""
    sizes = [sp.sympify(s) for s in x.shape]
    return "(" + ", ".join(str(int(s)) if s.is_Integer else f'"{s}"' for s in sizes) + ")"


def _inputs(spec: Spec) -> list[dict]:
    """Each input and constant with its shape as the module's docstring writes it."""
    out = []
    for x in (*spec.inputs, *spec.constants):
        if isinstance(x, sp.Symbol):
            out.append({"name": str(x), "shape_text": "() (a trainable scalar)"})
        else:
            out.append({"name": str(x.name), "shape_text": f"(..., {', '.join(map(str, x.shape))})"})
    return out


def _rows(spec: Spec) -> list[str]:
    """The trailing bias rows (1 × k) that may be left out (None adds nothing): the built-ins' b_… inputs beside a
    mask, as the torch modules have them optional (``schedule.build``'s rule); a user's spec has none."""
    if not spec.constants or spec.parameters is not None:
        return []
    rows = []
    for x in reversed(spec.inputs):
        if not isinstance(x, MatrixSymbol) or x.shape[0] != 1 or not str(x.name).startswith("b_"):
            break
        rows.insert(0, str(x.name))
    return rows


def _signature(spec: Spec, options: tuple[Option, ...], rows: list[str]) -> str:
    """The inputs positionally (a bias row None by default), the constants after them (None: absent), then the options,
    the mask keywords where there is one mask, causal and deterministic (the backward's mode) by keyword."""
    names = [f"{x.name}=None" if str(x.name) in rows else str(x.name) for x in spec.inputs]
    names += [f"{x.name}=None" for x in spec.constants]
    return ", ".join([*names, "*", *_keywords(spec, options), "causal=False", "deterministic=True"])


def _keywords(spec: Spec, options: tuple[Option, ...]) -> list[str]:
    """The options as keyword parameters (a required one, a head count, without a default), then the mask's."""
    masks = ["attn_mask=None", "key_padding_mask=None"] if split_constants(spec)[0] is not None else []
    return [o.name if o.default is None else f"{o.name}=None" for o in options] + masks


def _jvp_signature(spec: Spec, options: tuple[Option, ...], rows: list[str]) -> str:
    """The inputs positionally, then the tangents; the biases, constants, options and causal by keyword."""
    names = [str(x.name) for x in spec.inputs if str(x.name) not in rows] + ["tangents", "*"]
    names += [f"{name}=None" for name in rows] + [f"{x.name}=None" for x in spec.constants]
    return ", ".join([*names, *_keywords(spec, options), "causal=False"])


def render_triton(source: str | Spec, regenerate: str, environment: jinja2.Environment, module_class) -> str:
    """The source of the Triton module of a built-in spec (by name) or a user's Spec, by environment's templates;
    module_class() is the torch module's nn.Module (``generate.module_class``), the Triton module's the same. The
    module is rendered once without its runtime helpers, to read which it calls, then with their source."""
    from symattn.version import __version__

    spec, options = triton_spec(source)
    module = deterministic_module(module_class())
    ctx = triton_context(spec, options, __version__) | {"regenerate": regenerate, "module": module}
    ctx |= laid_out(ctx) | {"bare": bare}  # bare: an unmasked tile's value, printed as ruff prints it
    core = environment.get_template(CORE_TEMPLATE)
    sections = [core.render(**(ctx | each | core_lines(ctx, each))) for each in ctx["cores"]]
    template = environment.get_template(TEMPLATE)
    helpers = called_helpers(template.render(**ctx, core_sections=sections, runtime=ctx["helpers"]))
    clash = set(helpers) & set(ctx["torch_helpers"])
    if clash:  # two definitions of one name: the later would replace the other's
        raise RuntimeError(f"{spec.name}: helpers in the torch and Triton runtimes: {', '.join(sorted(clash))}")
    runtime = "\n\n\n".join(part for part in (runtime_source(TRITON_RUNTIME, helpers), ctx["helpers"]) if part)
    return template.render(**ctx, core_sections=sections, runtime=runtime)
