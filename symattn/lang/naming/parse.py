"""A safe parser for formulas written in symattn's expression language.

The text is read with Python's ``ast`` (mode "eval") and only a whitelist of node
types is turned into SymPy: names from a given table, numbers, ``+ - * @ / **``,
``.T`` and calls of the functions in ``FUNCTIONS``. Nothing is ever evaluated as
Python, and anything outside the whitelist is refused with its column:

    X.T * P.T * G                                  # Xᵀ Pᵀ G
    hadamard(P, G*V.T - rowsum(hadamard(G*V.T, P)) * ones(1, m)) * K / sqrt(d_k)
    V.T * concat(P_h.T * heads(G * W_O.T))         # per-head blocks, concatenated

Shapes are checked as the formula is read; a mismatch names both shapes and the column.
Matrix products, sums and transposes are built on the DAG (``lang.algebra``), never by
SymPy's operators, whose deep ``doit`` would rewrite every node below a name of a deep spec.

Every formula is cheap to evaluate: numbers are 0 or lie in [1e-12, 1e12] in magnitude,
an exponent is a number p with |p| ≤ 64 (also after SymPy combines (x^a)^b = x^(ab)),
a power of a number has at most 4096 bits, and it is checked *before* SymPy computes
it (so 10**10**10 is refused, not evaluated). A scalar that is not a finite real
number (1/0, 0**-1, sqrt(-1)) is refused where it is written.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import Identity, OneMatrix, Trace, ZeroMatrix

from symattn.errors import ShapeMismatchError, SymattnError
from symattn.lang import ops
from symattn.lang.algebra import product, total, transpose
from symattn.lang.dims import same_dim

MAX_NUMBER = 10**12  # |literal| ≤ 1e12 …
MIN_NUMBER = 1e-12  # … and ≥ 1e-12 unless it is 0
MAX_EXPONENT = 64  # |p| in x**p
MAX_POWER_BITS = 4096  # numerator and denominator of a number raised to a power
MAX_SIZE = 10**6  # a literal size in ones(r, c), zeros(r, c), eye(k)


class ParseError(SymattnError, ValueError):
    """A formula that does not parse, naming the column where it goes wrong."""

    def __init__(self, message: str, column: int | None = None) -> None:
        self.column = column
        super().__init__(f"{message} at column {column}" if column is not None else message)


def _matrix(value: Basic, what: str, node: ast.AST) -> MatrixExpr:
    if not isinstance(value, MatrixExpr):
        raise ParseError(f"{what} takes a matrix, got the scalar {value}", _col(node))
    return value


def _scalar(value: Basic, what: str, node: ast.AST) -> Basic:
    if isinstance(value, MatrixExpr):
        raise ParseError(f"{what} takes a scalar, got a matrix of shape {_shape(value)}", _col(node))
    return value


def _col(node: ast.AST) -> int:
    """1-based column in the formula as written (it is parsed inside one added parenthesis)."""
    return getattr(node, "col_offset", 1)


def _shape(m: MatrixExpr) -> str:
    return "(" + ", ".join(str(d) for d in m.shape) + ")"


def _dim(value: Basic, node: ast.AST) -> Basic:
    value = _scalar(value, "a size", node)
    if not (value.is_integer and value.is_positive):
        raise ParseError(f"a size must be a positive integer or dimension, got {value}", _col(node))
    if value.is_Number and value > MAX_SIZE:
        raise ParseError(f"a size must be at most {MAX_SIZE}, got {value}", _col(node))
    return value


def _finite_real(value: Basic, what: str, column: int) -> Basic:
    """value itself if it is a matrix or a finite real scalar; else a ParseError at column."""
    if isinstance(value, MatrixExpr):
        return value
    if value.has(sp.zoo, sp.nan) or value.has(sp.oo) or value.has(-sp.oo):
        raise ParseError(f"{what} is not a finite number ({value})", column)
    if value.has(sp.I) or value.is_real is False:
        raise ParseError(f"{what} is not a real number ({value})", column)
    return value


def _power_bits(base: Basic, exponent: Basic) -> float:
    """Bits of the numerator or denominator of base**exponent for a rational base (0 otherwise)."""
    if not base.is_Rational or base == 0:
        return 0.0
    bits = max(abs(base.p).bit_length(), abs(base.q).bit_length())
    return bits * float(abs(exponent))


def _function(name: str, construct: Callable) -> Callable:
    """The reader of a function call f(A) of the records (softmax, exp, …), parameters after A (clamp(A, -1, 1))."""
    return lambda node, a, *parameters: construct(_matrix(a, name, node), *parameters)


class _Reader:
    """Turns one whitelisted ``ast`` tree into a SymPy expression."""

    def __init__(self, source: str, names: Mapping[str, Basic], heads: Basic | None) -> None:
        self.source = source
        self.names = names
        self.heads = heads
        self.functions: dict[str, Callable] = {
            **{name: _function(name, f) for name, f in ops.CONSTRUCTORS.items()},
            "rowsum": lambda n, a: ops.rowsum(_matrix(a, "rowsum", n)),
            "sum": lambda n, a: ops.sum(_matrix(a, "sum", n)),
            "tr": self._trace,
            "trace": self._trace,
            "hadamard": self._hadamard,
            "sqrt": lambda n, a: _finite_real(sp.sqrt(_scalar(a, "sqrt", n)), "sqrt", _col(n)),
            "ones": lambda n, r, c: OneMatrix(_dim(r, n), _dim(c, n)),
            "zeros": lambda n, r, c: ZeroMatrix(_dim(r, n), _dim(c, n)),
            "eye": lambda n, k: Identity(_dim(k, n)),
            "heads": self._split,
            "split_heads": self._split,
            "concat": self._merge,
            "Concat": self._merge,
            "merge_heads": self._merge,
        }

    def read(self, node: ast.AST) -> Basic:
        method = getattr(self, f"_read_{type(node).__name__}", None)
        if method is None:
            raise ParseError(f"{type(node).__name__} is not part of the expression language", _col(node))
        return method(node)

    def _read_Expression(self, node: ast.Expression) -> Basic:
        return self.read(node.body)

    def _read_Constant(self, node: ast.Constant) -> Basic:
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParseError(f"only numbers are allowed as constants, got {value!r}", _col(node))
        written = self.source[node.col_offset : node.end_col_offset]
        if value != value or abs(value) > MAX_NUMBER or (value and abs(value) < MIN_NUMBER):
            raise ParseError(
                f"the number {written} is out of range (numbers are 0 or 1e-12 to 1e12 in size)", _col(node)
            )
        # a float as the decimal it was written as (0.1 is 1/10), never a binary fraction
        return sp.Integer(value) if isinstance(value, int) else sp.Rational(repr(value))

    def _read_Name(self, node: ast.Name) -> Basic:
        if node.id not in self.names:
            known = ", ".join(sorted(self.names))
            raise ParseError(f"unknown name {node.id!r} (known: {known})", _col(node))
        return self.names[node.id]

    def _read_Attribute(self, node: ast.Attribute) -> Basic:
        if node.attr != "T":
            raise ParseError(f"only .T (transpose) is allowed after a dot, got .{node.attr}", _col(node))
        return transpose(_matrix(self.read(node.value), ".T", node))

    def _read_UnaryOp(self, node: ast.UnaryOp) -> Basic:
        value = self.read(node.operand)
        if isinstance(node.op, ast.USub):
            return product(-1, value) if isinstance(value, MatrixExpr) else -value
        if isinstance(node.op, ast.UAdd):
            return value
        raise ParseError(f"operator {type(node.op).__name__} is not allowed", _col(node))

    def _operator_column(self, node: ast.BinOp) -> int:
        """Column of the operator symbol between the two operands."""
        start, end = node.left.end_col_offset, node.right.col_offset
        between = self.source[start:end]
        offset = next((i for i, ch in enumerate(between) if ch in "*@+-/"), 0)
        return start + offset

    def _read_BinOp(self, node: ast.BinOp) -> Basic:
        left, right = self.read(node.left), self.read(node.right)
        op, column = node.op, self._operator_column(node)
        if isinstance(op, (ast.Mult, ast.MatMult)):
            if isinstance(left, MatrixExpr) and isinstance(right, MatrixExpr):
                if not same_dim(left.shape[1], right.shape[0]):
                    raise ShapeMismatchError(f"matrix product at column {column}", left.shape, right.shape)
            return (
                product(left, right) if isinstance(left, MatrixExpr) or isinstance(right, MatrixExpr) else left * right
            )
        if isinstance(op, (ast.Add, ast.Sub)):
            if isinstance(left, MatrixExpr) != isinstance(right, MatrixExpr):
                raise ParseError("cannot add a matrix and a scalar", column)
            if isinstance(left, MatrixExpr) and not all(same_dim(a, b) for a, b in zip(left.shape, right.shape)):
                raise ShapeMismatchError(f"matrix sum at column {column}", left.shape, right.shape)
            if isinstance(left, MatrixExpr):
                return total(left, right if isinstance(op, ast.Add) else product(-1, right))
            return left + right if isinstance(op, ast.Add) else left - right
        if isinstance(op, ast.Div):
            divisor = _scalar(right, "division (the divisor)", node.right)
            if divisor.is_zero:
                raise ParseError("division by zero", column)
            if isinstance(left, MatrixExpr):
                return product(_finite_real(1 / divisor, "the quotient", column), left)
            return _finite_real(left / divisor, "the quotient", column)
        if isinstance(op, ast.Pow):
            return self._power(_scalar(left, "** (the base)", node.left), right, node, column)
        raise ParseError(f"operator {type(op).__name__} is not allowed", _col(node))

    def _power(self, base: Basic, exponent: Basic, node: ast.BinOp, column: int) -> Basic:
        """base**exponent, its size bounded before SymPy computes it (10**10**10 never runs)."""
        exponent = _scalar(exponent, "** (the exponent)", node.right)
        if not exponent.is_Number:
            raise ParseError(f"an exponent must be a number, got {exponent}", _col(node.right))
        if abs(exponent) > MAX_EXPONENT:
            raise ParseError(f"the exponent {exponent} is larger than {MAX_EXPONENT} in size", _col(node.right))
        if base.is_zero and exponent < 0:
            raise ParseError("division by zero (0 to a negative power)", column)
        if _power_bits(base, exponent) > MAX_POWER_BITS:
            raise ParseError(f"{base}**{exponent} has more than {MAX_POWER_BITS} bits", column)
        power = _finite_real(base**exponent, "the power", column)
        for p in power.atoms(sp.Pow):  # (x**a)**b is x**(a*b): bound the combined exponent too
            if p.exp.is_Number and abs(p.exp) > MAX_EXPONENT:
                raise ParseError(f"the combined exponent {p.exp} is larger than {MAX_EXPONENT} in size", column)
        return power

    def _read_Call(self, node: ast.Call) -> Basic:
        if not isinstance(node.func, ast.Name):
            raise ParseError("only functions called by their name are allowed", _col(node))
        if node.func.id not in self.functions:
            known = ", ".join(sorted(self.functions))
            raise ParseError(f"unknown function {node.func.id!r} (known: {known})", _col(node))
        if node.keywords:
            raise ParseError("keyword arguments are not allowed", _col(node.keywords[0].value))
        args = [self.read(a) for a in node.args]
        try:
            return self.functions[node.func.id](node, *args)
        except TypeError as err:
            if "positional argument" not in str(err):
                raise
            raise ParseError(f"wrong number of arguments to {node.func.id}()", _col(node)) from None

    def _trace(self, node: ast.AST, a: Basic) -> Basic:
        a = _matrix(a, "tr", node)
        if not same_dim(a.shape[0], a.shape[1]):
            raise ShapeMismatchError(f"trace at column {_col(node)} (needs a square matrix)", a.shape, a.shape[::-1])
        return Trace(a)

    def _hadamard(self, node: ast.AST, *factors: Basic) -> Basic:
        for f in factors:
            _matrix(f, "hadamard", node)
        if len(factors) < 2:
            raise ParseError("hadamard() takes at least two matrices", _col(node))
        try:
            return ops.hadamard(*factors)
        except ShapeMismatchError as err:
            raise ShapeMismatchError(f"hadamard product at column {_col(node)}", err.left, err.right) from None

    def _heads_of(self, node: ast.AST, given: tuple) -> Basic:
        if given:
            return _dim(given[0], node)
        if self.heads is None:
            raise ParseError("this spec has no heads; pass the number of heads as a second argument", _col(node))
        return self.heads

    def _split(self, node: ast.AST, a: Basic, *h: Basic) -> Basic:
        return ops.split_heads(_matrix(a, "heads", node), self._heads_of(node, h))

    def _merge(self, node: ast.AST, a: Basic, *h: Basic) -> Basic:
        return ops.merge_heads(_matrix(a, "concat", node), self._heads_of(node, h))


def parse(text: str, names: Mapping[str, Basic], heads: Basic | None = None) -> Basic:
    """The SymPy expression a formula denotes, with names looked up in names (no eval)."""
    if not isinstance(text, str) or not text.strip():
        raise ParseError("the formula is empty")
    if "\n" in text:
        raise ParseError("the formula must be one line")
    source = f"({text})"  # inside parentheses, so leading blanks are fine and columns stay those of text
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as err:
        column = min(max((err.offset or 1) - 1, 1), len(text) + 1)
        raise ParseError(f"cannot parse {text.strip()!r}: {err.msg}", column) from None
    except (RecursionError, MemoryError, ValueError) as err:
        raise ParseError(f"cannot parse the formula: {type(err).__name__}") from None
    try:
        return _Reader(source, names, heads).read(tree)
    except RecursionError:
        raise ParseError("the formula nests too deeply") from None
