"""A mask on data, tested a block at a time: which pairs of a block of query rows and a block of keys are wholly
masked or wholly open, from per-block extremes of the constants the condition reads (a block map, as
FlexAttention's ``create_block_mask``, computed per call in O(n/b · m/b) and never as an n × m array).

The analytic structure (``mask_structure``) needs a condition linear in i and j; a condition that reads a table at
positions (document ids ``Eq(doc[i, 0], doc[j, 0])``, a prefix length per sequence ``j < p[0, 0]``) has none until
the table's numbers are read. Over a row block [i₀, i₁] and a key block [j₀, j₁], each table read t[i, c] (or
t[j, c], t[c, i], t[c, j], t[c, c']) lies in [min, max] of the table over the block's positions; interval bounds
(``lang.positions.read_bounds``) then bound each relation's difference e = lhs − rhs over the pair of blocks: e ≥ 0
holds for every pair where its lower bound is ≥ 0, for none where its upper bound is < 0 (and so for >, ≤, <, =, ≠).
Three-valued logic carries these through ``&``, ``|``, ``~`` (Kleene): the visible condition ¬hidden is

- ``empty`` (no pair of the blocks visible: the key block is skipped) where it is false for every pair,
- ``full`` (every pair visible: the mask is not applied there) where it is true for every pair.

Sound, never exact: a relation that cannot be bounded is unknown (neither), and for equal document ids on
contiguous documents it is exact (disjoint id ranges: no equal pair; one id on both blocks: every pair equal).
The tests are SymPy booleans of the blocks' first and last positions (``BOUNDS``) and of the reads' block extremes
(``Read.low``, ``Read.high``), printed as array code over every pair of blocks at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp
from sympy import Basic, Expr
from sympy.core.relational import Relational
from sympy.logic.boolalg import Boolean
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.lang.positions import I, J, read_bounds
from symattn.optimize.mask_structure import hidden
from symattn.optimize.position_blocks import HEAD

# the first and last row of a row block, the first and last key of a key block (as the printed code names them)
FIRST_I, LAST_I = sp.Symbol("i", integer=True), sp.Symbol("i_last", integer=True)
FIRST_J, LAST_J = sp.Symbol("j", integer=True), sp.Symbol("j_last", integer=True)
BOUNDS = (FIRST_I, LAST_I, FIRST_J, LAST_J)


@dataclass(frozen=True)
class Read:
    """A table read t[r, c] of the condition: ``along`` the position its index runs over (I, J) or None (both
    indices constant: one value per sequence); ``low`` and ``high`` its least and greatest value over a block."""

    element: MatrixElement
    along: Basic | None
    low: sp.Symbol
    high: sp.Symbol


@dataclass(frozen=True)
class BlockTest:
    """The block test of a mask: ``empty`` and ``full`` (SymPy booleans of ``BOUNDS`` and the reads' extremes)."""

    reads: tuple[Read, ...]
    empty: Boolean
    full: Boolean


def _read(element: MatrixElement, k: int) -> Read | None:
    """The read as a Read, or None: an index that is neither constant (free of positions) nor i or j alone, or
    both indices along positions."""
    along = [x for x in element.indices if x.has(I, J) or x.free_symbols - _sizes(x)]
    if len(along) > 1 or (along and along[0] not in (I, J)):
        return None
    low, high = sp.Symbol(f"t{k}_lo", real=True), sp.Symbol(f"t{k}_hi", real=True)
    return Read(element, along[0] if along else None, low, high)


def _sizes(x: Expr) -> set:
    return {s for s in x.free_symbols if s.is_integer and s.is_positive}


def _relation(relation: Relational, ranges: dict) -> tuple[Boolean, Boolean]:
    """(holds for every pair, holds for none) of a relation over the blocks, from e = lhs − rhs's bounds."""
    bounds = read_bounds(relation.lhs - relation.rhs, ranges)
    if bounds is None:
        return sp.false, sp.false
    lo, hi = bounds
    rules = {
        ">=": (lo >= 0, hi < 0),
        ">": (lo > 0, hi <= 0),
        "<=": (hi <= 0, lo > 0),
        "<": (hi < 0, lo >= 0),
        "==": (sp.And(lo >= 0, hi <= 0), sp.Or(lo > 0, hi < 0)),
        "!=": (sp.Or(lo > 0, hi < 0), sp.And(lo >= 0, hi <= 0)),
    }
    return rules.get(relation.rel_op, (sp.false, sp.false))


def _kleene(condition: Boolean, ranges: dict) -> tuple[Boolean, Boolean]:
    """(true for every pair of the blocks, false for every pair) of a condition, by three-valued logic."""
    if condition in (sp.true, sp.false):
        return condition, sp.Not(condition)
    if isinstance(condition, Relational):
        return _relation(condition, ranges)
    if isinstance(condition, sp.Not):
        always, never = _kleene(condition.args[0], ranges)
        return never, always
    parts = [_kleene(a, ranges) for a in condition.args]
    if isinstance(condition, sp.And):
        return sp.And(*(p[0] for p in parts)), sp.Or(*(p[1] for p in parts))
    if isinstance(condition, sp.Or):
        return sp.Or(*(p[0] for p in parts)), sp.And(*(p[1] for p in parts))
    return sp.false, sp.false


def block_test(formula: Expr) -> BlockTest | None:
    """The block test of f(i, j)'s mask (−∞ where ``hidden(f)``), or None where its condition reads no table (its
    structure is analytic: ``mask_structure``), is not known, reads the head, or reads a table otherwise than at i,
    at j or at constant indices."""
    condition = hidden(formula)
    if condition in (None, sp.false) or condition.has(HEAD):
        return None
    elements = sorted(condition.atoms(MatrixElement), key=sp.default_sort_key)
    reads = [_read(e, k) for k, e in enumerate(elements)]
    if not reads or any(r is None for r in reads):
        return None
    symbols = {r.element: sp.Dummy(f"t{k}") for k, r in enumerate(reads)}
    ranges = {I: (FIRST_I, LAST_I), J: (FIRST_J, LAST_J)} | {symbols[r.element]: (r.low, r.high) for r in reads}
    visible = sp.Not(condition).xreplace(symbols)
    full, empty = _kleene(visible, ranges)
    if empty == sp.false:
        return None
    return BlockTest(tuple(reads), empty, full)
