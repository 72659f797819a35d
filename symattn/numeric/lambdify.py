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
from symattn.lang.safe import expression
from symattn.lang.shapes import check_shapes, dimension_symbols
from symattn.numeric.printers import ExactPrinter, ExpAtom, NumPyMatrixPrinter

PRINTERS = {"numpy": NumPyMatrixPrinter, "exact": ExactPrinter}
_serial = count()


def _binding_plan(args: Sequence[MatrixSymbol], dim_symbols: list[sp.Symbol], fixed: set) -> list:
    """How to get each dimension from the arguments' shapes: [(symbol, formula in sizes)].

    Size k of argument i along axis a is the symbol ``_size_i_a``; a dimension that
    appears alone, or with already-known ones (e.g. H·d_k with H fixed), is solved for.
    """
    sizes = {
        (i, axis): sp.Symbol(f"_size_{i}_{axis}", positive=True, integer=True)
        for i in range(len(args))
        for axis in (0, 1)
    }
    known: dict[sp.Symbol, Basic] = {s: s for s in dim_symbols if s.name in fixed}
    plan = []
    for _ in range(len(dim_symbols) + 1):
        for (i, axis), size in sizes.items():
            dim = sp.sympify(args[i].shape[axis])
            unknown = dim.free_symbols - set(known)
            if len(unknown) == 1:
                (s,) = unknown
                solution = sp.solve(sp.Eq(dim.xreplace(known), size), s)
                if solution:
                    known[s] = solution[0]
                    plan.append((s, solution[0]))
    return plan


def _bind_dimensions(args, values, plan, fixed: Mapping) -> dict:
    """Dimension values for these arrays, checked against every argument's shape."""
    env: dict[Basic, Basic] = {
        sp.Symbol(f"_size_{i}_{axis}", positive=True, integer=True): sp.Integer(np.shape(v)[axis - 2])
        for i, v in enumerate(values)
        for axis in (0, 1)
    }
    bound = {s: sp.Integer(v) for s, v in fixed.items()}
    for s, formula in plan:
        bound[s] = formula.xreplace(env).xreplace(bound)
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
    backend: str = "numpy",
    sum_batch: bool = False,
    dims: Mapping | None = None,
) -> Callable:
    """A function of arrays for the arguments that returns expr's value.

    Leading batch dimensions broadcast. With ``sum_batch`` the result is summed over
    its leading dimensions (the gradient of a weight shared across the batch).
    ``dims`` fixes dimensions that no argument's shape determines (e.g. heads H).
    ``backend="exact"`` evaluates object arrays of SymPy numbers exactly.
    """
    if backend not in PRINTERS:
        raise SymattnError(f"unknown backend {backend!r}; choose from {', '.join(PRINTERS)}")
    args = list(args)
    for a in args:
        if not isinstance(a, MatrixSymbol):
            raise SymattnError(f"lambdify arguments must be MatrixSymbols, got {type(a).__name__} {a}")
    expr = expression(expr)
    check_shapes(expr)
    missing = {s for s in expr.atoms(MatrixSymbol)} - set(args)
    if missing:
        raise SymattnError(f"expression uses {', '.join(sorted(m.name for m in missing))} not among the arguments")
    printer = PRINTERS[backend]()
    body = printer.doprint(expr)
    dim_symbols = dimension_symbols(expr, *args)
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
    plan = _binding_plan(args, dim_symbols, {k.name for k in fixed})

    def function(*values):
        if len(values) != len(args):
            raise TypeError(f"expected {len(args)} arrays ({', '.join(names)}), got {len(values)}")
        for a, v in zip(args, values):
            if np.ndim(v) < 2:
                raise ShapeMismatchError(f"argument {a.name} (needs at least 2 axes)", a.shape, np.shape(v))
        bound = _bind_dimensions(args, values, plan, fixed)
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
