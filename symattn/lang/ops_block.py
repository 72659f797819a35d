"""The Transformer block's nodes: row-wise LayerNorm and its reciprocal standard deviation, and ``gelu``.

Like the structural nodes of ``symattn.lang.ops`` (which re-exports these), each node defines its
shape and explicit entries, nothing else. GELU and its derivatives are records in ``functions``.
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, Expr, MatrixExpr

from symattn.errors import SymattnError
from symattn.lang.functions import Elementwise, Gelu, GeluTanh
from symattn.lang.lazy import lifted
from symattn.lang.naming.safe import expression
from symattn.lang.node_base import require_matrix, shape_of


class _RowStatistic(MatrixExpr):
    """A row-wise statistic of A with the variance offset eps (a positive scalar)."""

    def __new__(cls, arg: MatrixExpr, eps) -> _RowStatistic:
        arg, eps = expression(arg), expression(eps)
        require_matrix(arg, cls.__name__)
        if isinstance(eps, MatrixExpr) or eps.is_positive is False:
            raise SymattnError(f"{cls.__name__} takes a positive scalar eps, got {eps}")
        return Basic.__new__(cls, arg, eps)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def eps(self) -> Expr:
        return self.args[1]

    def _row_moments(self, i, **kwargs):
        cols = self.arg.shape[1]
        k = sp.Dummy("k", integer=True)
        mean = sp.Sum(self.arg._entry(i, k, **kwargs), (k, 0, cols - 1)) / cols
        var = sp.Sum((self.arg._entry(i, k, **kwargs) - mean) ** 2, (k, 0, cols - 1)) / cols
        return mean, var


class LayerNorm(_RowStatistic):
    """LN(A)_ij = (A_ij − μ_i) / √(σ²_i + ε): each row standardised (μ_i its mean, σ²_i its biased
    variance, as torch.nn.LayerNorm); the learned γ, β are applied outside the node."""

    @property
    def shape(self) -> tuple:
        return shape_of(self.arg)

    def _entry(self, i, j, **kwargs):
        mean, var = self._row_moments(i, **kwargs)
        return (self.arg._entry(i, j, **kwargs) - mean) / sp.sqrt(var + self.eps)


class RowInvStd(_RowStatistic):
    """rstd(A)_i = 1 / √(σ²_i + ε): the n × 1 column of reciprocal row standard deviations.

    Appears in LayerNorm's backward pass (and is differentiated again for second order).
    """

    @property
    def shape(self) -> tuple:
        return (shape_of(self.arg)[0], sp.Integer(1))

    def _entry(self, i, j, **kwargs):
        _, var = self._row_moments(i, **kwargs)
        return 1 / sp.sqrt(var + self.eps)


@lifted
def gelu(a: MatrixExpr, approximate: str = "none") -> Elementwise:
    """Entrywise GELU: exact (erf) for approximate="none", the tanh form for approximate="tanh" (as torch)."""
    if approximate == "none":
        return Gelu(a)
    if approximate == "tanh":
        return GeluTanh(a)
    raise SymattnError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")


@lifted
def layer_norm(a: MatrixExpr, eps) -> LayerNorm:
    """Each row of a standardised: (a − row mean) / √(row variance + eps)."""
    return LayerNorm(a, eps)
