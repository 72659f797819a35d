"""Matrices of the spec language whose operators build each expression in constant time.

SymPy's operators re-canonicalise the whole tree at each step (``MatMul(a, b).doit()`` walks every
node of a and b, as a tree): an L-layer stack written with them takes time exponential in L. A
``Matrix`` (``sa.matrix``) wraps an expression and builds with ``lang.algebra``'s ``product``,
``total`` and ``transpose``, which canonicalise only the node they make (hash-consed, memoised):

    X * W, X @ W        the matrix product (a scalar on either side scales)
    A + B, A - B, -A    sums and differences
    A / c               a scalar multiple
    A ** k              a power of a square matrix, k a positive integer
    A.T                 the transpose, through a product's factors (one level), else one Transpose node
    A[i:j, k:l]         a block

The node functions (``sa.softmax``, ``sa.exp``, …) return a ``Matrix`` when given one; ``sa.ones`` and
``sa.identity`` make the constant matrices as ``Matrix`` values. A ``Matrix`` is accepted wherever symattn
takes a SymPy expression (``Spec``, ``grad``, ``derive``, ``check``, ``lambdify``): ``plain`` unwraps it.
SymPy's own functions (``sp.Trace(A)``, ``sp.HadamardProduct(A, B)``) take it too, through SymPy's
``_sympy_`` protocol. A SymPy scalar on the left of an operator defers to the ``Matrix`` (``_op_priority``:
``tau * A`` is built here); a SymPy *matrix* on the left does not (SymPy's matrix operators convert their
operand first), so ``sp.OneMatrix(n, 1) * b`` is SymPy's product: correct, built by SymPy's rules, and
plain SymPy from there on. Written with ``sa.matrix``, ``sa.ones`` and ``sa.identity`` throughout, a spec
never leaves the constant-time operators.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import Identity, MatMul, OneMatrix, Transpose, ZeroMatrix

from symattn.errors import ShapeMismatchError, SymattnError
from symattn.lang.algebra import factors, product, total, transpose
from symattn.lang.dims import same_dim
from symattn.lang.naming.safe import expression


class Matrix:
    """A matrix expression of the spec language with constant-time operators (see the module docstring)."""

    __slots__ = ("expr",)
    _op_priority = 100.0  # above SymPy's (Expr 10, MatrixExpr 11): SymPy's operators defer to ours

    def __init__(self, expr: Basic) -> None:
        if not isinstance(expr, MatrixExpr):
            raise SymattnError(f"a Matrix wraps a matrix expression, got {type(expr).__name__} {expr!r}")
        self.expr = expr

    # SymPy's protocol: sp.Trace(A), sp.HadamardProduct(A, B), sympify(A) see the expression
    def _sympy_(self) -> Basic:
        return self.expr

    @property
    def shape(self) -> tuple:
        return self.expr.shape

    @property
    def name(self) -> str:
        return self.expr.name  # a symbol's (sa.matrix's) name; AttributeError for a compound expression

    @property
    def T(self) -> Matrix:
        """Xᵀ, (Aᵀ)ᵀ = A, (c F₁ ⋯ F_k)ᵀ = c F_kᵀ ⋯ F₁ᵀ one level deep (as SymPy writes (X W_K)ᵀ = W_Kᵀ Xᵀ), any
        other node's transpose one Transpose node (Transpose(Y) for a sum Y): pushed through a deep operand it
        would be a second copy of it, which no name of the first one matches."""
        e = self.expr
        if isinstance(e, MatMul):
            coeff, mats = factors(e)
            return Matrix(product(coeff, *(_transposed(m) for m in reversed(mats))))
        return Matrix(_transposed(e))

    def __getitem__(self, key) -> Matrix:
        return Matrix(self.expr[key])

    def __mul__(self, other: object) -> Matrix:
        return _multiply(self.expr, other, "*")

    def __rmul__(self, other: object) -> Matrix:
        return _multiply(other, self.expr, "*")

    def __matmul__(self, other: object) -> Matrix:
        return _multiply(self.expr, other, "@")

    def __rmatmul__(self, other: object) -> Matrix:
        return _multiply(other, self.expr, "@")

    def __add__(self, other: object) -> Matrix:
        return Matrix(_sum(self.expr, _matrix(other, "+")))

    def __radd__(self, other: object) -> Matrix:
        return Matrix(_sum(_matrix(other, "+"), self.expr))

    def __sub__(self, other: object) -> Matrix:
        return Matrix(_sum(self.expr, product(-1, _matrix(other, "-"))))

    def __rsub__(self, other: object) -> Matrix:
        return Matrix(_sum(_matrix(other, "-"), product(-1, self.expr)))

    def __neg__(self) -> Matrix:
        return Matrix(product(-1, self.expr))

    def __pos__(self) -> Matrix:
        return self

    def __truediv__(self, other: object) -> Matrix:
        c = _scalar(other, "/")
        if c == 0:
            raise SymattnError("a matrix divided by 0")
        return Matrix(product(1 / c, self.expr))

    def __pow__(self, k: object) -> Matrix:
        rows, cols = self.shape
        if not isinstance(k, (int, sp.Integer)) or isinstance(k, bool) or int(k) < 1:
            raise SymattnError(f"A ** k takes a positive integer k, got {k!r}")
        if not same_dim(rows, cols):
            raise ShapeMismatchError("matrix power (a square matrix)", self.shape, self.shape[::-1])
        return Matrix(product(*([self.expr] * int(k))))

    def __eq__(self, other: object) -> bool:  # equal to its expression too: grad's keys are found by either
        return self.expr == plain(other)

    def __hash__(self) -> int:
        return hash(self.expr)

    def __repr__(self) -> str:
        return repr(self.expr)

    def __str__(self) -> str:
        return str(self.expr)

    def _repr_latex_(self) -> str:
        return f"${sp.latex(self.expr)}$"


def _transposed(e: Basic) -> Basic:
    """eᵀ without entering e: Xᵀ, (Aᵀ)ᵀ = A, 𝟏ᵀ, I, else Transpose(e)."""
    if isinstance(e, Transpose):
        return e.arg
    return transpose(e) if isinstance(e, (MatrixSymbol, OneMatrix, ZeroMatrix, Identity)) else Transpose(e)


def plain(value: object) -> object:
    """value with a Matrix unwrapped to its SymPy expression (anything else as it is)."""
    return value.expr if isinstance(value, Matrix) else value


def matrix(name: str, rows: object, cols: object) -> Matrix:
    """A matrix symbol of the spec language (rows, cols: dimension symbols, ``dim`` names or positive ints)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise SymattnError(f"a matrix name must be a Python identifier, got {name!r}")
    size = [_dimension(s, what) for s, what in ((rows, "rows"), (cols, "cols"))]
    return Matrix(MatrixSymbol(name, *size))


def ones(rows: object, cols: object) -> Matrix:
    """𝟏, the rows × cols matrix of ones (𝟏ₙ b broadcasts a 1 × d bias b along n rows)."""
    return Matrix(OneMatrix(_dimension(rows, "rows"), _dimension(cols, "cols")))


def identity(size: object) -> Matrix:
    """I, the size × size identity."""
    return Matrix(Identity(_dimension(size, "size")))


def scalar(name: str) -> sp.Symbol:
    """A trainable scalar (a real SymPy Symbol: what ``Spec.inputs`` takes as one)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise SymattnError(f"a scalar name must be a Python identifier, got {name!r}")
    return sp.Symbol(name, real=True)


def lifted(function: Callable) -> Callable:
    """A node constructor that takes Matrix arguments and then returns a Matrix (SymPy in, SymPy out)."""

    @functools.wraps(function)
    def wrapper(*args: object, **kwargs: object) -> object:
        wrapped = any(isinstance(a, Matrix) for a in args)
        result = function(*(plain(a) for a in args), **kwargs)
        return Matrix(result) if wrapped and isinstance(result, MatrixExpr) else result

    return wrapper


def _dimension(size: object, what: str) -> Basic:
    from symattn.lang.dims import dim

    if isinstance(size, str):
        return dim(size)
    if isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 1:
        return sp.Integer(int(size))
    if isinstance(size, sp.Expr) and size.is_positive is not False and size.free_symbols:
        return size
    raise SymattnError(f"{what} must be a dimension symbol, a dim() name or a positive integer, got {size!r}")


def _scalar(value: object, op: str) -> Basic:
    value = plain(value)
    if isinstance(value, Basic):
        if isinstance(value, MatrixExpr):
            raise SymattnError(f"'{op}' by a matrix: a scalar was expected, got {value}")
        return value
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, complex)):
        return expression(value, f"the scalar of '{op}'")
    raise SymattnError(f"'{op}' with {type(value).__name__} {value!r}: a matrix or a scalar was expected")


def _matrix(value: object, op: str) -> MatrixExpr:
    value = plain(value)
    if isinstance(value, MatrixExpr):
        return value
    raise SymattnError(f"'{op}' with {type(value).__name__} {value!r}: a matrix of the same shape was expected")


def _multiply(left: object, right: object, op: str) -> Matrix:
    left, right = plain(left), plain(right)
    matrices = [x for x in (left, right) if isinstance(x, MatrixExpr)]
    if len(matrices) == 2:
        if not same_dim(left.shape[1], right.shape[0]):
            raise ShapeMismatchError("matrix product", left.shape, right.shape)
        return Matrix(product(left, right))
    if op == "@":
        raise SymattnError("'@' multiplies two matrices; scale by a scalar with '*'")
    c = _scalar(right if matrices[0] is left else left, op)
    return Matrix(product(c, matrices[0]))


def _sum(a: MatrixExpr, b: MatrixExpr) -> MatrixExpr:
    if not (same_dim(a.shape[0], b.shape[0]) and same_dim(a.shape[1], b.shape[1])):
        raise ShapeMismatchError("matrix sum", a.shape, b.shape)
    return total(a, b)
