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
dimensions in the generated modules); the others are batched activations. A spec that lists
its parameters by name (``Spec.parameters``, as ``sa.from_torch`` does) decides for itself.
"""

from __future__ import annotations

import runpy
import traceback
from pathlib import Path

from sympy.matrices.exceptions import ShapeError

from symattn.errors import ShapeMismatchError, SymattnError
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
    except ShapeError as err:  # SymPy names neither operand: find them on its stack
        raise SpecFileError(f"spec file {path}{_line_in(path, err)}: {what}{_shape_mismatch(err)}") from None
    except Exception as err:  # the user's code: report it in one line, whatever it raised
        raise SpecFileError(f"spec file {path}{_line_in(path, err)}: {what}{type(err).__name__}: {err}") from None


def _shape_mismatch(err: ShapeError) -> str:
    """SymPy's ShapeError as symattn's message: the operation, both operands and both shapes."""
    for frame, _ in reversed(list(traceback.walk_tb(err.__traceback__))):
        found = frame.f_locals
        if frame.f_code.co_name == "validate_matmul_integer" and "A" in found and "B" in found:
            left, right = found["A"], found["B"]
            return str(ShapeMismatchError(f"matrix product {left}*{right}", left.shape, right.shape))
        if frame.f_code.co_name == "validate_matadd_integer" and found.get("args"):
            first = found["args"][0]
            other = next((a for a in found["args"] if a.shape != first.shape), first)
            return str(ShapeMismatchError(f"sum or entrywise product of {first} and {other}", first.shape, other.shape))
    return f"ShapeError: {err}"


def _line_in(path: Path, err: BaseException) -> str:
    """', line N' for the deepest line of the spec file on err's traceback ('' if none)."""
    target = str(path.resolve())
    line = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if str(Path(frame.f_code.co_filename).resolve()) == target:
            line = lineno
    return f", line {line}" if line is not None else ""
