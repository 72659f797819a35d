"""Code generation: render a spec's schedule into a module of each backend (NumPy, PyTorch, JAX).

Every expression string comes from a printer and every helper from a runtime module
(``codegen.context`` gathers them); the Jinja templates in the ``symattn.templates``
package lay out only the scaffolding: header, imports, signatures, docstrings, returns.
``generate`` writes the modules atomically, or with ``check=True`` reports the
files that differ from what the templates render now.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import jinja2
import sympy as sp

from symattn.codegen.backends import BACKENDS, OPTIONAL_BACKENDS, Backend, backend_named
from symattn.codegen.emit import dropins as dropin_source
from symattn.codegen.emit.context import build_context
from symattn.codegen.emit.forward_mode import forward_mode_context
from symattn.codegen.emit.nn_module import module_fields
from symattn.codegen.emit.regimes import merged
from symattn.codegen.emit.second_order import second_order_context
from symattn.codegen.schedule.build import Schedule, schedule, schedule_spec
from symattn.codegen.schedule.regimes import Regime, regimes
from symattn.errors import SymattnError
from symattn.lang.dims import bind_dimensions
from symattn.lang.functions import TORCH
from symattn.lang.graph import nodes
from symattn.numeric.printers import runtime_functions
from symattn.optimize.cost import sizes_at
from symattn.optimize.position_blocks import SEED
from symattn.specs import Spec, family, specs

__all__ = [
    "BACKENDS",
    "VARIANTS",
    "context",
    "default_out_dir",
    "environment",
    "generate",
    "module_name",
    "remove_leftovers",
    "render",
    "write_atomically",
]

VARIANTS = ("standard", "memeff")
# A weight dimension that is a product of dimensions is passed under its CONTRACT.md name.
DIMENSION_ALIASES = {"H*d_k": "d_model"}


def module_name(spec_name: str, backend: str, variant: str = "standard") -> str:
    """The generated module's name: <spec>_<backend>, plus _memeff for the memory-efficient variant."""
    return f"{spec_name}_{backend}" + ("_memeff" if variant == "memeff" else "")


def package_folder(name: str):
    """The installed ``symattn.<name>`` package's folder, or, run from a source checkout that was never
    installed, the top-level ``<name>/`` folder the installed package is built from."""
    try:
        return resources.files(f"symattn.{name}")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / name


@functools.cache
def environment() -> jinja2.Environment:
    """Jinja with the installed ``symattn.templates`` package as its loader; undefined names are errors.
    One per process: it keeps the templates it compiled."""
    root = package_folder("templates")

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


def _module_parameters(sched: Schedule, printer) -> tuple[list[str], list[dict], list[dict]]:
    """Constructor parameters of the nn.Module, the dimensions they give, and the weights' shapes.

    The weights' dimensions are read as ``bind_dimensions`` reads them, in order: a dimension
    that is a weight's axis is a parameter; one that is a multiple (H·d_k) a parameter named
    by ``DIMENSION_ALIASES`` (d_model), divided; a fixed multiple (2·d_k, heads bound in the
    spec) the dimension itself (d_k), the weight's shape printed from it.
    """
    known: set = {o.symbol for o in sched.options}
    # a fixed constant is unbatched like a weight, but the module's forward takes it: no parameter
    weight_inputs = [x for x in sched.spec.matrix_inputs if str(x.name) in sched.weights - sched.fixed]
    plan = {(b.input, b.axis): b for b in bind_dimensions(weight_inputs, known)}
    params: list[str] = []
    bindings: list[dict] = []
    weights: list[dict] = []
    for w in weight_inputs:
        for axis, size in zip((-2, -1), map(sp.sympify, w.shape)):
            unknown = size.free_symbols - known
            if not unknown:
                continue
            b = plan.get((str(w.name), axis))
            coeff, rest = size.as_coeff_Mul()
            if b is not None and b.divisor == coeff and coeff.is_Integer and coeff > 0 and rest.is_Symbol:
                params.append(rest.name)  # 2·d_k: the constructor takes d_k
                known.add(rest)
                continue
            alias = size.name if size.is_Symbol else DIMENSION_ALIASES.get(sp.sstr(size))
            if b is None or alias is None or len(unknown) != 1:  # one unknown: bound in the plan's first pass
                raise SymattnError(f"weight {w.name}: no constructor parameter gives the dimension {size}")
            params.append(alias)
            if b.divisor is not None:
                divisor = printer.doprint(b.divisor)
                bindings.append(
                    {
                        "target": b.symbol.name,
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
    scalars = [name for name in sched.spec.input_names if name in sched.scalar_inputs]  # 0-d parameters
    weights += [{"name": name, "shape": "()", "bias": False} for name in scalars]
    return params, bindings, weights


def context(
    sched: Schedule | list[Regime],
    backend: Backend,
    version: str,
    variant: str = "standard",
    class_name: str | None = None,
    second_order: bool = True,
) -> dict:
    """Everything a module template needs, every expression already printed (see ``codegen.context``); of a
    schedule, or of one schedule per size regime (``schedule.regimes``: each function runs the cheapest one's
    statements at the sizes it is called with, ``emit.regimes``)."""
    found = sched if isinstance(sched, list) else [Regime(sched, sp.Integer(0))]
    firsts, seconds, forwards, kept, refused = [], [], [], [], []
    for r in found:
        try:
            ctx = build_context(r.schedule, backend, version, variant, class_name, _module_parameters)
        except SymattnError as e:  # a regime the variant cannot take (the memory-efficient cut of its orders)
            refused.append(e)
            continue
        kept.append(r)
        second = second_order_context(r.schedule, ctx, backend, version) if second_order else None
        printed = second["helpers"] if second else ()
        firsts.append(ctx)
        seconds.append(second)
        forwards.append(forward_mode_context(r.schedule, ctx, backend, version, variant, printed))
    if not kept:
        raise refused[0]
    ctx, second, forward = merged(firsts, seconds, forwards, kept, backend.printer())
    return ctx | {"second_order": second, "forward_mode": forward}


def render(
    source: str | Spec,
    backend: str,
    variant: str = "standard",
    regenerate: str = "symattn generate",
    *,
    second_order: bool = True,
    sizes: Mapping[str, int] | None = None,
    configuration: Mapping[str, object] | None = None,
) -> str:
    """The source of one generated module: of the built-in spec called source, or of a user's Spec.

    ``regenerate`` is the command its header names to write it again (a spec file's own command).
    ``second_order=False`` leaves the second closed form out: such a module raises on double backward
    and has no ``hvp`` (a first-order module, rendered in a fraction of the time). ``sizes`` (dimension name →
    size) prices the schedule's decisions at the sizes the user's model runs at (``cost.sizes_at``).
    ``configuration`` (option → value, of the built-in family's ``configured`` options) renders another member of
    the family than generated/ holds (the drop-in ``TransformerEncoderLayer`` renders its configuration so).
    """
    with sizes_at(sizes):
        return _render(source, backend, variant, regenerate, second_order, sizes, configuration)


def _render(
    source: str | Spec,
    backend: str,
    variant: str,
    regenerate: str,
    second_order: bool,
    sizes: Mapping[str, int] | None,
    configuration: Mapping[str, object] | None = None,
) -> str:
    from symattn.version import __version__

    target = backend_named(backend)
    if variant not in VARIANTS:
        raise SymattnError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if variant not in target.variants:
        raise SymattnError(
            f"the {backend} backend has no {variant} variant (only {', '.join(target.variants)}); "
            + target.missing_variant
        )
    chosen = tuple(sorted((configuration or {}).items()))
    if chosen and (isinstance(source, Spec) or target.renders is not None):
        where = "a user's Spec" if isinstance(source, Spec) else f"the {backend} backend"
        raise SymattnError(f"{where} takes no configuration (only a built-in family's torch, NumPy or JAX module)")
    if target.renders is not None:  # a backend with a renderer of its own (Triton: the kernels of the spec's core)
        return _tidy(target.renders(source, regenerate, environment(), functools.partial(module_class, source)))
    configured: dict = {}
    if isinstance(source, Spec):
        _require_bound_scalars(source)
        _require_own_names(source)
        sched, class_name, dropins = _regimes_of(source, lambda: schedule_spec(source), sizes), None, ()
    else:
        found = family(source)
        build = functools.partial(schedule.__wrapped__, source, extended=found.masks, configuration=chosen)
        sched, class_name = _regimes_of((source, found.masks, chosen), build, sizes), found.class_name
        dropins = found.dropins if target.dropins and variant == "standard" else ()
        configured = found.configuration(sched[0].schedule.spec) if dropins else {}
    ctx = context(sched, target, __version__, variant, class_name, second_order) | {"regenerate": regenerate}
    ctx |= {"dropin_names": list(dropins), "dropins": dropin_source.source(dropins)}
    ctx |= {"configuration": _python_dict(configured)}
    text = environment().get_template(target.template).render(**ctx)
    return _tidy(text)


# the torch module's nn.Module, as its template reads it: a backend rendering its own modules gives them the same class
def module_class(source: str | Spec) -> dict:
    """The torch module's nn.Module of a built-in (by name) or a user's Spec (``emit.nn_module.module_fields``:
    constructor, weights from ``_module_parameters``, extra_repr and the forward call), for a backend with a renderer
    of its own (Triton)."""
    if isinstance(source, Spec):
        sched, class_name = schedule_spec(source), None
    else:
        found = family(source)
        sched, class_name = schedule(source, extended=found.masks), found.class_name
    return module_fields(sched, backend_named(TORCH), class_name, _module_parameters)


# by the spec (a user's Spec by id: Specs hold dicts) and size table, a user's Spec kept so its id stays its own
_REGIMES: dict[tuple, tuple[object, list[Regime]]] = {}


def _regimes_of(source: object, build, sizes: Mapping[str, int] | None = None) -> list[Regime]:
    """The schedules of a spec (a user's Spec, or a built-in's (name, extended)), one per size regime at the size
    table, made once for all its backends and variants."""
    key = (id(source) if isinstance(source, Spec) else source, tuple(sorted((sizes or {}).items())))
    held = _REGIMES.get(key)
    if held is None or (held[0] is not source and isinstance(source, Spec)):
        if len(_REGIMES) >= 16:
            _REGIMES.clear()
        held = _REGIMES[key] = (source, regimes(build, sizes))
    return held[1]


def _require_bound_scalars(s: Spec) -> None:
    """A generated module reads every dimension off its inputs' shapes: a free scalar symbol has no source."""
    dims = {d for x in s.matrix_inputs for size in x.shape for d in sp.sympify(size).free_symbols}
    loose = sorted(str(x) for x in nodes(s.output) if isinstance(x, sp.Symbol) and x not in {*dims, *s.inputs})
    if loose:
        raise SymattnError(
            f"spec {s.name!r}: scalar symbol(s) {', '.join(loose)} are neither an input's dimension nor an input; "
            "list a trainable scalar in the inputs, or use a number"
        )


# names the generated code binds beside a spec's own: modules, the templates' variables and module constants
CODE_NAMES = frozenset(
    {
        *(name for b in BACKENDS.values() for name in b.imports),
        *("math", "annotations", "ctx", "self"),
        *("grad_out", "saved", "grads", "gradients", "cotangents", "inputs", "tensors", "options", "direction"),
        *("dtype", "device", "output_shape", "mask_shape", "vector_inputs", "forward", "backward", "hvp"),
        *("attn_mask", "key_padding_mask", "causal", "SPEC", "SHAPES", "OPTIONAL", "DIRECTION_OF", "INPUTS"),
        *("COTANGENT", "FUNCTION", "schedule", "costs", SEED),
    }
)
RUNTIMES = tuple(dict.fromkeys(module for b in BACKENDS.values() for module in b.runtimes))


@functools.cache
def reserved_names() -> frozenset[str]:
    """Names a spec's inputs, constants and intermediates may not take: the generated code's own (its helpers
    included), which such a name would shadow or be shadowed by."""
    return CODE_NAMES | {name for module in RUNTIMES for name in runtime_functions(module)}


def _require_own_names(s: Spec) -> None:
    """A spec's names must not be the generated code's (an input called row_softmax or grad_out)."""
    names = [str(x.name) for x in (*s.inputs, *s.constants)] + [label for label, _ in s.intermediates]
    dims = {str(d) for x in s.matrix_inputs for size in x.shape for d in sp.sympify(size).free_symbols}
    clash = sorted(set(names) & (reserved_names() | dims))  # a dimension is a variable of the code too
    if clash:
        raise SymattnError(
            f"spec {s.name!r}: {', '.join(map(repr, clash))} named in the spec is a name of the generated code "
            "(a module, helper or variable of its own); rename it"
        )


def _python_dict(values: Mapping[str, object]) -> str:
    """A dict of names to bools, numbers and strings as Python source, ruff's format (double quotes)."""
    text = (json.dumps(v) if isinstance(v, str) else repr(v) for v in values.values())
    return "{" + ", ".join(f"{json.dumps(name)}: {v}" for name, v in zip(values, text)) + "}"


def _tidy(text: str) -> str:
    """At most two blank lines in a row (optional template sections leave more)."""
    return re.sub(r"\n{4,}", "\n\n\n", text)


def default_out_dir() -> Path:
    """The folder of the installed ``symattn.generated`` package."""
    return Path(str(package_folder("generated")))


def generate(
    sources: list[str | Spec] | None = None,
    backends: list[str] | None = None,
    variants: list[str] | None = None,
    out: Path | str | None = None,
    check: bool = False,
    regenerate: str = "symattn generate",
    order: int = 2,
    sizes: Mapping[str, int] | None = None,
) -> list[Path]:
    """Render the modules of built-in specs (by name) or users' Specs; write them (atomically) or, with check,
    write nothing.

    Backends default to BACKENDS, and for a built-in the OPTIONAL_BACKENDS too (Triton: every built-in has the n × m
    core its kernels compute); variants default to every one a built-in family has, and to the standard one for a
    user's Spec;
    ``order=1`` leaves the second closed form out, ``sizes`` prices decisions at a user's sizes (see ``render``).
    Returns the files that were stale:
    missing or different from what renders now (after a write, the ones that were rewritten).
    """
    out_dir = Path(out) if out is not None else default_out_dir()
    rendered: dict[Path, str] = {}
    for source in sources or specs():
        builtin = None if isinstance(source, Spec) else family(source)
        name = source.name if isinstance(source, Spec) else source
        for backend in backends or [*BACKENDS, *(OPTIONAL_BACKENDS if builtin else ())]:
            for variant in variants or (VARIANTS if builtin else ("standard",)):
                if variant == "memeff" and builtin is not None and not builtin.row_blocks:
                    continue  # no memory-efficient cut for this spec
                if variant not in backend_named(backend).variants and not (backends and variants):
                    continue  # asked for every backend or every variant: the pairs that exist
                path = out_dir / f"{module_name(name, backend, variant)}.py"
                rendered[path] = render(source, backend, variant, regenerate, second_order=order == 2, sizes=sizes)
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
