"""User-defined specs: a Python file that builds a forward expression in symattn's language.

The file is the user's own code and is executed as it is. It defines ``spec``, either
a ``symattn.Spec`` or a function returning one (called with the ``--option KEY=VALUE``
options as keywords)::

    import sympy as sp
    import symattn as sa
    from symattn.specs import dim

    n, d_model, d_k = dim("n"), dim("d_model"), dim("d_k")
    X = sp.MatrixSymbol("X", n, d_model)
    W_Q = sp.MatrixSymbol("W_Q", d_model, d_k)
    ...
    spec = sa.Spec("my_attention", "one line of math", (X, W_Q, ...), output, intermediates)

Inputs named ``W_…``, ``b_…``, ``gamma_…``, ``beta_…`` are parameters (no batch
dimensions in the generated modules); the others are batched activations.
"""

from __future__ import annotations

import runpy
import traceback
from pathlib import Path

import sympy as sp

from symattn.errors import SymattnError
from symattn.specs import Spec


class SpecFileError(SymattnError):
    """A spec file that is missing, fails to run, or defines no usable spec."""


def load_spec_file(path: str | Path, **options) -> Spec:
    """Run the file and return its ``spec`` (a Spec, or a function of the options returning one)."""
    path = Path(path)
    if not path.exists():
        raise SpecFileError(f"spec file {path}: no such file")
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise SpecFileError(f"spec file {path}: {kind} (give a Python file that defines `spec`)")
    namespace = _run_user_code(path, lambda: runpy.run_path(str(path), run_name="__symattn_spec__"))
    if "spec" not in namespace:
        raise SpecFileError(f"spec file {path}: defines no `spec` (a symattn.Spec or a function returning one)")
    found = namespace["spec"]
    if callable(found) and not isinstance(found, Spec):
        found = _run_user_code(path, lambda: found(**options), "spec(): ")
    elif options:
        raise SpecFileError(
            f"spec file {path}: `spec` is not a function, so it takes no options ({', '.join(options)})"
        )
    if not isinstance(found, Spec):
        raise SpecFileError(f"spec file {path}: `spec` is a {type(found).__name__}, not a symattn.Spec")
    return found


def _run_user_code(path: Path, run, what: str = ""):
    """run(), with whatever the user's code raises (or a sys.exit) reported as one line naming its line."""
    try:
        return run()
    except SymattnError as err:
        raise SpecFileError(f"spec file {path}{_line_in(path, err)}: {what}{err}") from None
    except SystemExit as err:
        raise SpecFileError(f"spec file {path}: {what}the file called sys.exit({err.code!r})") from None
    except RecursionError:
        raise SpecFileError(f"spec file {path}: {what}RecursionError (the expression nests too deeply)") from None
    except Exception as err:  # the user's code: report it in one line, whatever it raised
        raise SpecFileError(f"spec file {path}{_line_in(path, err)}: {what}{type(err).__name__}: {err}") from None


def _line_in(path: Path, err: BaseException) -> str:
    """', line N' for the deepest line of the spec file on err's traceback ('' if none)."""
    target = str(path.resolve())
    line = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if str(Path(frame.f_code.co_filename).resolve()) == target:
            line = lineno
    return f", line {line}" if line is not None else ""


def render_spec(s: Spec, backend: str, variant: str = "standard") -> str:
    """The source of the generated module of a user's spec (dimensions read off the inputs' shapes)."""
    import re

    from symattn import __version__
    from symattn.codegen import BACKENDS, VARIANTS, context, environment
    from symattn.schedule import schedule_spec

    if backend not in BACKENDS or variant not in VARIANTS:
        raise SymattnError(f"unknown backend {backend!r} or variant {variant!r}")
    dims = {d for x in s.inputs for size in x.shape for d in sp.sympify(size).free_symbols}
    loose = sorted(str(x) for x in s.output.free_symbols if isinstance(x, sp.Symbol) and x not in dims)
    if loose:  # a generated module reads every dimension off its inputs' shapes; a free scalar has no source
        raise SpecFileError(
            f"spec {s.name!r}: scalar symbol(s) {', '.join(loose)} are no input's dimension, and a generated "
            "module has no keyword for them; use a number"
        )
    text = (
        environment()
        .get_template(f"{backend}_module.py.j2")
        .render(**context(schedule_spec(s), backend, __version__, variant))
    )
    return re.sub(r"\n{4,}", "\n\n\n", text)  # as codegen's own modules: at most two blank lines in a row


def generate_spec(
    s: Spec, backends: list[str] | None, variants: list[str] | None, out: Path | str, check: bool = False
) -> list[Path]:
    """Write <spec>_<backend>[_memeff].py into out (atomically), or with check write nothing; the stale files."""
    from symattn.codegen import BACKENDS, module_name, remove_leftovers, write_atomically

    out_dir = Path(out)
    rendered = {
        out_dir / f"{module_name(s.name, backend, variant)}.py": render_spec(s, backend, variant)
        for backend in backends or BACKENDS
        for variant in variants or ["standard"]
    }
    stale = [path for path, text in rendered.items() if not path.is_file() or path.read_bytes() != text.encode()]
    if not check:
        remove_leftovers(rendered)
    if not check and stale:
        write_atomically({path: rendered[path] for path in stale})
    return stale
