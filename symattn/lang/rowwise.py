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

from symattn.errors import SymattnError, UnsupportedNodeError
from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.functions import EXACT, HADAMARD_MOVE, JAX, NUMPY, TORCH, Exp, FunctionRecord, Step
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


class KthLargest(FunctionRecord):
    """kth_k(A): the k-th largest entry of each row of A (k = 1: the row max), an n × 1 column: torch's
    topk(k).values[..., k-1:k] (a top-k threshold). Its differential is the selected entry's,
    d kth_k(A) = rowsum(E ⊙ dA), E = [A = kth_k(A) 𝟏ᵀ] the indicator of the entries equal to it: one entry per row
    (autograd's one-hot of the selected index) where the row has no ties at its k-th largest value, all the tied
    entries where it has. The k-th smallest is −kth_k(−A)."""

    function = "kth_largest"
    exported = False
    latex, text = r"\operatorname{kth}", "kth"
    parameters = ("k",)
    calls = {
        NUMPY: "np.partition({0}, -{k}, axis=-1)[..., -{k}, None]",  # the k-th largest at its sorted place
        TORCH: "torch.topk({0}, {k}, dim=-1).values[..., -1:]",
        JAX: "jax.lax.top_k({0}, {k})[0][..., -1:]",
        EXACT: "kth_largest({0}, {k})",
    }
    flops = 2
    letter = "O"
    reason = ("the selected entry's differential", HADAMARD_MOVE)

    def __new__(cls, arg: MatrixExpr, k: object) -> KthLargest:
        arg = expression(arg)
        require_matrix(arg, cls.function)
        if isinstance(k, bool) or not isinstance(k, (int, sp.Integer)) or int(k) < 1:
            raise SymattnError(f"the k-th largest entry needs a whole k ≥ 1, got {k!r}")
        return Basic.__new__(cls, arg, sp.Integer(k))

    @classmethod
    def example(cls, a: MatrixExpr) -> KthLargest:
        return cls(a, 1)

    @property
    def k(self) -> int:
        return int(self.args[1])

    @property
    def shape(self) -> tuple:
        return (shape_of(self.arg)[0], sp.Integer(1))

    def least_sizes(self) -> dict[Basic, int]:
        """Rows of at least k entries (verification's random sizes, ``numeric.verify.random_dims``)."""
        return {self.arg.shape[1]: self.k}

    def call(self, backend: str) -> str:
        """The record's template with k filled in ({0} stays the operand)."""
        return super().call(backend).format("{0}", k=self.k)

    def notation(self, latex: bool) -> str:
        return f"{self.latex}_{{{self.k}}}" if latex else f"{self.text}_{self.k}"

    def selected(self) -> MatrixExpr:
        """E = [A = kth_k(A) 𝟏ᵀ] = (𝟏𝟏ᵀ − step(A − kth 𝟏ᵀ)) ⊙ (𝟏𝟏ᵀ − step(kth 𝟏ᵀ − A)): 1 at the selected entry."""
        ones = OneMatrix(*self.arg.shape)
        spread = product(self, _row_ones(self.arg))
        above, below = total(self.arg, product(-1, spread)), total(spread, product(-1, self.arg))
        return hadamard_product(total(ones, product(-1, Step(above))), total(ones, product(-1, Step(below))))

    def vjp(self, g: MatrixExpr) -> MatrixExpr:
        """d kth = rowsum(E ⊙ dA), so tr(Gᵀ d kth) = tr((E ⊙ G 𝟏ᵀ)ᵀ dA)."""
        return hadamard_product(self.selected(), product(g, _row_ones(self.arg)))

    def jvp(self, da: MatrixExpr) -> MatrixExpr:
        """d kth_k(A) = rowsum(E ⊙ dA)."""
        return RowSum(hadamard_product(self.selected(), da))
