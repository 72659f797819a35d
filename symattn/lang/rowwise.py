"""Row-wise functions: each row of A mapped on its own (softmax, log-softmax), one record each.

A row-wise node is a record like an entrywise one (``FunctionRecord``: name, printing, per-backend
calls, cost, letter, reason) plus its row structure: explicit entries, the VJP (the argument's
cotangent from the node's) and the JVP (the node's differential from the argument's). Its calls
have a masked form (``masked_calls``) for rows that may hold −inf (an additive mask): a row whose
entries are all −inf is a row of zero probabilities, not NaN.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy as sp
from sympy import Basic, MatrixExpr, OneMatrix

from symattn.errors import UnsupportedNodeError
from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.functions import EXACT, HADAMARD_MOVE, JAX, NUMPY, TORCH, Exp, FunctionRecord
from symattn.lang.naming.safe import expression
from symattn.lang.node_base import require_matrix, shape_of


class RowSum(MatrixExpr):
    """rowsum(A) = A 𝟏: the n × 1 column of row sums of an n × m matrix."""

    def __new__(cls, arg: MatrixExpr) -> RowSum:
        arg = expression(arg)
        require_matrix(arg, "rowsum")
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return (shape_of(self.arg)[0], sp.Integer(1))

    def _entry(self, i, j, **kwargs):
        k = sp.Dummy("k", integer=True)
        return sp.Sum(self.arg._entry(i, k), (k, 0, self.arg.shape[1] - 1))


class RowWise(FunctionRecord):
    """f applied to each row of A; each subclass is the record of one f."""

    masked_calls: Mapping[str, str] = {}  # per backend, the call for rows that may hold −inf
    arg_letter = "A"  # the name of its saved argument

    def masked_call(self, backend: str) -> str:
        """The masked form's call in the backend; UnsupportedNodeError naming both if it has none."""
        if backend not in self.masked_calls:
            raise UnsupportedNodeError(self, f"masks in the {backend} backend", list(self.masked_calls))
        return self.masked_calls[backend]

    def _exp_total(self, i) -> Basic:
        """Σ_k exp(A_ik), the normaliser of row i (explicit entries)."""
        k = sp.Dummy("k", integer=True)
        return sp.Sum(sp.exp(self.arg._entry(i, k)), (k, 0, self.arg.shape[1] - 1))


def _row_ones(node: MatrixExpr) -> OneMatrix:
    return OneMatrix(1, node.shape[1])


class RowSoftmax(RowWise):
    """softmax(A)_ij = exp(A_ij) / Σ_k exp(A_ik): each row normalised on its own."""

    function = "softmax"
    latex, text = r"\operatorname{softmax}", "softmax"
    calls = {NUMPY: "row_softmax", TORCH: "row_softmax", JAX: "row_softmax", EXACT: "row_softmax"}
    masked_calls = {NUMPY: "masked_row_softmax", TORCH: "masked_row_softmax", JAX: "masked_row_softmax"}
    inplace = True  # the helpers take out= (NumPy, torch)
    flops = 5  # row max, subtract, exp, row sum, divide
    letter = "P"
    reason = ("softmax differential", HADAMARD_MOVE + ", cyclic property")

    def _entry(self, i, j, **kwargs):
        return sp.exp(self.arg._entry(i, j, **kwargs)) / self._exp_total(i)

    def vjp(self, g: MatrixExpr) -> MatrixExpr:
        """dP = P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ), so tr(Gᵀ dP) = tr((P ⊙ (G − rowsum(G ⊙ P) 𝟏ᵀ))ᵀ dA)."""
        return hadamard_product(self, total(g, product(-1, RowSum(hadamard_product(g, self)), _row_ones(self))))

    def jvp(self, da: MatrixExpr) -> MatrixExpr:
        """P = softmax(A): dP = P ⊙ (dA − (P ⊙ dA) 𝟏𝟏ᵀ)."""
        cols = self.shape[1]
        return hadamard_product(self, total(da, sp.MatMul(-1, hadamard_product(self, da), OneMatrix(cols, cols))))


class LogSoftmax(RowWise):
    """log_softmax(A)_ij = A_ij − log Σ_k exp(A_ik): the log of softmax, without its overflow or log 0.

    With L = log_softmax(A), exp(L) = softmax(A) = P; cross-entropy heads and log-space attention read L.
    """

    function = "log_softmax"
    latex, text = r"\operatorname{log\,softmax}", "log_softmax"
    calls = {
        NUMPY: "log_softmax",
        TORCH: "torch.log_softmax({}, dim=-1)",
        JAX: "jax.nn.log_softmax",
        EXACT: "log_softmax",
    }
    masked_calls = {NUMPY: "masked_log_softmax", TORCH: "masked_log_softmax", JAX: "masked_log_softmax"}
    flops = 5  # row max, subtract, exp, row sum, log and subtract
    letter = "L"
    reason = ("log-softmax differential", HADAMARD_MOVE + ", cyclic property")

    def _entry(self, i, j, **kwargs):
        return self.arg._entry(i, j, **kwargs) - sp.log(self._exp_total(i))

    def vjp(self, g: MatrixExpr) -> MatrixExpr:
        """dL = dA − (exp(L) ⊙ dA) 𝟏𝟏ᵀ, so tr(Gᵀ dL) = tr((G − exp(L) ⊙ rowsum(G) 𝟏ᵀ)ᵀ dA)."""
        return total(g, product(-1, hadamard_product(Exp(self), product(RowSum(g), _row_ones(self)))))

    def jvp(self, da: MatrixExpr) -> MatrixExpr:
        """L = log_softmax(A): dL = dA − (exp(L) ⊙ dA) 𝟏𝟏ᵀ."""
        cols = self.shape[1]
        return total(da, sp.MatMul(-1, hadamard_product(Exp(self), da), OneMatrix(cols, cols)))
