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
d[f] = dτ [∂f/∂τ], the derivative a matrix of positions again; with none, no cotangent reaches the node.

A table read at positions, ``b[r(i, j), c(i, j)]`` with b an input or a constant of the spec (a learned relative
bias ``b[|i − j|, 0]``, a per-token constant ``doc[i, 0]``), makes b an operand too. Its indices are integer
position formulas, and they must stay inside b for every 0 ≤ i < rows, 0 ≤ j < cols, shown from the sizes by
interval bounds (``indices.bounds.read_bounds``); one that cannot be shown so is refused in one line. An index may
read a constant of integer values at positions itself (a nested read, Swin's ``T[idx[i, j], h]``, idx a
constant of the spec: ``require_constant_indices`` refuses an input there, in derive and code generation): the
inner read is checked as any read, one level deep, and the outer index's values, which no size bounds, are
checked where the constant is given (the generated code raises ValueError naming the constant and the value
outside the table; never a read outside it).
The constant is an operand and gets no gradient; the outer read is differentiated with its index held. Its
differential reads the tangent at the same positions, d[f] = [Σ ∂f/∂b[r, c] · db[r, c]], and its cotangent is the
scatter of the score cotangent (``Scatter``): b̄[k, l] = Σ_{(i, j): (r, c)(i, j) = (k, l)} (G ⊙ [∂f/∂b[r, c]])ᵢⱼ.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions import FunctionMatrix, HadamardProduct, MatAdd, MatMul
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.errors import SymattnError
from symattn.lang.indices.bounds import Bounds, I, J, integral, ordered, read_bounds
from symattn.lang.lazy import Matrix

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
        """The trainable scalars the formula reads (a learned slope), by name: operands of the node."""
        return tuple(
            sorted((x for x in self.formula.free_symbols if isinstance(x, sp.Symbol) and not x.is_integer), key=str)
        )

    @property
    def reads(self) -> tuple[MatrixElement, ...]:
        """The distinct table entries the formula reads at positions, b[r(i, j), c(i, j)], in a fixed order (those
        read inside another read's index aside: ``index_reads``)."""
        nested = set(self.index_reads)
        return tuple(sorted(self.formula.atoms(MatrixElement) - nested, key=sp.default_sort_key))

    @property
    def index_reads(self) -> tuple[MatrixElement, ...]:
        """The entries of constants read inside a read's index (idx[i, j] of T[idx[i, j], h]), in a fixed order."""
        return tuple(sorted(nested_reads(self.formula), key=sp.default_sort_key))

    @property
    def tables(self) -> tuple[Basic, ...]:
        """The matrices the formula reads at positions (inputs, constants, or their tangents; an index's constants
        too): operands of the node."""
        every = self.formula.atoms(MatrixElement)
        return tuple(sorted({r.parent for r in every}, key=sp.default_sort_key))

    def derivative(self, x: Basic) -> Entries:
        """[∂f/∂x (i, j)] for a trainable scalar or a table read x: the formula differentiated in x (a read taken as
        one scalar variable), a matrix of positions again (a step's derivative as a Piecewise, a Dirac delta 0: as
        torch differentiates sign and comparisons)."""
        variable = x if isinstance(x, sp.Symbol) else sp.Dummy("read")
        formula = sp.diff(self.formula.xreplace({x: variable}), variable).xreplace({variable: x})
        formula = formula.replace(lambda e: isinstance(e, sp.DiracDelta), lambda e: sp.S.Zero)
        if formula.has(sp.Heaviside):
            formula = formula.rewrite(sp.Piecewise)
        return Entries(self.rows, self.cols, sp.Lambda((I, J), formula))

    @property
    def masks(self) -> bool:
        """Whether some entry may be −∞ (a mask, added to the scores)."""
        return self.formula.has(-sp.oo)


class Scatter(MatrixExpr):
    """scatter(W) = [Σ_{(i, j): (r(i, j), c(i, j)) = (k, l)} Wᵢⱼ]ₖₗ, rows × cols: each entry (k, l) of a table collects
    the entries of the n × m matrix W at the positions that read it; the transpose of reading the table at (r, c):
    tr(Wᵀ [db[r, c]]) = tr(scatter(W)ᵀ db). args (W, rows, cols, Lambda((i, j), (r, c))); its one operand is W."""

    operand_count = 1  # ``lang.graph.children``: a walk descends into W only (the rest is sizes and a formula)

    def __new__(cls, weights: MatrixExpr, rows: Expr, cols: Expr, index: sp.Lambda) -> Scatter:
        return Basic.__new__(cls, weights, sp.sympify(rows), sp.sympify(cols), index)

    @property
    def weights(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple[Expr, Expr]:
        return self.args[1], self.args[2]

    @property
    def index(self) -> tuple[Expr, Expr]:
        """(r(i, j), c(i, j)): the row and column of the table that position (i, j) reads."""
        return tuple(self.args[3].expr)

    def reading(self, matrix: MatrixExpr) -> Entries:
        """[matrix[r(i, j), c(i, j)]]ᵢⱼ, W's shape: the read that this scatter is the transpose of."""
        return Entries(*self.weights.shape, sp.Lambda((I, J), MatrixElement(matrix, *self.index)))


def scatter(weights: MatrixExpr, read: MatrixElement) -> Scatter:
    """The cotangent of the table read (b[r, c]) from the weights W = G ⊙ [∂f/∂b[r, c]]: scatter(W) into b's shape."""
    return Scatter(weights, *read.parent.shape, sp.Lambda((I, J), sp.Tuple(*read.indices)))


def _dimension(size: object, what: str) -> Expr:
    if isinstance(size, bool) or not isinstance(size, (int, Basic)):
        raise SymattnError(f"sa.entries: {what} must be a dimension or a positive int, got {size!r}")
    size = sp.sympify(size)
    if not (size.is_integer and size.is_positive):
        raise SymattnError(f"sa.entries: {what} must be a dimension or a positive int, got {size}")
    return size


def _check_read(read: MatrixElement, ranges: dict[sp.Symbol, Bounds]) -> None:
    """read = b[r, c]: b a matrix symbol, r and c integer position formulas inside b for every position in ranges."""
    table = read.parent
    if not isinstance(table, sp.MatrixSymbol):
        raise SymattnError(
            f"sa.entries: {read} reads an entry of {table}; a table read at positions is an input or a constant"
        )
    for index, size, what in zip(read.indices, table.shape, ("row", "column")):
        if index.has(MatrixElement):  # a nested read: its values checked where the constant is given
            _check_index_reads(read, index, ranges)
            continue
        if not integral(index):
            raise SymattnError(
                f"sa.entries: {read}'s {what} index {index} is not an integer; round it with sp.floor or sp.ceiling"
            )
        bounds = read_bounds(index, ranges)
        if bounds is None or not (ordered(sp.S.Zero, bounds[0]) and ordered(bounds[1], size - 1)):
            span = "cannot be bounded" if bounds is None else f"runs over [{bounds[0]}, {bounds[1]}]"
            where = ", ".join(f"{p} in [{lo}, {hi}]" for p, (lo, hi) in ranges.items())
            raise SymattnError(
                f"sa.entries: {read}'s {what} index {index} {span} for {where}, not shown to stay in [0, {size - 1}] "
                f"({table} is {table.shape[0]} × {table.shape[1]}); clamp it with sp.Min/sp.Max or size the table"
            )


def nested_reads(formula: Basic) -> set[MatrixElement]:
    """The entries read inside the indices of the formula's reads (idx[i, j] of T[idx[i, j], h])."""
    return {x for r in formula.atoms(MatrixElement) for index in r.indices for x in index.atoms(MatrixElement)}


def _check_index_reads(read: MatrixElement, index: Expr, ranges: dict[sp.Symbol, Bounds]) -> None:
    """The reads in read's index: each of a matrix at position formulas inside it (one level: no read in theirs)."""
    for inner in index.atoms(MatrixElement):
        if any(x.has(MatrixElement) for x in inner.indices):
            raise SymattnError(
                f"sa.entries: {read} reads its index from {inner}, whose index reads a table again; an index reads a "
                "constant at position formulas, one level deep"
            )
        _check_read(inner, ranges)


def index_sizes(expr: Basic) -> dict[Basic, Expr]:
    """Each matrix read inside a table read's index (Swin's idx) → the least table dimension it indexes: the range
    0 … size − 1 its values keep to where the index is the nested read itself."""
    from symattn.lang.graph import nodes  # (the graph walk builds on the language's nodes; imported where used)

    sizes: dict[Basic, Expr] = {}
    for node in (x for x in nodes(expr) if isinstance(x, Entries)):
        for read in node.reads:
            for index, size in zip(read.indices, read.parent.shape):
                for inner in index.atoms(MatrixElement):
                    sizes[inner.parent] = sp.Min(sizes.get(inner.parent, size), size)
    return sizes


def require_constant_indices(name: str, expr: Basic, inputs: tuple[Basic, ...]) -> None:
    """Refuse, in one line, an input read inside a table read's index (Swin's idx of T[idx[i, j], h]): an index has
    no derivative, so a table read there is a constant of the spec (integer values), never a trained input."""
    for table in index_sizes(expr):
        if table in inputs:
            raise SymattnError(
                f"spec {name}: {table} is read inside a table read's index; an index reads a constant of integer "
                "values, so list it in constants, not inputs"
            )


def check_formula(formula: Expr, ranges: dict[sp.Symbol, Bounds] | None = None) -> Expr:
    """formula, if it is a position formula (see the module docstring); else one line naming what is not.

    ranges: the positions' (lowest, highest) values, against which a table read's indices are checked (None: the
    reads are checked by the caller)."""
    if not isinstance(formula, Basic):
        raise SymattnError(f"sa.entries: f(i, j) must be a SymPy expression, got {type(formula).__name__}")
    walk = sp.preorder_traversal(formula)
    for node in walk:
        if isinstance(node, MatrixElement) and ranges is not None:
            _check_read(node, ranges)
        if isinstance(node, sp.MatrixSymbol):
            walk.skip()  # a table's name and shape (its read is checked above)
            continue
        if isinstance(node, MatrixElement):
            continue
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


def make(rows: object, cols: object, f: Callable | sp.Lambda | Expr, reads_checked: bool = False) -> Entries:
    """The Entries node of f: a function of (i, j), a Lambda of two variables, or an expression of ``I``, ``J``
    (its table reads checked against 0 ≤ i < rows, 0 ≤ j < cols unless reads_checked)."""
    rows, cols = _dimension(rows, "rows"), _dimension(cols, "cols")
    ranges = None if reads_checked else {I: (sp.S.Zero, rows - 1), J: (sp.S.Zero, cols - 1)}
    if isinstance(f, sp.Lambda):
        if len(f.variables) != 2:
            raise SymattnError(f"sa.entries: the Lambda takes {len(f.variables)} variables; f takes (i, j)")
        formula = f(I, J)
    elif callable(f) and not isinstance(f, Basic):
        formula = sp.sympify(f(I, J))
    else:
        formula = sp.sympify(f)
    return Entries(rows, cols, sp.Lambda((I, J), check_formula(formula, ranges)))


def entries(rows: object, cols: object, f: Callable | sp.Lambda | Expr, heads: object = None) -> Matrix:
    """sa.entries(rows, cols, f): the rows × cols matrix whose (i, j) entry is f(i, j), i the 0-based row (query)
    position and j the column (key) position, e.g. ALiBi's ``lambda i, j: -slope * sp.Abs(i - j)``, a causal
    window ``lambda i, j: sp.Piecewise((0, (j <= i) & (i - j < w)), (-sp.oo, True))``, or a table read at positions,
    ``lambda i, j: b[sp.Abs(i - j), 0]`` (b an input or a constant; each index must stay inside b for every
    position, shown from the sizes, else refused in one line).

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

    head = sp.Symbol("h", integer=True, nonnegative=True)  # the per-head formula's reads, checked head by head
    ranges = {I: (sp.S.Zero, _dimension(rows, "rows") - 1), J: (sp.S.Zero, width - 1), head: (sp.S.Zero, count - 1)}
    check_formula(sp.sympify(per_head(I, J, head)), ranges)

    def laid_out(i: Expr, j: Expr) -> Expr:
        head = sp.floor(j / width)
        return per_head(i, j - width * head, head)

    return split_heads(Matrix(make(rows, count * width, laid_out, reads_checked=True)), count)


def sequence_tables(expr: Basic) -> frozenset[Basic]:
    """The matrices expr reads at positions, those read only inside an index aside (Swin's idx, one for every
    sequence): with the inputs' batch axes in generated code (a constant's: one per sequence, document ids)."""
    from symattn.lang.graph import nodes  # (the graph walk builds on the language's nodes; imported where used)

    return frozenset(r.parent for x in nodes(expr) if isinstance(x, Entries) for r in x.reads)


def tables_read(expr: Basic) -> frozenset[Basic]:
    """The matrices expr reads at positions (the tables of its Entries nodes, an index's constants among them): what a
    loop over blocks of positions reads whole (``sequence_tables``: those with the inputs' batch axes)."""
    from symattn.lang.graph import nodes  # (the graph walk builds on the language's nodes; imported where used)

    return frozenset(t for x in nodes(expr) if isinstance(x, Entries) for t in x.tables)


def require_per_head_reads(name: str, expr: Basic, batched: frozenset[Basic]) -> None:
    """Refuse, in one line, a matrix of positions that reads a table in batched (one per sequence: document ids) and
    meets per-head values (of ``split_heads``) without being per head itself. Generated code gives it the sequences'
    axes and the per-head values the heads' axis after them, so the two would line up sequence against head: such a
    matrix is written per head (``sa.entries(…, heads=H)``)."""
    from symattn.lang.ops import MergeHeads, RepeatHeads, SplitHeads, SumGroups  # (ops builds on this module)

    def per_head(e: Basic) -> bool:
        if isinstance(e, (SplitHeads, RepeatHeads)):
            return True
        return not isinstance(e, (MergeHeads, SumGroups)) and any(per_head(a) for a in e.args)

    def offending(e: Basic) -> Entries | None:
        if isinstance(e, Entries):
            return e if set(e.tables) & batched else None
        if isinstance(e, (SplitHeads, MergeHeads, SumGroups)):
            return None  # per head (its heads laid out), or merged back
        return next((x for x in map(offending, e.args) if x is not None), None)

    for node in sp.preorder_traversal(expr):
        if isinstance(node, (MatAdd, MatMul, HadamardProduct)) and per_head(node):  # a sum or product of operands
            found = next((offending(a) for a in node.args if not per_head(a) and offending(a) is not None), None)
            if found is not None:
                why = "its sequences' axis would meet the heads'; write it per head, sa.entries(…, heads=H)"
                raise SymattnError(
                    f"spec {name}: {found.formula} reads a constant per sequence beside per-head values: {why}"
                )


def from_function_matrix(node: FunctionMatrix) -> Entries:
    """SymPy's own FunctionMatrix as the language's node (the same matrix)."""
    return make(node.rows, node.cols, node.lamda)


def canonical(functions: tuple[FunctionMatrix, ...]) -> tuple[Entries, ...]:
    """SymPy's own FunctionMatrix nodes as the language's Entries (the same matrices)."""
    return tuple(from_function_matrix(f) for f in functions)
