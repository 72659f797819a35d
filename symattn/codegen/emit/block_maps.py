"""The block maps of a loop over blocks of query rows: for each mask on data its scores add (``Loop.maps``, a block
test of ``optimize.block_tests``), the statement computing it per call before the loop (the runtime's block_map,
O(n/b · m/b)), which the loop's key window (``key_window``) and the mask's fill (``hide_keys``) then read."""

from __future__ import annotations

import sympy as sp
from sympy import Basic, Expr

from symattn.codegen.schedule.rowblocks import Loop
from symattn.lang.positions import I
from symattn.numeric import positions
from symattn.optimize.block_tests import BOUNDS, Read, block_test
from symattn.optimize.position_blocks import EntriesBlock


def map_lines(lp: Loop, printer) -> list[tuple[str, str]]:
    """(name, code) of each block map the loop reads (blocks_0, …), in the order of ``Loop.maps``; sets the
    printer's ``block_maps`` (a mask's formula → its map's name) for the loop's statements. No map where the
    backend's runtime has no block_map (JAX)."""
    printer.block_maps = {}
    if "block_map" not in printer.runtime:
        return []
    lines = []
    for mask in lp.maps:
        if mask.formula not in printer.block_maps:
            printer.block_maps[mask.formula] = name = f"blocks_{len(lines)}"
            lines.append((name, _call(mask, printer)))
    return lines


def map_arguments(printer) -> str:
    """The key window's arguments of the loop's block maps: ", block, (blocks_0, …)" ("" without any)."""
    names = list(printer.block_maps.values())
    return f", block, ({', '.join(names)},)" if names else ""


def _call(mask: EntriesBlock, printer) -> str:
    """block_map(test, reads, n, m, block_size, dtype…) of a mask's block test (``test_code``)."""
    rows, cols = (printer._print(x) for x in (mask.source.rows, mask.shape[1]))
    variables, empty, full, reads = test_code(mask.formula, printer, rows, cols)
    test = f"lambda {variables}: ({empty}, {full})"
    return f"{printer.helper('block_map')}({test}, [{reads}], {rows}, {cols}, block_size{printer.position_dtype})"


def test_code(formula: Expr, printer, rows: str, cols: str) -> tuple[str, str, str, str]:
    """(variables, empty, full, reads) of a mask on data's block test (``optimize.block_tests``) as the printer's
    array code: empty and full of the variables, the blocks' bounds and the reads' block extremes; reads, each read's
    (values, along): the table's values along the rows (``rows``, the code of their count) or keys (``cols``), or its
    one value per sequence."""
    test = block_test(formula)
    names = dict(zip(BOUNDS, ("i", "i_last", "j", "j_last")))
    names |= {s: str(s) for r in test.reads for s in (r.low, r.high)}
    flavour = printer.position_flavour(names)
    empty, full = (positions.array_code(x, flavour) for x in (test.empty, test.full))
    reads = ", ".join(_values(r, rows, cols, printer) for r in test.reads)
    return ", ".join(names.values()), empty, full, reads


def _values(read: Read, rows: str, cols: str, printer) -> str:
    """(values, along) of a read: t[..., :n, c] for t[i, c] ("i"), t[..., r, :m] for t[r, j] ("j"), t[..., r, c]
    for constant indices (None)."""
    table, (r, c) = printer._print(read.element.parent), read.element.indices

    def index(x: Basic) -> str:
        return f":{rows if read.along == I else cols}" if x == read.along else printer._print(sp.sympify(x))

    along = {None: "None"}.get(read.along, f'"{read.along}"')
    return f"({table}[..., {index(r)}, {index(c)}], {along})"
