"""Evaluate expressions of symattn's language: print them as NumPy source and compile.

Dimensions are bound at call time from the arguments' shapes (a symbol n that is a
dimension of an argument takes that axis' length), so one compiled function serves
every size and every leading batch shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import count

import numpy as np
import sympy as sp
from sympy import Basic, MatrixSymbol

from symattn.errors import ShapeMismatchError, SymattnError
from symattn.lang.dims import LENGTH, Binding, bind_dimensions
from symattn.lang.functions import NUMPY
from symattn.lang.lazy import plain
from symattn.lang.naming.safe import expression
from symattn.lang.shapes import check_shapes, dimension_symbols
from symattn.numeric.printers import ExactPrinter, ExpAtom, NumPyMatrixPrinter

PRINTERS = {p.backend: p for p in (NumPyMatrixPrinter, ExactPrinter)}
_serial = count()


def _bind_dimensions(args, values, plan: Sequence[Binding], fixed: Mapping) -> dict:
    """Dimension values for these arrays, checked against every argument's shape."""
    lengths = {(str(a.name), axis): sp.Integer(np.shape(v)[axis]) for a, v in zip(args, values) for axis in (-2, -1)}
    bound = {s: sp.Integer(v) for s, v in fixed.items()}
    for b in plan:
        bound[b.symbol] = b.formula.xreplace({LENGTH: lengths[(b.input, b.axis)]}).xreplace(bound)
    expected = [tuple(sp.sympify(d).xreplace(bound) for d in a.shape) for a in args]
    given = [tuple(np.shape(v)[-2:]) for v in values]
    if any(tuple(e) != g for e, g in zip(expected, given)):
        raise ShapeMismatchError(
            "arguments " + ", ".join(a.name for a in args), tuple(map(tuple, expected)), tuple(given)
        )
    return {s: int(v) for s, v in bound.items()}


def lambdify(
    args: Sequence[MatrixSymbol],
    expr: Basic,
    backend: str = NUMPY,
    sum_batch: bool = False,
    dims: Mapping | None = None,
) -> Callable:
    """A function of arrays for the arguments that returns expr's value.

    Leading batch dimensions broadcast. With ``sum_batch`` the result is summed over
    its leading dimensions (the gradient of a weight shared across the batch).
    ``dims`` fixes dimensions that no argument's shape determines (e.g. heads H).
    ``backend="exact"`` evaluates object arrays of SymPy numbers exactly. A scalar ``Symbol`` among
    the arguments (a trainable scalar such as a temperature τ) takes a number.
    """
    if backend not in PRINTERS:
        raise SymattnError(f"unknown backend {backend!r}; choose from {', '.join(PRINTERS)}")
    args = [plain(a) for a in args]
    for a in args:
        if not isinstance(a, (MatrixSymbol, sp.Symbol)):
            kind = type(a).__name__
            raise SymattnError(f"lambdify arguments must be MatrixSymbols or scalar Symbols, got {kind} {a}")
    matrices = [a for a in args if isinstance(a, MatrixSymbol)]
    expr = expression(expr)
    check_shapes(expr)
    missing = {s for s in expr.atoms(MatrixSymbol)} - set(args)
    if missing:
        raise SymattnError(f"expression uses {', '.join(sorted(m.name for m in missing))} not among the arguments")
    printer = PRINTERS[backend]()
    body = printer.doprint(expr)
    scalars = {a for a in args if isinstance(a, sp.Symbol)}
    dim_symbols = [s for s in dimension_symbols(expr, *matrices) if s not in scalars]
    names = [a.name for a in args]
    source = printer.helper_source() + "\n\ndef _evaluate({}):\n    return {}\n".format(
        ", ".join(names + [s.name for s in dim_symbols]), body
    )
    namespace: dict = {"np": np, "sp": sp, "ExpAtom": ExpAtom}
    filename = f"<symattn-lambdify-{next(_serial)}>"
    exec(compile(source, filename, "exec"), namespace)
    evaluate = namespace["_evaluate"]
    fixed = {sp.Symbol(k) if isinstance(k, str) else k: v for k, v in (dims or {}).items()}
    fixed = {next((s for s in dim_symbols if s.name == k.name), k): v for k, v in fixed.items()}
    plan = bind_dimensions(matrices, {s for s in dim_symbols if s.name in {k.name for k in fixed}}, solve=True)

    def function(*values):
        if len(values) != len(args):
            raise TypeError(f"expected {len(args)} arrays ({', '.join(names)}), got {len(values)}")
        for a, v in zip(args, values):
            if isinstance(a, MatrixSymbol) and np.ndim(v) < 2:
                raise ShapeMismatchError(f"argument {a.name} (needs at least 2 axes)", a.shape, np.shape(v))
        arrays = [v for a, v in zip(args, values) if isinstance(a, MatrixSymbol)]
        bound = _bind_dimensions(matrices, arrays, plan, fixed)
        unbound = [s for s in dim_symbols if s not in bound]
        if unbound:
            raise SymattnError(f"dimension {unbound[0]} is fixed by no argument; pass dims={{{unbound[0].name!r}: …}}")
        out = evaluate(*values, *(bound[s] for s in dim_symbols))
        if sum_batch and np.ndim(out) > 2:
            out = np.sum(out, axis=tuple(range(np.ndim(out) - 2)))
        return out

    function.source = source
    # names only: printing expr itself re-expands a shared (DAG) expression as a tree
    function.__doc__ = f"Evaluate an expression of {', '.join(names)} ({backend})."
    return function
