"""Printing a matrix of positions (``lang.positions.Entries``) and its transpose (``Scatter``) as code: one walk of the
formula, written by a flavour.

The array flavour (NumPy, torch, JAX: the three libraries spell these functions alike) evaluates f on ``i``, a column
of the row positions 0 … rows − 1, and ``j``, a row of the column positions, broadcast against each other: no Python
loop, no n × m argument; a table read b[r, c] indexes b with the index grids (the runtime's ``read``). The exact
flavour writes the same formula over SymPy integers ``_i``, ``_j``, entry by entry. Each flavour is a table of how
it writes each kind of node; the walk (``code``) is shared.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic
from sympy.core.relational import Relational
from sympy.matrices.expressions.matexpr import MatrixElement
from sympy.printing.pycode import PythonCodePrinter

from symattn.lang.positions import Entries, I, J, Scatter
from symattn.optimize.position_blocks import HEAD, ScatterBlock

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
ARRAY_NAMES = {I: "i", J: "j", HEAD: "h"}  # the array flavour's grids (a block of a per-head matrix: the head's too)


@dataclass(frozen=True)
class Flavour:
    """How one kind of code writes the nodes of a formula; each field takes the printed operands (and the node)."""

    names: dict[Basic, str]  # the positions (i, j, the head h) and any other symbol named as they are → their code
    infinity: tuple[str, str]  # −∞, +∞
    constant: Callable[[Basic], str]  # a subexpression free of positions (dimensions, numbers)
    add: Callable[[list[str]], str]
    mul: Callable[[Basic, list[str]], str]  # the node (a −1 coefficient) and its printed factors
    power: Callable[[Basic], str]  # the node (base^k): a flavour may write k by its value
    call: Callable[[Basic, list[str]], str]  # Abs, floor, Min, Max, … (the node and its printed arguments)
    piecewise: Callable[[list[tuple[Basic, str, str]]], str]  # (value, printed value, printed condition) pairs
    not_: Callable[[str], str]
    read: Callable[[str, str, str], str]  # a table read: table, row index, column index
    # a read whose index reads a constant (Swin's T[idx[i, j], h]): table, row, column, the table's name and the
    # constants' names; the index's values checked to lie inside the table (no size bounds them)
    checked_read: Callable[[str, str, str, str, str], str]


def integral(relation: Relational) -> tuple[Basic, Basic]:
    """(lhs, rhs) of a comparison in a form exact in floats at integer positions: lhs − rhs times the common
    denominator of its rational coefficients, against 0 (SymPy writes i − j < 4 + 6h as h > i/6 − j/6 − 2/3, whose
    sixths round: the comparison flips where it is an equality), else as it is."""
    difference = sp.expand(relation.lhs - relation.rhs)
    coefficients = [term.as_coeff_Mul()[0] for term in sp.Add.make_args(difference)]
    if not all(c.is_Rational for c in coefficients):
        return relation.lhs, relation.rhs
    common = sp.ilcm(1, *(c.q for c in coefficients))
    return (sp.expand(common * difference), sp.S.Zero) if common > 1 else (relation.lhs, relation.rhs)


def quotient(product: Basic) -> tuple[Basic, Basic]:
    """(numerator, denominator) of a product whose denominator holds no position (a number, a dimension): printed
    as one division, a single rounding, exact where the quotient is an integer; (product, 1) otherwise."""
    numerator, denominator = product.as_numer_denom()
    sizes = all(s.is_integer and s.is_positive for s in denominator.free_symbols)  # numbers and dimensions only
    if denominator == 1 or not sizes or not denominator.is_positive:
        return product, sp.S.One
    return numerator, denominator


def code(e: Basic, flavour: Flavour) -> str:
    """The formula e (of the flavour's ``names``: ``I``, ``J``, the head) in the flavour's code."""
    if e in flavour.names:
        return flavour.names[e]
    if e in (sp.oo, -sp.oo):
        return flavour.infinity[e == sp.oo]
    if e == sp.true:
        return "True"
    if isinstance(e, MatrixElement):
        indices = [code(x, flavour) for x in e.indices]
        sources = sorted({str(r.parent.name) for x in e.indices for r in x.atoms(MatrixElement)})
        if sources:
            return flavour.checked_read(flavour.constant(e.parent), *indices, str(e.parent.name), ", ".join(sources))
        return flavour.read(flavour.constant(e.parent), *indices)
    if not e.has(*flavour.names):
        return flavour.constant(e)
    if isinstance(e, sp.Add):
        return flavour.add([code(a, flavour) for a in e.args])
    if isinstance(e, sp.Mul):
        return flavour.mul(e, [code(a, flavour) for a in e.args])
    if isinstance(e, sp.Pow):
        return flavour.power(e)
    if isinstance(e, sp.Piecewise):
        return flavour.piecewise([(v, code(v, flavour), code(c, flavour)) for v, c in e.args])
    if isinstance(e, Relational):
        lhs, rhs = integral(e)
        return f"({code(lhs, flavour)} {RELATIONS[e.rel_op]} {code(rhs, flavour)})"
    if type(e) in CONNECTIVES:
        return "(" + CONNECTIVES[type(e)].join(code(a, flavour) for a in e.args) + ")"
    if isinstance(e, sp.Not):
        return flavour.not_(code(e.args[0], flavour))
    return flavour.call(e, [code(a, flavour) for a in e.args])


def pairwise(name: str, branch: Callable[[Basic, str], str], e: Basic, args: list[str]) -> str:
    """Min or Max of e's arguments (their code args) as nested two-argument calls name(name(a, b), c), each
    operand written by branch (a scalar as the library takes it there)."""
    text = branch(e.args[0], args[0])
    for a, t in zip(e.args[1:], args[1:]):
        text = f"{name}({text}, {branch(a, t)})"
    return text


def where_chain(xp: str, branch: Callable[[Basic, str], str]) -> Callable[[list[tuple[Basic, str, str]]], str]:
    """A Piecewise's (value, its code, its condition's code) pairs as nested xp.where(condition, value, rest), the
    last value (or a True condition) ending it; each value written by branch."""

    def where(pairs: list[tuple[Basic, str, str]]) -> str:
        (value, text, condition), *rest = pairs
        if condition == "True" or not rest:
            return branch(value, text)
        return f"{xp}.where({condition}, {branch(value, text)}, {where(rest)})"

    return where


def array_flavour(
    xp: str,
    scalar: Callable[[Basic], str],
    number: Callable[[str], str],
    helper: Callable[[str], str],
    names: dict[Basic, str] | None = None,
) -> Flavour:
    """Array code of the grids ``i`` and ``j``. scalar: how the printer writes a subexpression free of i and j;
    number(text): a number as a scalar of the grids' dtype (a where's branch, which would otherwise take the library's
    default dtype); helper(name): a runtime helper's name as the printer calls it (``table_read`` reads a table at
    index grids, ``indexed_read`` at index grids read from a constant, checked); names: other symbols read as arrays
    (a block test's bounds, ``optimize.block_tests``), with their code."""
    names = {**ARRAY_NAMES, **(names or {})}

    def constant(e: Basic) -> str:
        text = scalar(e)
        return text if text.isidentifier() or text.lstrip("-").replace(".", "").isdigit() else f"({text})"

    def mul(e: Basic, factors: list[str]) -> str:
        coeff, rest = e.as_coeff_Mul()
        if coeff == -1:
            return "-" + code(rest, flavour)
        numerator, denominator = quotient(e)
        if denominator != 1:  # one rounding: j / n, not j * (1 / n) (whose floor at j = n may be 0)
            return f"({code(numerator, flavour)} / {constant(denominator)})"
        return " * ".join(factors)

    def branch(value: Basic, text: str) -> str:
        return text if value.has(*names) or value.has(MatrixElement) else number(text)

    def call(e: Basic, args: list[str]) -> str:
        if type(e) not in CALLS:
            raise NotImplementedError(f"no array code for {type(e).__name__} in a position formula")
        name = CALLS[type(e)].format(xp=xp)
        if isinstance(e, (sp.Min, sp.Max)):  # a number as the grids' scalar (torch.minimum takes tensors)
            return pairwise(name, branch, e, args)
        return f"{name}({args[0]})"

    where = where_chain(xp, branch)

    flavour = Flavour(
        names=names,
        infinity=(f"-{xp}.inf", f"{xp}.inf"),
        constant=constant,
        add=lambda terms: "(" + " + ".join(terms).replace("+ -", "- ") + ")",
        mul=mul,
        power=lambda e: f"{code(e.base, flavour)} ** {code(e.exp, flavour)}",
        call=call,
        piecewise=where,
        not_=lambda a: f"(~{a})",
        read=lambda table, row, col: f"{helper('table_read')}({table}, {row}, {col})",
        checked_read=lambda table, row, col, name, source: (
            f"{helper('indexed_read')}({table}, {row}, {col}, {name!r}, {source!r})"
        ),
    )
    return flavour


def exact_flavour(scalar: Callable[[Basic], str], helper: Callable[[str], str]) -> Flavour:
    """Code of SymPy integers ``_i``, ``_j``: the formula's value at one position, exactly (helper: as the array
    flavour's, for the runtime's ``indexed_entry``)."""
    flavour = Flavour(
        names={I: "_i", J: "_j", HEAD: "h"},
        infinity=("-sp.oo", "sp.oo"),
        constant=lambda e: f"({scalar(e)})",
        add=lambda terms: "(" + " + ".join(terms) + ")",
        mul=lambda e, factors: "(" + " * ".join(factors) + ")",
        power=lambda e: f"({code(e.base, flavour)} ** {code(e.exp, flavour)})",
        call=lambda e, args: f"sp.{type(e).__name__}(" + ", ".join(args) + ")",
        piecewise=lambda pairs: "sp.Piecewise(" + ", ".join(f"({v}, {c})" for _, v, c in pairs) + ")",
        not_=lambda a: f"sp.Not({a})",
        read=lambda table, row, col: f"{table}[int({row}), int({col})]",
        checked_read=lambda table, row, col, name, source: (
            f"{helper('indexed_entry')}({table}, {row}, {col}, {name!r}, {source!r})"
        ),
    )
    return flavour


def array_code(formula: Entries | Basic, flavour: Flavour) -> str:
    """f(i, j) (a matrix of positions' formula, or a condition of one) as array code of the grids: the body of the
    lambda the runtime's ``entries`` calls (of a block, ``block_entries`` or ``hide_keys``; with heads, of h too)."""
    return code(formula.formula if isinstance(formula, Entries) else formula, flavour)


def index_code(node: Scatter | ScatterBlock, flavour: Flavour) -> str:
    """(r(i, j), c(i, j)), the table entry each position reads, as code of the positions (a block's per head: of the
    head h too): the body of the lambda the runtime's ``table_scatter`` (``block_scatter``) calls."""
    row, col = (code(sp.sympify(x), flavour) for x in node.index)
    return f"({row}, {col})"


def exact_code(entries: Entries, scalar: Callable[[Basic], str], helper: Callable[[str], str]) -> str:
    """The entries as an object array of exact SymPy values: f written over SymPy integers _i, _j, entry by entry."""
    rows, cols = (scalar(s) for s in entries.shape)
    ints = "map(sp.Integer, range({}))"
    return (
        f"np.array([[{code(entries.formula, exact_flavour(scalar, helper))} for _j in {ints.format(cols)}] "
        f"for _i in {ints.format(rows)}], dtype=object)"
    )


class _BoundPrinter(PythonCodePrinter):
    """Integer bounds (``optimize.mask_structure``) as plain Python: max, min, conditionals, spaced as ruff writes."""

    def _print_Mul(self, expr: Basic) -> str:
        return re.sub(r"\s*(?<!\*)([*/])(?![*/])\s*", r" \1 ", super()._print_Mul(expr))


def bound_code(bound: Basic, names: dict[Basic, str]) -> str:
    """A key bound as Python integer code, each symbol of names written as its code (block.start, K.shape[-2])."""
    return _BoundPrinter().doprint(bound.xreplace({s: sp.Symbol(text, integer=True) for s, text in names.items()}))
