"""The sizes and options a Triton module binds before its kernels: lines of Python, each reading names bound before it.

A dimension that is a whole axis of an input is read off it (``n = dims["n"]``); a head count is an option
(num_heads → H, num_kv_heads → H_kv, checked a positive integer, and one that must divide another checked so); a
dimension inside a product of sizes is the axis divided by the rest (d_k = (H·d_k) / H, a ValueError where it does not
divide; the axes of one size are equal, ``_dimensions`` checks); a product with no unknown factor is checked against
its axis; then the other options get their defaults (one handed on as given, dropout's rng, none). Only the
lines whose names the module's code reads (or a later line needs) are kept, so nothing is bound unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy import Basic

from symattn.specs import Option, Spec


@dataclass(frozen=True)
class Line:
    """One line of code, the name it binds ("" for a check) and the names it reads."""

    code: str
    binds: str
    reads: frozenset[str]


def axis_sizes(spec: Spec) -> list[Basic]:
    """The sizes of the matrix inputs' axes, in order."""
    return [sp.sympify(s) for x in spec.matrix_inputs for s in x.shape]


def counts(spec: Spec, options: tuple[Option, ...]) -> list[Option]:
    """The options that are a dimension of the inputs' shapes (head counts), in order."""
    symbols = {s for size in axis_sizes(spec) for s in size.free_symbols}
    return [o for o in options if o.symbol in symbols]


def binding_lines(spec: Spec, options: tuple[Option, ...], printed, read: set[str]) -> list[str]:
    """The lines binding every symbol in read (and what they need), in order; printed(expr) prints a scalar."""
    lines = lines_of(spec, options, printed)
    needed = set(read)
    for line in reversed(lines):
        if not line.binds or line.binds in needed:
            needed |= line.reads
    kept = [line for line in lines if not line.binds or line.binds in needed]
    return [line.code for line in kept]


def lines_of(spec: Spec, options: tuple[Option, ...], printed) -> list[Line]:
    """Every binding and check, in an order where each line reads only names bound before it."""
    sizes = axis_sizes(spec)
    lines = [_line(f'{s} = dims["{s}"]', str(s), []) for s in dict.fromkeys(x for x in sizes if x.is_Symbol)]
    known = {str(s) for s in sizes if s.is_Symbol}
    named = {o.name: o for o in options}
    for o in counts(spec, options):
        given = o.name if o.default is None else f"{printed(o.default)} if {o.name} is None else {o.name}"
        lines.append(_line(f'{o.symbol} = _count("{o.name}", {given})', str(o.symbol), o.default))
        known.add(str(o.symbol))
        if o.divides in named:
            other = named[o.divides]
            check = f'_divides("{o.name}", {o.symbol}, "{other.name}", {other.symbol})'
            lines.append(_line(check, "", [o.symbol, other.symbol]))
    products = list(dict.fromkeys(x for x in sizes if not x.is_Symbol and not x.is_Integer))
    lines += _products(products, known, printed)
    for o in options:
        if o in counts(spec, options):
            continue
        if o.default is not None and not o.passed:  # (a passed one, a generator, is read as given)
            code = f"{o.name} = {printed(o.default)} if {o.name} is None else {o.name}"
            lines.append(_line(code, o.name, o.default))
        if str(o.symbol) != o.name:
            lines.append(_line(f"{o.symbol} = {o.name}", str(o.symbol), [sp.Symbol(o.name)]))
    return lines


def _products(products: list[Basic], known: set[str], printed) -> list[Line]:
    """d = axis / (the rest) for each product with one unknown factor (in turns, as factors become known); then a
    check of each product left against its axis."""
    lines, waiting = [], list(products)
    while True:
        solvable = [p for p in waiting if _unknown(p, known) is not None]
        if not solvable:
            break
        for p in solvable:
            unknown = _unknown(p, known)
            if unknown is None:
                continue
            rest = p / unknown
            lines.append(_line(f'{unknown} = _share(dims, "{p}", {printed(rest)})', str(unknown), rest))
            known.add(str(unknown))
            waiting.remove(p)
    return lines + [_line(f'_product(dims, "{p}", {printed(p)})', "", p) for p in waiting]


def _unknown(size: Basic, known: set[str]) -> sp.Symbol | None:
    """The one factor of size (a product of symbols) not yet known, where it appears once; else None."""
    unknown = [s for s in size.free_symbols if str(s) not in known]
    if len(unknown) != 1 or not isinstance(size, sp.Mul) or unknown[0] not in size.args:
        return None
    return unknown[0]


def _line(code: str, binds: str, reads) -> Line:
    """A Line reading the free symbols of reads (an expression, a list of them, or None)."""
    exprs = [] if reads is None else reads if isinstance(reads, list) else [reads]
    return Line(code, binds, frozenset(str(s) for e in exprs for s in sp.sympify(e).free_symbols))
