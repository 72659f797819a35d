"""Code generation: render a spec's schedule into a NumPy or PyTorch module.

Every expression string comes from a printer (``torch_printer``); the Jinja
templates in the ``symattn.templates`` package lay out only the scaffolding:
header, imports, signatures, docstrings, input checks, saved values, returns.
``generate`` writes the modules atomically, or with ``check=True`` reports the
files that differ from what the templates render now.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import textwrap
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
import sympy as sp
from sympy.matrices.expressions import HadamardPower, HadamardProduct, MatAdd, MatMul

from symattn.codegen import layout
from symattn.codegen.printers import GeneratedNumPyPrinter, TorchMatrixPrinter
from symattn.codegen.schedule import Assignment, Schedule, schedule, schedule_spec
from symattn.errors import SymattnError
from symattn.lang.ops import Elementwise, RowSoftmax, SplitHeads
from symattn.specs import Option, Spec, family, specs

BACKENDS = ("numpy", "torch")
VARIANTS = ("standard", "memeff")
PRINTERS = {"numpy": GeneratedNumPyPrinter, "torch": TorchMatrixPrinter}
# The keywords of a module whose spec has an additive mask M (built from them at run time).
MASK_KEYWORDS = ("attn_mask=None", "key_padding_mask=None", "causal=False")
MASK_NAMES = tuple(k.partition("=")[0] for k in MASK_KEYWORDS)
# A weight dimension that is a product of dimensions is passed under its CONTRACT.md name.
DIMENSION_ALIASES = {"H*d_k": "d_model"}


@dataclass(frozen=True)
class Statement:
    """One line of generated code: target = value (value printed by a printer)."""

    target: str
    value: str
    comment: str = ""
    guard: str = ""  # an optional input: the statement runs only when it was given (else the target is None)


def module_name(spec_name: str, backend: str, variant: str = "standard") -> str:
    """The generated module's name: <spec>_<backend>, plus _memeff for the memory-efficient variant."""
    return f"{spec_name}_{backend}" + ("_memeff" if variant == "memeff" else "")


def environment() -> jinja2.Environment:
    """Jinja with the installed ``symattn.templates`` package as its loader; undefined names are errors."""
    root = resources.files("symattn.templates")

    def load(name: str) -> str:
        return (root / name).read_text(encoding="utf-8")

    return jinja2.Environment(
        loader=jinja2.FunctionLoader(load),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _math(a: Assignment) -> str:
    """An assignment as a line of the docstring's math (plain unicode, as `symattn derive --format text`)."""
    from symattn.derive.latex import text

    return f"{a.target.name} = {text(a.value)}"


def _wrap(lines: list[str], width: int = 110) -> list[str]:
    """Math lines wrapped to fit the docstring, continuations indented."""
    out: list[str] = []
    for line in lines:
        out.extend(textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False) or [""])
    return out


FRESH = (MatMul, MatAdd, HadamardProduct, HadamardPower, RowSoftmax, Elementwise)


def _dying(assignments: list[Assignment], protected: set) -> list[frozenset]:
    """For each assignment, the arrays it may overwrite: made earlier in this scope as fresh arrays
    (not views), read exactly once here and never again, neither saved nor returned."""
    fresh: set[str] = set()
    out = []
    for i, a in enumerate(assignments):
        reads = Counter(str(x.name) for x in sp.preorder_traversal(a.value) if isinstance(x, sp.MatrixSymbol))
        later = {str(x.name) for b in assignments[i + 1 :] for x in b.value.atoms(sp.MatrixSymbol)}
        out.append(frozenset(name for name, k in reads.items() if k == 1 and name in fresh - later - protected))
        if isinstance(a.value, FRESH) and not (isinstance(a.value, MatMul) and len(a.value.args) < 2):
            fresh.add(str(a.target.name))
    return out


def _read_elsewhere(assignments: list[Assignment], targets: set) -> set:
    """The targets that another assignment reads."""
    return {t for t in targets if any(a.target != t and t in a.value.atoms(sp.MatrixSymbol) for a in assignments)}


def docstring_text(text: str) -> str:
    """text as it may stand inside a triple-quoted docstring: backslashes and quotes escaped."""
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _nonempty_call(sched: Schedule) -> str:
    """The check that every dimension read off the inputs is at least 1, but the query rows (the first input's)."""
    first = sched.inputs[0]
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


def _text(expr: sp.Basic) -> str:
    from symattn.derive.latex import text

    return text(expr)


def _uses(name: str, texts: list[str]) -> bool:
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")
    return any(pattern.search(t) for t in texts)


def _shape_text(printer, x: sp.MatrixSymbol, weights: frozenset) -> str:
    dims = ", ".join(printer.doprint(d) for d in x.shape)
    return f"({dims})" if str(x.name) in weights else f"(..., {dims})"


def _module_parameters(sched: Schedule, printer) -> tuple[list[str], list[dict], list[dict]]:
    """Constructor parameters of the nn.Module, the dimensions they give, and the weights' shapes."""
    known: set = {o.symbol for o in sched.options}
    params: list[str] = []
    bindings: list[dict] = []
    weights: list[dict] = []
    for w in (x for x in sched.inputs if str(x.name) in sched.weights):
        for size in map(sp.sympify, w.shape):
            unknown = size.free_symbols - known
            if not unknown:
                continue
            if size.is_Symbol:
                params.append(size.name)
            else:
                alias = DIMENSION_ALIASES.get(sp.sstr(size))
                if alias is None or len(unknown) != 1:
                    raise SymattnError(f"weight {w.name}: no constructor parameter gives the dimension {size}")
                (dimension,) = unknown
                divisor = printer.doprint(size / dimension)
                params.append(alias)
                bindings.append(
                    {
                        "target": dimension.name,
                        "value": f"{alias} // {divisor}",
                        "remainder": f"{alias} % {divisor}",
                        "size": alias,
                        "divisor": divisor,
                    }
                )
            known |= unknown
        weights.append(
            {
                "name": str(w.name),
                "shape": ", ".join(printer.doprint(d) for d in w.shape),
                "bias": str(w.name) in sched.optional,
            }
        )
    return params, bindings, weights


def context(
    sched: Schedule, backend: str, version: str, variant: str = "standard", class_name: str | None = None
) -> dict:
    """Everything a module template needs, every expression already printed."""
    printer = PRINTERS[backend]()
    s = sched.spec
    optional = sched.optional
    mask = next((str(c.name) for c in s.constants if str(c.name) in optional), None)
    printer.optional, printer.mask = optional | {f"{name}_b" for name in optional}, mask
    required = [x for x in s.inputs if str(x.name) not in optional]
    maybe = [x for x in s.inputs if str(x.name) in optional]  # optional inputs, passed by keyword
    batched = {str(x.name) for x in s.inputs if str(x.name) not in sched.weights} | {str(sched.seed.name)}
    batched |= {str(a.target.name) for a in (*sched.forward, *sched.backward) if sched.is_batched(a.value)}
    batched |= {f"{name}_b" for name in batched} | {"L", "L_b"}  # blocks of rows (memory-efficient variant)

    def statement(a: Assignment, consumable: frozenset = frozenset()) -> Statement:
        printer.consumable = consumable
        if a.target in unused:  # the output does not read this input: zeros of its full (batched) shape and dtype
            text = printer.zeros_like(unused[a.target])
        elif a.reduce_batch:
            text = printer.weight_gradient(a.value, batched)
        else:
            text = printer.doprint(a.value)
        printer.consumable = frozenset()
        # the gradient of an optional input is computed only when the input was given
        return Statement(str(a.target.name), text, a.comment, gradient_of.get(a.target, ""))

    def lines(assignments) -> dict:
        dying = _dying(list(assignments), protected)
        return {"loop": False, "lines": [statement(a, d) for a, d in zip(assignments, dying)]}

    def loop(lp) -> dict:
        kept = protected | {str(b.name) for _, b in lp.collect}
        dying = _dying([*lp.body, *lp.accumulate], kept)
        body = [statement(a, d) for a, d in zip(lp.body, dying)]
        if lp.softmax is not None:  # P_b, L_b = row_softmax_lse(A_b), right after A_b
            p_b, l_b, a_b = lp.softmax
            call = f"{printer.helper('row_softmax_lse')}({a_b.name})"
            if mask is not None:
                call += f" if {mask} is None else {printer.helper('masked_row_softmax_lse')}({a_b.name})"
            body.insert(1, Statement(f"{p_b.name}, {l_b.name}", call))
        return {
            "loop": True,
            "rows": f"{lp.rows_of}.shape[-2]",
            "slices": [
                {"block": str(b.name), "full": str(f.name), "optional": str(f.name) in optional} for b, f in lp.slices
            ],
            "body": body,
            "collect": [
                {"full": str(f.name), "block": str(b.name), "concat": printer.concatenate_rows(f"{f.name}_blocks")}
                for f, b in lp.collect
            ],
            "accumulate": [statement(a, d) for a, d in zip(lp.accumulate, dying[len(lp.body) :])],
        }

    gradient_of = {t: name for name, t in sched.gradients if name in optional}
    unused = {t: name for name, t in sched.gradients for a in sched.backward if a.target == t and a.value.is_ZeroMatrix}
    protected = {str(getattr(x, "name", x)) for x in sched.saved} | {str(sched.output.name), "L"}
    protected |= {str(t.name) for _, t in sched.gradients}
    options = list(sched.options)
    if variant == "memeff":
        from symattn.codegen.rowblocks import BLOCK_SIZE, plan

        cut = plan(sched)
        backward_assignments = [*cut.backward[0], *cut.backward[1].body, *cut.backward[1].accumulate, *cut.backward[2]]
    else:
        backward_assignments = list(sched.backward)
    # The gradient of an optional input that other lines read (dbeta_2 = db_1 W_1ᵀ) is computed whatever the
    # input; only the value returned for it is None when the input was.
    shared = _read_elsewhere(backward_assignments, set(gradient_of))
    gradient_of = {t: name for t, name in gradient_of.items() if t not in shared}
    if variant == "memeff":
        forward_sections = [lines(cut.forward[0]), loop(cut.forward[1]), lines(cut.forward[2])]
        backward_sections = [lines(cut.backward[0]), loop(cut.backward[1]), lines(cut.backward[2])]
        saved_symbols = cut.saved
        options.append(
            Option("block_size", sp.Symbol("block_size", positive=True, integer=True), sp.Integer(BLOCK_SIZE))
        )
    else:
        forward_sections = [lines(sched.forward)]
        backward_sections = [lines(sched.backward)]
        saved_symbols = sched.saved
    forward = [line for sec in forward_sections for line in sec.get("lines", sec.get("body", []))]
    backward = [
        line
        for sec in backward_sections
        for line in sec.get("lines", []) + sec.get("body", []) + sec.get("accumulate", [])
    ]
    constants = [Statement(c.name, printer.doprint(v)) for c, v in sched.constants]
    backward_text = (
        [b.value for b in backward]
        + [b.guard for b in backward]
        + [sl["full"] for sec in backward_sections for sl in sec.get("slices", [])]
        + [name for name, t in sched.gradients if t in shared]  # returned as None when the input was None
    )
    saved = [str(getattr(x, "name", x)) for x in saved_symbols] + [str(x.name) for x in maybe] + [mask] * bool(mask)
    saved += [name for name in unused.values() if name not in saved]  # their zero gradients take their shapes
    saved = [name for name in saved if _uses(name, backward_text)] + (["block_size"] if variant == "memeff" else [])
    bindings = []
    for b in sched.bindings:
        read = f"{b.input}.shape[{b.axis}]"
        if b.divisor is None:
            bindings.append(Statement(b.symbol.name, read))
        else:
            divisor = printer.doprint(b.divisor)
            bindings.append(Statement(b.symbol.name, f'_quotient("{b.input}", tuple({b.input}.shape), {divisor})'))
    params, module_bindings, weights = _module_parameters(sched, PRINTERS[backend]())
    class_name = class_name or "".join(p.title() for p in s.name.split("_"))
    positional = [str(x.name) for x in s.inputs] + ([mask] if mask else []) + [o.name for o in options]
    by_name = {o.name: o for o in options}
    signature = (
        [str(x.name) for x in required]
        + ["*"] * bool(options or maybe or mask)
        + [o.name + ("=None" if o.default is not None else "") for o in options]
        + [f"{x.name}=None" for x in maybe]
        + (list(MASK_KEYWORDS) if mask else [])
    )
    return {
        "version": version,
        "backend": backend,
        "spec": s.name,
        "summary": docstring_text(s.summary),
        "class_name": class_name,
        "inputs": [
            {
                "name": str(x.name),
                "shape": _shape_text(printer, x, sched.weights),
                "weight": str(x.name) in sched.weights,
                "optional": str(x.name) in optional,
            }
            for x in s.inputs
        ],
        "expected": [
            {
                "name": str(x.name),
                "dims": ", ".join(printer.doprint(d) for d in x.shape),
                "optional": str(x.name) in optional,
            }
            for x in s.inputs
        ],
        "mask": mask,
        "heads_axis": any(isinstance(n, SplitHeads) for a in sched.forward for n in sp.preorder_traversal(a.value)),
        "biases": [str(x.name) for x in maybe],
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
                "default": None if o.default is None else printer.doprint(o.default),
                "default_math": None if o.default is None else sp.sstr(o.default),
            }
            for o in options
        ],
        "bindings": bindings,
        "divides": any(b.divisor is not None for b in sched.bindings),
        "constants": constants,
        "forward": forward,
        "forward_sections": forward_sections,
        "backward_sections": backward_sections,
        "variant_note": ", memory-efficient variant" if variant == "memeff" else "",
        "output": str(sched.output.name),
        "output_shape": ", ".join(printer.doprint(d) for d in sched.output.shape),
        "saved": saved,
        "seed": str(sched.seed.name),
        "backward": backward,
        "gradients": [{"name": name, "target": str(t.name)} for name, t in sched.gradients],
        "forward_math": _wrap(
            [f"{c.name} = {sp.sstr(v)}" for c, v in sched.constants] + [_math(a) for a in sched.forward]
        ),
        "backward_math": _wrap([_math(a) for a in sched.backward]),
        "nonempty": _nonempty_call(sched),
        "helpers": printer.helper_source(),
        "needs_dtype": _uses("dtype", [line.value for line in forward + backward]),
        "ambiguous": any(str(a.target.name) in ("O", "I", "l") for a in (*sched.forward, *sched.backward)),
        "input_names": [str(x.name) for x in s.inputs],
        "input_dict": "{" + ", ".join(f'"{x.name}": {x.name}' for x in s.inputs) + "}",
        "checked_inputs": layout.checked_inputs(s.inputs, "_arrays" if backend == "numpy" else "_tensors"),
        "signature": layout.define("forward", signature, indent=0),
        "apply_call": layout.call(f"{class_name}Function.apply", positional, indent=4),
        "init_signature": layout.define(
            "__init__",
            ["self", *params]
            + ["*"] * bool(options)
            + [o.name + ("=None" if o.default is not None else "") for o in options]
            + ["bias=False"] * bool(maybe)
            + ["device=None", "dtype=None"] * bool(weights),
            indent=4,
        ),
        "gradient_dict": "{" + ", ".join(f'"{name}": {t.name}' for name, t in sched.gradients) + "}",
        "return_gradients": layout.wrapped(
            "return " if not maybe or backend == "torch" else "grads = ",
            [
                f'"{name}": None if {name} is None else {t.name}' if t in shared else f'"{name}": {t.name}'
                for name, t in sched.gradients
            ],
            "",
            indent=4,
            brackets="{}",
        ),
        "optional_names": "(" + ", ".join(f'"{x.name}"' for x in maybe) + ("," if len(maybe) == 1 else "") + ")",
        "drop_none": bool(maybe),
        "module_params": params,
        "module_bindings": module_bindings,
        "weights": weights,
        "weight_names": [w["name"] for w in weights],
        "module_doc": layout.module_doc(s.name, [w["name"] for w in weights]),
        "function_gradients": layout.assign_tuple(
            "gradients", [f'grads["{x.name}"]' for x in s.inputs] + ["None"] * (len(options) + bool(mask)), indent=8
        ),
        "tensor_inputs": layout.wrapped(
            "inputs = _only_tensors", [str(x.name) for x in s.inputs] + [mask] * bool(mask), "", 8, brackets="()"
        ),
        "module_call": layout.call(
            "forward",
            [str(x.name) if x.name not in sched.weights else f"self.{x.name}" for x in required]
            + [f"{o.name}=self.{o.name}" for o in options]
            + [f"{x.name}=self.{x.name}" for x in maybe]
            + [f"{k}={k}" for k in MASK_NAMES if mask],
            indent=8,
        ),
        "module_inputs": [str(x.name) for x in required if str(x.name) not in sched.weights],
        "mask_keywords": list(MASK_KEYWORDS) if mask else [],
        "mask_query": str(s.inputs[0].name),
        "mask_key": next((str(x.name) for x in s.inputs if mask and x.shape[0] == s.constants[0].shape[1]), ""),
        "positional": ", ".join(positional),
        "define_forward": layout.define("_forward", positional, indent=0),
        "define_function_forward": layout.define("forward", ["ctx", *positional], indent=4),
        "call_forward": layout.wrapped(
            f"{sched.output.name}, saved = _forward", positional, "", indent=8, brackets="()"
        ),
    }


def render(source: str | Spec, backend: str, variant: str = "standard") -> str:
    """The source of one generated module: of the built-in spec called source, or of a user's Spec."""
    from symattn import __version__

    if backend not in BACKENDS:
        raise SymattnError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if variant not in VARIANTS:
        raise SymattnError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if isinstance(source, Spec):
        _require_bound_scalars(source)
        sched, class_name = schedule_spec(source), None
    else:
        found = family(source)
        sched, class_name = schedule(source, extended=found.masks), found.class_name
    ctx = context(sched, backend, __version__, variant, class_name)
    text = environment().get_template(f"{backend}_module.py.j2").render(**ctx)
    return _tidy(text)


def _require_bound_scalars(s: Spec) -> None:
    """A generated module reads every dimension off its inputs' shapes: a free scalar symbol has no source."""
    dims = {d for x in s.inputs for size in x.shape for d in sp.sympify(size).free_symbols}
    loose = sorted(str(x) for x in s.output.free_symbols if isinstance(x, sp.Symbol) and x not in dims)
    if loose:
        raise SymattnError(
            f"spec {s.name!r}: scalar symbol(s) {', '.join(loose)} are no input's dimension, and a generated "
            "module has no keyword for them; use a number"
        )


def _tidy(text: str) -> str:
    """At most two blank lines in a row (optional template sections leave more)."""
    return re.sub(r"\n{4,}", "\n\n\n", text)


def default_out_dir() -> Path:
    """The folder of the installed ``symattn.generated`` package."""
    return Path(str(resources.files("symattn.generated")))


def generate(
    sources: list[str | Spec] | None = None,
    backends: list[str] | None = None,
    variants: list[str] | None = None,
    out: Path | str | None = None,
    check: bool = False,
) -> list[Path]:
    """Render the modules of built-in specs (by name) or users' Specs; write them (atomically) or, with check,
    write nothing.

    Variants default to every one a built-in family has, and to the standard one for a user's Spec.
    Returns the files that were stale: missing or different from what renders now (after a write,
    the ones that were rewritten).
    """
    out_dir = Path(out) if out is not None else default_out_dir()
    rendered: dict[Path, str] = {}
    for source in sources or specs():
        builtin = None if isinstance(source, Spec) else family(source)
        name = source.name if isinstance(source, Spec) else source
        for backend in backends or BACKENDS:
            for variant in variants or (VARIANTS if builtin else ("standard",)):
                if variant == "memeff" and builtin is not None and not builtin.row_blocks:
                    continue  # no memory-efficient cut for this spec
                rendered[out_dir / f"{module_name(name, backend, variant)}.py"] = render(source, backend, variant)
    stale = [path for path, text in rendered.items() if not path.is_file() or path.read_bytes() != text.encode()]
    if not check:
        remove_leftovers(rendered)  # a run killed mid-write (kill -9) leaves its temporary files behind
        if stale:
            write_atomically({path: rendered[path] for path in stale})
    return stale


def _temporary_prefix(path: Path) -> str:
    """The name write_atomically's temporary files for path start with (they end with .tmp)."""
    return f".{path.name}."


def remove_leftovers(paths) -> list[Path]:
    """Delete the temporary files an interrupted write of these paths left beside them; the ones deleted.

    Only names of write_atomically's own pattern, .<module>.py.<random>.tmp, for the modules written here.
    """
    removed = []
    for path in paths:
        if not path.parent.is_dir():
            continue
        for leftover in path.parent.glob(f"{glob.escape(_temporary_prefix(path))}*.tmp"):
            if leftover.is_file() and not leftover.is_symlink():
                leftover.unlink(missing_ok=True)
                removed.append(leftover)
    return removed


def write_atomically(files: dict[Path, str]) -> None:
    """Write every file or none: each goes to a temporary file beside it, then all are renamed in place.

    On any failure, no temporary file is left; leftovers of an earlier, killed write are removed first.
    """
    remove_leftovers(files)
    temporary: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path), suffix=".tmp")
            temporary.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode())
        for tmp, path in temporary:
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    finally:  # after the renames none exists; after a failure, the ones not renamed are deleted
        for tmp, _ in temporary:
            Path(tmp).unlink(missing_ok=True)
