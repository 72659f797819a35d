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
position formulas that no table enters, and they must stay inside b for every 0 ≤ i < rows, 0 ≤ j < cols, shown
from the sizes by interval bounds (``read_bounds``); one that cannot be shown so is refused in one line. Its
differential reads the tangent at the same positions, d[f] = [Σ ∂f/∂b[r, c] · db[r, c]], and its cotangent is the
scatter of the score cotangent (``Scatter``): b̄[k, l] = Σ_{(i, j): (r, c)(i, j) = (k, l)} (G ⊙ [∂f/∂b[r, c]])ᵢⱼ.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.core.relational import Relational
from sympy.logic.boolalg import BooleanFunction
from sympy.matrices.expressions import FunctionMatrix, HadamardProduct, MatAdd, MatMul
from sympy.matrices.expressions.matexpr import MatrixElement

from symattn.errors import SymattnError
from symattn.lang.lazy import Matrix

Bounds = tuple[Expr, Expr]  # (lowest, highest) value of a position formula over the positions

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
        """The trainable scalars the formula reads (a learned slope), by name: operands of the node."""
        return tuple(
            sorted((x for x in self.formula.free_symbols if isinstance(x, sp.Symbol) and not x.is_integer), key=str)
        )

    @property
    def reads(self) -> tuple[MatrixElement, ...]:
        """The distinct table entries the formula reads at positions, b[r(i, j), c(i, j)], in a fixed order."""
        return tuple(sorted(self.formula.atoms(MatrixElement), key=sp.default_sort_key))

    @property
    def tables(self) -> tuple[Basic, ...]:
        """The matrices the formula reads at positions (inputs, constants, or their tangents): operands of the node."""
        return tuple(sorted({r.parent for r in self.reads}, key=sp.default_sort_key))

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


def _lifted(e: Expr) -> Expr:
    """c + Min(a, b) as Min(c + a, c + b), and so for Max: a sum's Min or Max term taken outermost; −Max(a, b) as
    Min(−a, −b), −Min(a, b) as Max(−a, −b)."""
    if isinstance(e, sp.Mul) and e.args[0] == -1 and len(e.args) == 2 and isinstance(e.args[1], (sp.Min, sp.Max)):
        flipped = sp.Max if isinstance(e.args[1], sp.Min) else sp.Min
        return flipped(*(-a for a in e.args[1].args), evaluate=False)
    if isinstance(e, sp.Add):
        for term in e.args:
            if isinstance(term, (sp.Min, sp.Max)):
                rest = e - term
                return term.func(*(rest + a for a in term.args), evaluate=False)
    return e


def _ordered(low: Expr, high: Expr) -> bool:
    """Whether low ≤ high for every size (True only when shown: Min and Max taken apart, then SymPy's assumptions)."""
    low, high = _lifted(low), _lifted(high)
    if isinstance(low, sp.Max):  # Max(a, b) ≤ high ⇔ a ≤ high and b ≤ high
        return all(_ordered(a, high) for a in low.args)
    if isinstance(high, sp.Min):  # low ≤ Min(a, b) ⇔ low ≤ a and low ≤ b
        return all(_ordered(low, a) for a in high.args)
    if isinstance(high, sp.Max) and any(_ordered(low, a) for a in high.args):  # low ≤ a ≤ Max(a, b)
        return True
    if isinstance(low, sp.Min) and any(_ordered(a, high) for a in low.args):  # Min(a, b) ≤ a ≤ high
        return True
    return bool((high - low).is_nonnegative)


def _monotone(bounds: Bounds, f: Callable[[Expr], Expr]) -> Bounds:
    return f(bounds[0]), f(bounds[1])


def _product(e: sp.Mul, inner: Callable[[Basic], Bounds]) -> Bounds:
    """A constant factor (numbers and dimensions) of known sign times varying ones; several varying factors only
    where each is shown nonnegative (then the ends multiply)."""
    sizes = {s for s in e.free_symbols if s.is_positive and s.is_integer}
    constant, varying = e.as_independent(*(e.free_symbols - sizes))
    parts = [inner(f) for f in sp.Mul.make_args(varying)]
    if len(parts) > 1 and not all(_ordered(sp.S.Zero, lo) for lo, _ in parts):
        raise ValueError(e)
    lo, hi = sp.Mul(*(p[0] for p in parts)), sp.Mul(*(p[1] for p in parts))
    if constant.is_nonnegative:
        return constant * lo, constant * hi
    if constant.is_nonpositive:
        return constant * hi, constant * lo
    raise ValueError(e)


def _absolute(bounds: Bounds) -> Bounds:
    lo, hi = bounds
    if _ordered(sp.S.Zero, lo):
        return lo, hi
    if _ordered(hi, sp.S.Zero):
        return -hi, -lo
    return sp.S.Zero, sp.Max(-lo, hi)


BOUND_RULES: dict[type, Callable[[Basic, Callable[[Basic], Bounds]], Bounds]] = {
    sp.Add: lambda e, inner: tuple(sp.Add(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.Mul: _product,
    sp.Abs: lambda e, inner: _absolute(inner(e.args[0])),
    sp.Min: lambda e, inner: tuple(sp.Min(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.Max: lambda e, inner: tuple(sp.Max(*side) for side in zip(*(inner(a) for a in e.args))),  # type: ignore[misc]
    sp.floor: lambda e, inner: _monotone(inner(e.args[0]), sp.floor),  # increasing functions: ends to ends
    sp.ceiling: lambda e, inner: _monotone(inner(e.args[0]), sp.ceiling),
    sp.log: lambda e, inner: _monotone(inner(e.args[0]), sp.log),
    sp.exp: lambda e, inner: _monotone(inner(e.args[0]), sp.exp),
    sp.sign: lambda e, inner: (sp.S.NegativeOne, sp.S.One),
}


def _refined(known: dict, condition: Basic, inner: Callable[[Basic], Bounds]) -> dict:
    """known (bounds by subexpression) where condition holds: a comparison of a formula x with a constant c bounds x
    (x < c: x ≤ c − 1 for an integer x, ≤ c else), a conjunction each of its terms; any other condition nothing."""
    if isinstance(condition, sp.And):
        for term in condition.args:
            known = _refined(known, term, inner)
        return known
    if isinstance(condition, sp.Not) and isinstance(condition.args[0], Relational):
        condition = condition.args[0].negated
    if not isinstance(condition, Relational) or condition.rel_op in ("!=", "=="):
        return known
    x, c, op = condition.lhs, condition.rhs, condition.rel_op
    if c.free_symbols & {I, J}:
        x, c, op = c, x, {"<": ">", "<=": ">=", ">": "<", ">=": "<="}[op]
    if c.free_symbols & {I, J} or not x.free_symbols & {I, J}:
        return known
    strict = 1 if x.is_integer and c.is_integer else 0
    lo, hi = inner(x)
    if op in ("<", "<="):
        hi = sp.Min(hi, c - (strict if op == "<" else 0))
    else:
        lo = sp.Max(lo, c + (strict if op == ">" else 0))
    return {**known, x: (lo, hi)}


def read_bounds(index: Expr, ranges: dict[sp.Symbol, Bounds]) -> Bounds | None:
    """(lowest, highest) value of an index formula when each position symbol p runs over ranges[p] (dimensions and
    numbers fixed), by interval bounds per node (``BOUND_RULES``); a Piecewise's value bounded where its condition
    holds and the earlier ones do not (``_refined``). None where a node has no rule (say, a power)."""

    def bounded(known: dict) -> Callable[[Basic], Bounds]:
        def inner(e: Basic) -> Bounds:
            if e in known:
                return known[e]
            if not e.free_symbols & set(ranges):
                return e, e
            if isinstance(e, sp.Piecewise):
                return _branches(e, known, inner)
            rule = BOUND_RULES.get(type(e))
            if rule is None:
                raise ValueError(e)
            return rule(e, inner)

        return inner

    def _branches(e: sp.Piecewise, known: dict, inner: Callable[[Basic], Bounds]) -> Bounds:
        sides = []
        for value, condition in e.args:
            sides.append(bounded(_refined(known, condition, inner))(value))
            known = _refined(known, sp.Not(condition), inner)
            inner = bounded(known)
        return sp.Min(*(lo for lo, _ in sides)), sp.Max(*(hi for _, hi in sides))

    try:
        return bounded(dict(ranges))(index)
    except ValueError:
        return None


def _integral(e: Basic) -> bool:
    """Whether e is an integer at every position: SymPy says so, a floor or ceiling, or a sum, product, Min, Max or
    Piecewise of such (an index made by cases, as T5's buckets)."""
    if e.is_integer or isinstance(e, (sp.floor, sp.ceiling)):
        return True
    if isinstance(e, sp.Piecewise):
        return all(_integral(value) for value, _ in e.args)
    return isinstance(e, (sp.Add, sp.Mul, sp.Min, sp.Max)) and all(_integral(a) for a in e.args)


def _check_read(read: MatrixElement, ranges: dict[sp.Symbol, Bounds]) -> None:
    """read = b[r, c]: b a matrix symbol, r and c integer position formulas inside b for every position in ranges."""
    table = read.parent
    if not isinstance(table, sp.MatrixSymbol):
        raise SymattnError(
            f"sa.entries: {read} reads an entry of {table}; a table read at positions is an input or a constant"
        )
    for index, size, what in zip(read.indices, table.shape, ("row", "column")):
        if index.has(MatrixElement):
            raise SymattnError(
                f"sa.entries: {read} reads its {what} index {index} from a table; an index is a formula of positions"
            )
        if not _integral(index):
            raise SymattnError(
                f"sa.entries: {read}'s {what} index {index} is not an integer; round it with sp.floor or sp.ceiling"
            )
        bounds = read_bounds(index, ranges)
        if bounds is None or not (_ordered(sp.S.Zero, bounds[0]) and _ordered(bounds[1], size - 1)):
            span = "cannot be bounded" if bounds is None else f"runs over [{bounds[0]}, {bounds[1]}]"
            where = ", ".join(f"{p} in [{lo}, {hi}]" for p, (lo, hi) in ranges.items())
            raise SymattnError(
                f"sa.entries: {read}'s {what} index {index} {span} for {where}, not shown to stay in [0, {size - 1}] "
                f"({table} is {table.shape[0]} × {table.shape[1]}); clamp it with sp.Min/sp.Max or size the table"
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


def tables_read(expr: Basic) -> frozenset[Basic]:
    """The matrices expr reads at positions (the tables of its Entries nodes): with the inputs' batch axes in generated
    code, one per sequence (a constant: document ids, a per-sequence scale read as [C_ij])."""
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
