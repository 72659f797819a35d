"""What every node of symattn's language shares: the argument check, and the entrywise base class."""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixExpr

from symattn.errors import NotAMatrixError
from symattn.lang.safe import expression


def require_matrix(arg: Basic, what: str) -> None:
    """Refuse a scalar where a node takes a matrix expression."""
    if not isinstance(arg, MatrixExpr):
        raise NotAMatrixError(f"{what} takes a matrix expression, got {type(arg).__name__} {arg}")


class Elementwise(MatrixExpr):
    """f(A) applied entry by entry; subclasses name f."""

    function: str = ""
    scalar = staticmethod(sp.Function("f"))

    def __new__(cls, arg: MatrixExpr) -> Elementwise:
        arg = expression(arg)
        require_matrix(arg, cls.function)
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return self.arg.shape

    def _entry(self, i, j, **kwargs):
        return self.scalar(self.arg._entry(i, j, **kwargs))
