"""Printing a matrix of positions (``lang.positions.Entries``) as array code: its formula over the position grids.

The entries of [f(i, j)] are f evaluated on ``i``, a column of the row positions 0 … rows − 1, and ``j``, a row of
the column positions, broadcast against each other: no Python loop, no n × m argument. The NumPy, torch and JAX
printers share the table below (the three libraries spell these functions alike); each printer states its grid,
how a number becomes an array of its dtype, and how the result is cast and broadcast to rows × cols. The exact
printer writes the same formula over SymPy integers, entry by entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import sympy as sp
from sympy import Basic
from sympy.core.relational import Relational
from sympy.printing.pycode import PythonCodePrinter

from symattn.lang.positions import HEAD, Entries, I, J

# SymPy function → the array library's function, ``{xp}`` its module (np, torch, jnp); Min and Max fold pairwise
CALLS: dict[type, str] = {
    sp.Abs: "{xp}.abs",
    sp.floor: "{xp}.floor",
    sp.ceiling: "{xp}.ceil",
    sp.log: "{xp}.log",
    sp.exp: "{xp}.exp",
    sp.sign: "{xp}.sign",
    sp.Min: "{xp}.minimum",
    sp.Max: "{xp}.maximum",
}
RELATIONS = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
CONNECTIVES = {sp.And: " & ", sp.Or: " | "}


def array_code(formula: Basic, xp: str, scalar: Callable[[Basic], str], number: Callable[[str], str]) -> str:
    """f(i, j) (a matrix of positions' formula, or a condition of one) as array code of the grids ``i`` (a column of
    row positions) and ``j`` (a row of column positions): the body of the lambda the runtime's ``entries`` calls
    (of a block, ``block_entries`` or ``hide_keys``; with heads, of ``h`` too).

    scalar: how the printer writes a subexpression free of i and j (dimensions, numbers); number(text): a number as
    a scalar of the grids' dtype (a where's branch, which would otherwise take the library's default dtype)."""

    def code(e: Basic) -> str:
        if e == I:
            return "i"
        if e == J:
            return "j"
        if e == HEAD:
            return "h"
        if e in (sp.oo, -sp.oo):
            return ("-" if e == -sp.oo else "") + f"{xp}.inf"
        if e == sp.true:
            return "True"
        if not e.has(I, J, HEAD):
            text = scalar(e)
            return text if text.isidentifier() or text.lstrip("-").replace(".", "").isdigit() else f"({text})"
        if isinstance(e, sp.Add):
            return "(" + " + ".join(code(a) for a in e.args).replace("+ -", "- ") + ")"
        if isinstance(e, sp.Mul):
            coeff, rest = e.as_coeff_Mul()
            if coeff == -1:
                return "-" + code(rest)
            return " * ".join(code(a) for a in e.args)
        if isinstance(e, sp.Pow):
            return f"{code(e.base)} ** {code(e.exp)}"
        if isinstance(e, (sp.Min, sp.Max)):  # pairwise; a number as the grids' scalar (torch.minimum takes tensors)
            call, (first, *rest) = CALLS[type(e)].format(xp=xp), e.args
            text = branch(first)
            for a in rest:
                text = f"{call}({text}, {branch(a)})"
            return text
        if type(e) in CALLS:
            return f"{CALLS[type(e)].format(xp=xp)}({code(e.args[0])})"
        if isinstance(e, sp.Piecewise):
            return where(e.args)
        if isinstance(e, Relational):
            return f"({code(e.lhs)} {RELATIONS[e.rel_op]} {code(e.rhs)})"
        if type(e) in CONNECTIVES:
            return "(" + CONNECTIVES[type(e)].join(code(a) for a in e.args) + ")"
        if isinstance(e, sp.Not):
            return f"(~{code(e.args[0])})"
        raise NotImplementedError(f"no array code for {type(e).__name__} in a position formula")

    def branch(value: Basic) -> str:
        return code(value) if value.has(I, J, HEAD) else number(code(value))

    def where(pairs: tuple) -> str:
        (value, condition), *rest = pairs
        if condition == sp.true or not rest:
            return branch(value)
        return f"{xp}.where({code(condition)}, {branch(value)}, {where(tuple(rest))})"

    return code(formula)


def exact_code(entries: Entries, scalar: Callable[[Basic], str]) -> str:
    """The entries as an object array of exact SymPy values: f written over SymPy integers _i, _j, entry by entry."""
    rows, cols = (scalar(s) for s in entries.shape)

    def code(e: Basic) -> str:
        if e == I:
            return "_i"
        if e == J:
            return "_j"
        if e in (sp.oo, -sp.oo):
            return ("-" if e == -sp.oo else "") + "sp.oo"
        if e == sp.true:
            return "True"
        if not e.has(I, J):
            return f"({scalar(e)})"
        if isinstance(e, sp.Add):
            return "(" + " + ".join(code(a) for a in e.args) + ")"
        if isinstance(e, sp.Mul):
            return "(" + " * ".join(code(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow):
            return f"({code(e.base)} ** {code(e.exp)})"
        if isinstance(e, Relational):
            return f"({code(e.lhs)} {RELATIONS[e.rel_op]} {code(e.rhs)})"
        if isinstance(e, sp.Piecewise):
            return "sp.Piecewise(" + ", ".join(f"({code(v)}, {code(c)})" for v, c in e.args) + ")"
        return f"sp.{type(e).__name__}(" + ", ".join(code(a) for a in e.args) + ")"

    ints = "map(sp.Integer, range({}))"
    return (
        f"np.array([[{code(entries.formula)} for _j in {ints.format(cols)}] for _i in {ints.format(rows)}], "
        "dtype=object)"
    )


class _BoundPrinter(PythonCodePrinter):
    """Integer bounds (``optimize.mask_structure``) as plain Python: max, min, conditionals, spaced as ruff writes."""

    def _print_Mul(self, expr: Basic) -> str:
        return re.sub(r"\s*(?<!\*)([*/])(?![*/])\s*", r" \1 ", super()._print_Mul(expr))


def bound_code(bound: Basic, names: dict[Basic, str]) -> str:
    """A key bound as Python integer code, each symbol of names written as its code (block.start, K.shape[-2])."""
    return _BoundPrinter().doprint(bound.xreplace({s: sp.Symbol(text, integer=True) for s, text in names.items()}))
