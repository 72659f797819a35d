"""Positions: the rows × cols matrix whose (i, j) entry is a formula of the query position i and the key position j.

``sa.entries(rows, cols, f)`` is ``Entries(rows, cols, Lambda((i, j), f(i, j)))``: SymPy's ``FunctionMatrix``
under its own name, so that every table of the language (shapes, differentiation, printers, the code
generators) knows it apart from a matrix SymPy might build itself. A position is an index, not an array: the
node holds the formula, and each backend computes the entries from the positions (``i`` a column of
0 … rows − 1, ``j`` a row of 0 … cols − 1) where they are used; no n × m array of them is an argument.

The formula may use i, j, dimensions, numbers, ``Abs``, ``Min``, ``Max``, ``floor``, ``ceiling``, ``log``,
``exp``, ``sqrt``, ``sign``, and ``Piecewise`` with relational conditions (``&``, ``|``, ``~``) and −∞ among
its values (a mask added to the scores: ALiBi's −slope·|i − j|, a distance decay, a causal or sliding window).
A trainable scalar τ in the formula (a learned slope) is the node's operand: τ̄ = tr(Gᵀ [∂f/∂τ]) and
d[f] = dτ [∂f/∂τ], the derivative a matrix of positions again; with none, no cotangent reaches the node. Entries
of matrices read at positions (a learned relative table ``b[|i − j|, 0]``) are refused in one line naming them.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy import Basic, Expr
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions import FunctionMatrix, MatrixExpr
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.errors import SymattnError
from symattn.lang.lazy import Matrix

I = sp.Symbol("i", integer=True, nonnegative=True)  # noqa: E741  (the query position, a row index)
J = sp.Symbol("j", integer=True, nonnegative=True)  # the key position, a column index

# the scalar nodes a position formula may hold (besides numbers, i, j and dimensions)
FORMULA_NODES: tuple[type, ...] = (
    sp.Add,
    sp.Mul,
    sp.Pow,
    sp.Abs,
    sp.Min,
    sp.Max,
    sp.floor,
    sp.ceiling,
    sp.log,
    sp.exp,
    sp.sign,
    sp.Piecewise,
    sp.functions.elementary.piecewise.ExprCondPair,
    sp.core.relational.Relational,
    sp.And,
    sp.Or,
    sp.Not,
)


class Entries(FunctionMatrix):
    """The rows × cols matrix [f(i, j)]: args (rows, cols, Lambda((i, j), f)), i and j the canonical ``I``, ``J``."""

    @property
    def formula(self) -> Expr:
        """f(i, j), a SymPy expression of ``I`` and ``J``."""
        return self.lamda.expr

    @property
    def scalars(self) -> tuple[sp.Symbol, ...]:
        """The trainable scalars the formula reads (a learned slope), by name: the node's operands."""
        return tuple(sorted((x for x in self.formula.free_symbols if not x.is_integer), key=str))

    def derivative(self, scalar: sp.Symbol) -> Entries:
        """[∂f/∂τ (i, j)]: the formula differentiated in a trainable scalar, a matrix of positions again (a step's
        derivative as a Piecewise, a Dirac delta 0: as torch differentiates sign and comparisons)."""
        formula = sp.diff(self.formula, scalar)
        formula = formula.replace(lambda e: isinstance(e, sp.DiracDelta), lambda e: sp.S.Zero)
        if formula.has(sp.Heaviside):
            formula = formula.rewrite(sp.Piecewise)
        return Entries(self.rows, self.cols, sp.Lambda((I, J), formula))

    @property
    def masks(self) -> bool:
        """Whether some entry may be −∞ (a mask, added to the scores)."""
        return self.formula.has(-sp.oo)


def _dimension(size: object, what: str) -> Expr:
    if isinstance(size, bool) or not isinstance(size, (int, Basic)):
        raise SymattnError(f"sa.entries: {what} must be a dimension or a positive int, got {size!r}")
    size = sp.sympify(size)
    if not (size.is_integer and size.is_positive):
        raise SymattnError(f"sa.entries: {what} must be a dimension or a positive int, got {size}")
    return size


def check_formula(formula: Expr) -> Expr:
    """formula, if it is a position formula (see the module docstring); else one line naming what is not."""
    if not isinstance(formula, Basic):
        raise SymattnError(f"sa.entries: f(i, j) must be a SymPy expression, got {type(formula).__name__}")
    for node in sp.preorder_traversal(formula):
        if isinstance(node, MatrixElement):
            raise SymattnError(
                f"sa.entries: {node} reads an entry of {node.parent} at positions; tables read at positions are "
                "not in the language yet"
            )
        if isinstance(node, sp.Symbol):
            if node in (I, J) or (node.is_integer and node.is_positive) or node.is_real:  # a real: a trainable scalar
                continue
            raise SymattnError(
                f"sa.entries: {node} is no position, dimension or trainable scalar (a real symbol, sa.scalar)"
            )
        if node.is_Number or node in (sp.oo, -sp.oo, sp.true, sp.false) or isinstance(node, (sp.Tuple,)):
            continue
        if not isinstance(node, FORMULA_NODES) and not isinstance(node, BooleanFunction):
            raise SymattnError(f"sa.entries: {type(node).__name__} ({node}) is not in a position formula")
    if formula.is_Boolean or isinstance(formula, sp.core.relational.Relational):
        raise SymattnError(
            "sa.entries: f(i, j) is a condition; write a Piecewise of values, e.g. Piecewise((0, i >= j), (-oo, True))"
        )
    return formula


def make(rows: object, cols: object, f: Callable | sp.Lambda | Expr) -> Entries:
    """The Entries node of f: a function of (i, j), a Lambda of two variables, or an expression of ``I``, ``J``."""
    rows, cols = _dimension(rows, "rows"), _dimension(cols, "cols")
    if isinstance(f, sp.Lambda):
        if len(f.variables) != 2:
            raise SymattnError(f"sa.entries: the Lambda takes {len(f.variables)} variables; f takes (i, j)")
        formula = f(I, J)
    elif callable(f) and not isinstance(f, Basic):
        formula = sp.sympify(f(I, J))
    else:
        formula = sp.sympify(f)
    return Entries(rows, cols, sp.Lambda((I, J), check_formula(formula)))


def entries(rows: object, cols: object, f: Callable | sp.Lambda | Expr, heads: object = None) -> Matrix:
    """sa.entries(rows, cols, f): the rows × cols matrix whose (i, j) entry is f(i, j), i the 0-based row (query)
    position and j the column (key) position, e.g. ALiBi's ``lambda i, j: -slope * sp.Abs(i - j)`` or a causal
    window ``lambda i, j: sp.Piecewise((0, (j <= i) & (i - j < w)), (-sp.oo, True))``.

    With ``heads=H``, f takes (i, j, h), h the 0-based head, and the result is per head (what ``split_heads`` makes
    of an input), e.g. ALiBi's slopes ``lambda i, j, h: -2 ** (-8 * (h + 1) / H) * sp.Abs(i - j)``: it is
    split_heads(E, H) of the rows × H·cols matrix E whose column j holds head ⌊j/cols⌋'s column j − cols⌊j/cols⌋,
    the layout of every per-head constant of the language."""
    if heads is None:
        return Matrix(make(rows, cols, f))
    from symattn.lang.ops import split_heads  # (ops builds on this module's neighbours; imported where used)

    count, width = _dimension(heads, "heads"), _dimension(cols, "cols")
    if isinstance(f, sp.Lambda):
        if len(f.variables) != 3:
            raise SymattnError(
                f"sa.entries: the Lambda takes {len(f.variables)} variables; with heads, f takes (i, j, h)"
            )
        per_head = f
    elif callable(f) and not isinstance(f, Basic):
        per_head = f
    else:
        raise SymattnError("sa.entries: with heads, f is a function of (i, j, h)")

    def laid_out(i: Expr, j: Expr) -> Expr:
        head = sp.floor(j / width)
        return per_head(i, j - width * head, head)

    return split_heads(Matrix(make(rows, count * width, laid_out)), count)


def from_function_matrix(node: FunctionMatrix) -> Entries:
    """SymPy's own FunctionMatrix as the language's node (the same matrix)."""
    return make(node.rows, node.cols, node.lamda)


def canonical(functions: tuple[FunctionMatrix, ...]) -> tuple[Entries, ...]:
    """SymPy's own FunctionMatrix nodes as the language's Entries (the same matrices)."""
    return tuple(from_function_matrix(f) for f in functions)


HEAD = sp.Symbol("h", integer=True, nonnegative=True)  # the head of a per-head formula (``entries(…, heads=H)``)


class EntriesBlock(MatrixExpr):
    """The block of [f(i, j)] a loop over blocks of query rows reads: the rows of the loop's block (``rows``, its
    size symbol), the keys of its key range; args (source, rows, heads): source an Entries (heads 0), or the
    rows × H·cols Entries that ``entries(…, heads=H)`` splits into heads (heads H, the block per head). Code
    generation makes it (``schedule.rowblocks``) and the printers compute it from positions, never whole."""

    def __new__(cls, source: Entries, rows: Expr, heads: Expr = sp.S.Zero) -> EntriesBlock:
        return Basic.__new__(cls, source, sp.sympify(rows), sp.sympify(heads))

    @property
    def source(self) -> Entries:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[2]

    @property
    def shape(self) -> tuple:
        cols = self.source.cols / self.heads if self.heads else self.source.cols
        return (self.args[1], cols)

    @property
    def formula(self) -> Expr:
        """f(i, j), or with heads f(i, j, h) of ``I``, ``J``, ``HEAD``: the per-head formula, j a key of its head
        (the laid-out column j' = h·cols + j read back: ⌊j'/cols⌋ = h)."""
        if not self.heads:
            return self.source.formula
        width = self.shape[1]
        laid_out = self.source.formula.xreplace({sp.floor(J / width): HEAD})
        return laid_out.xreplace({J: J + width * HEAD})  # (j + w·h − w·h: SymPy's sums cancel it)


def in_blocks(expr: Basic, rows: Expr) -> Basic:
    """expr with each matrix of positions in it (an Entries, or the split_heads of one) as its block of rows (an
    EntriesBlock of rows rows): what a loop over blocks of query rows computes of it."""
    from symattn.lang.ops import SplitHeads

    found: dict[Basic, Basic] = {}
    for node in sp.preorder_traversal(expr):
        if isinstance(node, SplitHeads) and isinstance(node.arg, Entries):
            found[node] = EntriesBlock(node.arg, rows, node.heads)
        elif isinstance(node, Entries):
            found.setdefault(node, EntriesBlock(node, rows))
    return expr.xreplace(found) if found else expr  # (top down: a split_heads before the Entries in it)
