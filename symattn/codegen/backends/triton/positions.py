"""A matrix of positions (``sa.entries``) inside the kernels' tiles: its formula printed over the tile's positions.

A tile's rows are the query positions i of its rows (``pos_i``), its columns the key positions j of its columns
(``pos_j``): float32 registers made from the offsets the kernel already holds, broadcast against each other as the
tile is laid out (a column and a row; a row and a column in the backward's transposed tiles). No load, no n × m
argument: the formula is computed where the tile is.

Per head (``split_heads(E, H)`` of the n × H·m matrix E whose column J holds head ⌊J/m⌋'s column J − m⌊J/m⌋,
``sa.entries(…, heads=H)``), the tile of head h reads E's columns J = h·m + j with 0 ≤ j < m, where ⌊J/m⌋ = h: the
formula with ⌊J/m⌋ ↦ h and J ↦ h·m + j, h the program's head (``pos_h``: its batch·head index modulo H, the heads
being the innermost batch axis, as split_heads lays them out). The eager core (a second derivative's recomputation)
prints the same formula in torch over grids of the same names.

A mask of them added to a row softmax's argument (−∞ where a key is hidden) decides which tiles a program visits
(``tile_window``): the key window of its block of rows and, for the backward's key part, the row window of its block
of keys (``optimize.mask_structure``), printed as integer code of the block's bounds and n, m; on the tiles every
row sees whole the mask's formula is printed without its −∞ branches. A mask whose condition reads a table at
positions (document ids, a prefix length per sequence) has no such structure until the table's numbers are read: its
tiles are classed per call by a block map (``block_map_formula``, ``optimize.block_tests``), which the kernels read
beside the window (its open range left to the map for those masks).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.logic.boolalg import ITE
from sympy.matrices.expressions import MatAdd
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.errors import SymattnError
from symattn.lang.functions import TORCH, TRITON
from symattn.lang.graph import postorder
from symattn.lang.ops import SplitHeads
from symattn.lang.positions import Entries, I, J
from symattn.numeric.positions import CALLS, Flavour, code, pairwise, quotient, where_chain
from symattn.optimize.block_tests import BOUNDS, block_test
from symattn.optimize.mask_structure import KeyWindow, intersection, key_window, row_window

HEAD = sp.Symbol("_head", integer=True, nonnegative=True)  # the program's head, in a per-head formula
GRID = {I: "pos_i", J: "pos_j", HEAD: "pos_h"}  # the position symbols → the tiles' names of their values


PAIRWISE = (sp.Min, sp.Max)  # folded pairwise; their calls and the other functions': the array printers' (``CALLS``,
# named alike in triton.language and torch: tl.abs, torch.abs, …)


@dataclass(frozen=True)
class Spelling:
    """How a library writes a formula: its module's prefix (``tl.``, ``torch.``: the calls' names are the same in
    both), a scalar as an operand of where, minimum or maximum, and a head count given as a scalar argument as an
    int's modulus."""

    prefix: str
    branch: str = "{}"
    count: str = "{}"
    index: str = "{}"  # an index of a table read, cast to an integer
    table: str = ""  # a table read: {t} the table's name, {r} and {c} its row and column index (``table_read``)
    constant_table: str = ""  # … at two literal indices (one value per sequence: no mask, broadcast over the tile)
    tiled: bool = False  # a read's pointer must be a tile's (tl.load of a scalar pointer takes no tile's mask)


SPELLINGS = {  # the kernels' (triton.language), the eager core's (torch, whose minimum takes tensors only)
    TRITON: Spelling(
        "tl.",
        count="{}.to(tl.int64)",
        index="({}).to(tl.int64)",
        table="tl.load(TAB_{t} + (bh // inner) * tab_{t}_b + (bh % inner) * tab_{t}_h + {r} * tab_{t}_r "
        "+ {c} * tab_{t}_c, mask=inside, other=0.0).to(tl.float32)",
        constant_table="tl.load(TAB_{t} + (bh // inner) * tab_{t}_b + (bh % inner) * tab_{t}_h + {r} * tab_{t}_r "
        "+ {c} * tab_{t}_c).to(tl.float32)",
        tiled=True,
    ),
    TORCH: Spelling(
        "torch.",
        branch="pos_i.new_tensor({})",
        index="torch.as_tensor({}).long()",
        table="table_{t}[..., {r}, {c}]",
        constant_table="table_{t}[..., {r} : {r} + 1, {c} : {c} + 1]",
    ),
}


def tile_formula(entries: Entries, heads: Basic | None) -> Expr:
    """f(i, j) of a tile of entries; with heads H (entries the n × H·m matrix split_heads cuts), the head's
    f(i, j, h): ⌊J/m⌋ ↦ h, then J ↦ h·m + j (exact for 0 ≤ j < m)."""
    if heads is None:
        return entries.formula
    width = entries.cols / heads
    return entries.formula.xreplace({sp.floor(J / width): HEAD}).xreplace({J: HEAD * width + J})


def masks_of(logits: MatrixExpr, normaliser: str) -> tuple[Expr, ...]:
    """The tile formulas of the matrices of positions (whole or per head) added to a row softmax's argument
    A = … + E whose −∞ hides a key: P is 0 there, whatever A's other terms (a mask under a function is none)."""
    if normaliser != "row softmax" or not isinstance(logits, MatAdd):
        return ()
    found = [tile_formula(t, None) for t in logits.args if isinstance(t, Entries)]
    found += [
        tile_formula(t.arg, t.heads) for t in logits.args if isinstance(t, SplitHeads) and isinstance(t.arg, Entries)
    ]
    return tuple(f for f in found if f.has(-sp.oo))


@dataclass(frozen=True)
class TileWindow:
    """The tiles a program visits (``optimize.mask_structure``), as Triton code of its block's bounds and the
    sizes n, m: ``keys`` (lo, hi, open_lo, open_hi) of the query rows row0 … row1 − 1, every key some row sees in
    [lo, hi), every key of [open_lo, open_hi) seen by every row; ``rows``, the same of the query rows of the keys
    key0 … key1 − 1 (the backward's key part)."""

    keys: tuple[str, str, str, str]
    rows: tuple[str, str, str, str]
    key_parts: tuple[str, ...] = ()  # the lines naming the subexpressions keys share (``kw0 = …``), before them
    row_parts: tuple[str, ...] = ()  # … and rows (``rw0 = …``)


BLOCK = (sp.Symbol("_r0", integer=True, nonnegative=True), sp.Symbol("_r1", integer=True, positive=True))


SIZES = (sp.Symbol("n", integer=True, positive=True), sp.Symbol("m", integer=True, positive=True))  # as the map's
# code names the sizes


def block_map_formula(masks: tuple[Expr, ...], shape: tuple[Basic, Basic]) -> Expr | None:
    """The formula whose block test (``optimize.block_tests``) classes the kernels' tiles per call: the masks' sum
    (a pair hidden by one is hidden), its sizes written n and m (``SIZES``), where some mask reads a table at positions
    and the test reads nothing but the blocks' bounds, the reads' extremes and n, m; else None (no block map: a mask
    of positions alone has its analytic window, a mask per head or one the test cannot bound is applied on every
    tile)."""
    if not masks or any(f.has(HEAD) for f in masks) or not any(f.has(MatrixElement) for f in masks):
        return None
    sizes = {s: new for s, new in zip(shape, SIZES) if isinstance(s, sp.Symbol)}
    formula = sp.Add(*masks).xreplace(sizes)
    test = block_test(formula)
    if test is None:
        return None
    known = {*BOUNDS, *SIZES, *(x for r in test.reads for x in (r.low, r.high))}
    return formula if (test.empty.free_symbols | test.full.free_symbols) <= known else None


def _opened(window: KeyWindow, mapped: bool) -> KeyWindow:
    """A mask's window, its open range [lo, hi) where a block map classes its tiles (the map, not the window, says
    which tiles every row sees whole)."""
    return KeyWindow(window.lo, window.hi, window.lo, window.hi) if mapped else window


def tile_window(masks: tuple[Expr, ...], shape: tuple[Basic, Basic], mapped: bool = False) -> TileWindow | None:
    """The window of the masks' sum over a program's block (the intersection of theirs), or None (every tile, the
    mask applied on each: today's kernels) where there is no mask or a bound reads anything but the block's bounds
    and the sizes n, m (a head, a trainable scalar, another dimension). mapped: a block map classes the tiles, so a
    mask reading a table leaves its open range to it."""
    if not masks:
        return None
    first, end = BLOCK
    n, m = shape
    reads = [mapped and f.has(MatrixElement) for f in masks]
    keys = intersection([_opened(key_window(f, first, end, m), r) for f, r in zip(masks, reads)])
    rows = intersection([_opened(row_window(f, first, end, n), r) for f, r in zip(masks, reads)])
    sizes = {s: name for s, name in ((n, "n"), (m, "m")) if isinstance(s, sp.Symbol)}
    bounds = [tuple(_without_ite(x) for x in (w.lo, w.hi, w.open_lo, w.open_hi)) for w in (keys, rows)]
    if bounds in ([(0, m, 0, 0), (0, n, 0, 0)], [(0, m, 0, m), (0, n, 0, n)]):  # (nothing known: every tile)
        return None
    known = {first, end, *sizes}
    if any(not x.free_symbols <= known or not all(a.is_Integer for a in x.atoms(sp.Number)) for b in bounds for x in b):
        return None
    printed = [
        _printed(found, {first: r0, end: r1, **sizes}, prefix)
        for found, (r0, r1, prefix) in zip(bounds, (("row0", "row1", "kw"), ("key0", "key1", "rw")))
    ]
    return TileWindow(printed[0][0], printed[1][0], printed[0][1], printed[1][1])


def _printed(bounds: tuple[Expr, ...], names: dict[Basic, str], prefix: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The bounds as Triton code of names, their common subexpressions named first (prefix0 = …, prefix1 = …: a
    multi-clause mask's bounds repeat their conditions), and those lines."""
    parts, reduced = sp.cse(list(bounds), symbols=sp.numbered_symbols(prefix))
    names = names | {symbol: str(symbol) for symbol, _ in parts}

    def code(x: Basic) -> str:
        return formula_code(x, lambda e: str(int(e)), TRITON, names)

    return tuple(code(x) for x in reduced), tuple(f"{symbol} = {code(value)}" for symbol, value in parts)


def _without_ite(bound: Expr) -> Expr:
    """bound with SymPy's ITE(c, a, b) of its conditions written (c ∧ a) ∨ (¬c ∧ b): the kernels' & and |."""
    return bound.replace(lambda e: isinstance(e, ITE), lambda e: e.to_nnf())


def head_code(heads: Basic, scalar: Callable[[Basic], str], backend: str) -> str:
    """H, the modulus of a program's batch·head index that gives its head: an int, or a scalar argument's value."""
    heads = sp.sympify(heads)
    return str(int(heads)) if heads.is_Integer else SPELLINGS[backend].count.format(scalar(heads))


def kernel_grid(heads: str | None, transposed: bool = False) -> list[str]:
    """The lines making a kernel tile's position grids from its rows, cols and bh (a transposed tile's: keys ×
    queries)."""
    row, col = ("[None, :]", "[:, None]") if transposed else ("[:, None]", "[None, :]")
    lines = [f"pos_i = rows{row}.to(tl.float32)  # the tile's query positions", f"pos_j = cols{col}.to(tl.float32)"]
    return lines + ([f"pos_h = (bh % {heads}).to(tl.float32)  # the program's head"] if heads else [])


def eager_grid(heads: str | None) -> list[str]:
    """The lines making the eager core's position grids from its scores' shape (…, H, n, m), the rows and keys
    starting at origin's positions (a block of a longer sequence: context parallelism's)."""
    grid = "torch.arange(s.shape[{}], dtype=wide, device=s.device)"
    lines = [f"pos_i = ({grid.format(-2)} + origin[0])[:, None]", f"pos_j = ({grid.format(-1)} + origin[1])[None, :]"]
    return lines + ([f"pos_h = ({grid.format(-3)} % {heads})[:, None, None]"] if heads else [])


def formula_code(
    formula: Expr,
    scalar: Callable[[Basic], str],
    backend: str,
    grid: dict[Basic, str] | None = None,
    tables: dict[Basic, str] | None = None,
) -> str:
    """formula as one expression of the grids (``GRID``, or grid's names) in backend (TRITON: the kernels', TORCH:
    the eager core's); scalar(e): a subexpression free of them (a number as a literal, any other a scalar argument's
    name); tables: each table the formula reads at positions → its name (``table_read``). The walk is the array
    printers' (``numeric.positions.code``), written in the library's flavour."""
    flavour = _flavour(scalar, SPELLINGS[backend], GRID if grid is None else grid, tables or {})
    return code(formula, flavour)


def table_read(spelling: Spelling, table: str, row: str, col: str) -> str:
    """Table entry b[r, c] at each position of a tile, as the spelling reads a table (``Spelling.table``): in the
    kernels a gather from b's pointer ``TAB_b`` by its strides (outer batch ``tab_b_b``, inner batch ``tab_b_h``,
    row ``tab_b_r``, column ``tab_b_c``; a table without batch axes has stride 0 there), masked to the tile's part in
    n × m (its indices lie in b only there); in the eager core b's indexing at the index grids (``table_b``). A
    literal index is an int, any other cast (``Spelling.index``); two literal indices read one value per sequence
    (``Spelling.constant_table``: p[0, 0], a prefix length)."""
    r, c = _index(row, spelling.index), _index(col, spelling.index)
    constant = r.isdigit() and c.isdigit()
    return (spelling.constant_table if constant else spelling.table).format(t=table, r=r, c=c)


def _index(text: str, cast: str) -> str:
    """An index's code as an integer: a literal (``0.0``) as an int literal, any other cast."""
    try:
        return str(int(float(text)))
    except ValueError:
        return cast.format(text)


def _flavour(
    scalar: Callable[[Basic], str], spelling: Spelling, names: dict[Basic, str], tables: dict[Basic, str]
) -> Flavour:
    """How the kernels (or the eager core) write a formula: products and quotients in parentheses, a power by its
    exponent, sign by where (tl has none), a scalar operand of where, minimum or maximum as the library takes it."""
    xp = spelling.prefix.rstrip(".")

    def mul(e: Basic, factors: list[str]) -> str:
        coeff, rest = e.as_coeff_Mul()
        numerator, denominator = quotient(e)
        if coeff != -1 and denominator != 1:  # one rounding (positions.quotient)
            return f"({code(numerator, flavour)} / {scalar(denominator)})"
        return f"-{code(rest, flavour)}" if coeff == -1 else "(" + " * ".join(factors) + ")"

    def power(e: Basic) -> str:
        """base^k: a product for an integer k (its inverse for k < 0), a square root for ±1/2, else exp(k log base);
        2^(k log₂ base) for a base free of positions (ALiBi's 2^(−8(h+1)/H): exact at integers)."""
        base, k = e.base, sp.sympify(e.exp)
        if not base.has(*names):
            scale = sp.log(base, 2)
            exponent = code(k, flavour)
            return f"{xp}.exp2({exponent if scale == 1 else f'{exponent} * {scalar(scale)}'})"
        if k.is_Integer and k != 0:
            body = " * ".join([code(base, flavour)] * abs(int(k)))
            return f"({body})" if k > 0 else f"(1.0 / ({body}))"
        if k in (sp.Rational(1, 2), sp.Rational(-1, 2)):
            root = f"{xp}.sqrt({code(base, flavour)})"
            return root if k > 0 else f"(1.0 / {root})"
        return f"{xp}.exp({code(k, flavour)} * {code(sp.log(base), flavour)})"

    def branch(value: Basic, text: str) -> str:
        """An operand of where, minimum or maximum: a scalar as the library takes it there."""
        return text if value.has(*names) else spelling.branch.format(text)

    def call(e: Basic, args: list[str]) -> str:
        if isinstance(e, sp.sign):  # (tl has no sign)
            return f"{xp}.where({args[0]} > 0, 1.0, {xp}.where({args[0]} < 0, -1.0, 0.0))"
        if type(e) not in CALLS:
            raise SymattnError(f"the Triton kernels print no {type(e).__name__} ({e}) in a position formula")
        name = CALLS[type(e)].format(xp=xp)
        if isinstance(e, PAIRWISE):
            return pairwise(name, branch, e, args)
        return f"{name}({args[0]})"

    where = where_chain(xp, branch)

    def constant(e: Basic) -> str:
        """A table (read at positions: its name) or a scalar free of the positions."""
        return tables[e] if e in tables else scalar(e)

    def read(table: str, row: str, col: str) -> str:
        if table not in tables.values():
            raise SymattnError(f"the Triton kernels read no matrix {table} at positions")
        grid = [names[x] for x in (I, J) if x in names]
        literal = all(_index(x, "{}").isdigit() for x in (row, col))  # (p[0, 0]: Spelling.constant_table's)
        if spelling.tiled and not literal and not any(re.search(rf"\b{g}\b", f"{row} {col}") for g in grid):
            row = f"{row} + 0 * {grid[0]}"  # an entry read at no position (b[0, h]): gathered as a tile of it
        return table_read(spelling, table, row, col)

    flavour = Flavour(
        names=names,
        infinity=('float("-inf")', 'float("inf")'),
        constant=constant,
        add=lambda terms: "(" + " + ".join(terms).replace("+ -", "- ") + ")",
        mul=mul,
        power=power,
        call=call,
        piecewise=where,
        not_=lambda a: f"(~{a})",
        read=read,
        # a table read at an index read from a constant (Swin's T[idx[i, j], h]): the index a gather too, its range
        # checked by the module before any launch (``index_checks``)
        checked_read=lambda table, row, col, name, source: read(table, row, col),
    )
    return flavour


def index_checks(logits: tuple[Basic, ...], helper: Callable[[str], str]) -> list[str]:
    """The module's lines checking, before any launch, each constant read as a table's index in the cores' logits
    (Swin's idx of T[idx[i, j], h]): the torch runtime's ``checked_index`` (helper: the torch printer's, which copies
    it) of every entry of idx, an integer inside T's rows (axis −2) or columns (−1), since a kernel's gather cannot
    raise. Such an index is the constant's entry itself; an expression of one (idx[i, j] + 1) is refused in one
    line (its range is no entry's)."""
    lines = []
    for formula in (x.formula for e in logits for x in postorder(e) if isinstance(x, Entries)):
        for read in sorted(formula.atoms(MatrixElement), key=sp.default_sort_key):
            for axis, index in zip((-2, -1), read.indices):
                if not index.atoms(MatrixElement):
                    continue
                if not isinstance(index, MatrixElement):
                    raise SymattnError(
                        f"the Triton kernels read {read.parent.name} at an entry of a constant, not at {index}: "
                        "use the torch backend"
                    )
                source, table = str(index.parent.name), str(read.parent.name)
                what = "row" if axis == -2 else "column"
                lines.append(
                    f'{helper("checked_index")}({source}, {table}.shape[{axis}], "{what}", "{table}", "{source}")'
                )
    return list(dict.fromkeys(lines))
