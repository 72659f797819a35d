"""The nodes symattn adds to SymPy's matrix expressions, and their constructors.

Each node defines its shape and explicit entries (``_entry``), nothing else: how a
node is differentiated, printed or evaluated lives in the modules of those
operations (``vjp``, ``latex``, ``printers``).
"""

from __future__ import annotations

import functools

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.matrices.expressions import HadamardProduct

from symattn.errors import NotAMatrixError, ShapeMismatchError, SymattnError
from symattn.lang.safe import expression


class Elementwise(MatrixExpr):
    """f(A) applied entry by entry; subclasses name f."""

    function: str = ""
    scalar = staticmethod(sp.Function("f"))

    def __new__(cls, arg: MatrixExpr) -> Elementwise:
        arg = expression(arg)
        _require_matrix(arg, cls.function)
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return self.arg.shape

    def _entry(self, i, j, **kwargs):
        return self.scalar(self.arg._entry(i, j, **kwargs))


class Exp(Elementwise):
    """exp(A), entrywise."""

    function = "exp"
    scalar = staticmethod(sp.exp)


class Log(Elementwise):
    """log(A), entrywise."""

    function = "log"
    scalar = staticmethod(sp.log)


class Tanh(Elementwise):
    """tanh(A), entrywise."""

    function = "tanh"
    scalar = staticmethod(sp.tanh)


class Sigmoid(Elementwise):
    """σ(A) = 1 / (1 + exp(−A)), entrywise."""

    function = "sigmoid"
    scalar = staticmethod(lambda x: 1 / (1 + sp.exp(-x)))


class RowSoftmax(MatrixExpr):
    """softmax(A)_ij = exp(A_ij) / Σ_k exp(A_ik): each row normalised on its own."""

    def __new__(cls, arg: MatrixExpr) -> RowSoftmax:
        arg = expression(arg)
        _require_matrix(arg, "softmax")
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return self.arg.shape

    def _entry(self, i, j, **kwargs):
        cols = self.arg.shape[1]
        k = sp.Dummy("k", integer=True)
        total = sp.Sum(sp.exp(self.arg._entry(i, k)), (k, 0, cols - 1))
        return sp.exp(self.arg._entry(i, j, **kwargs)) / total


class RowSum(MatrixExpr):
    """rowsum(A) = A 𝟏: the n × 1 column of row sums of an n × m matrix."""

    def __new__(cls, arg: MatrixExpr) -> RowSum:
        arg = expression(arg)
        _require_matrix(arg, "rowsum")
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return (self.arg.shape[0], sp.Integer(1))

    def _entry(self, i, j, **kwargs):
        k = sp.Dummy("k", integer=True)
        return sp.Sum(self.arg._entry(i, k), (k, 0, self.arg.shape[1] - 1))


class SumEntries(Expr):
    """sum(A) = 𝟏ᵀ A 𝟏: the scalar sum of all entries of A."""

    is_commutative = True

    def __new__(cls, arg: MatrixExpr) -> SumEntries:
        arg = expression(arg)
        _require_matrix(arg, "sum")
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    def doit(self, **hints):
        arg = self.arg.doit(**hints) if hints.get("deep", True) else self.arg
        if isinstance(arg, sp.MatrixBase):
            return sum(arg)
        return SumEntries(arg)


class SplitHeads(MatrixExpr):
    """The H column blocks of an n × (H·k) matrix, stacked as H matrices n × k.

    Printed as the per-head block A_h; evaluated as a reshape to (…, H, n, k), so
    everything applied to it acts on every head at once.
    """

    def __new__(cls, arg: MatrixExpr, heads) -> SplitHeads:
        arg, heads = expression(arg), expression(heads)
        _require_matrix(arg, "split_heads")
        return Basic.__new__(cls, arg, heads)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[1]

    @property
    def shape(self) -> tuple:
        return (self.arg.shape[0], _block_width(self.arg.shape[1], self.heads))


class MergeHeads(MatrixExpr):
    """Concat(head_1, …, head_H): H stacked n × k matrices side by side, n × (H·k)."""

    def __new__(cls, arg: MatrixExpr, heads) -> MergeHeads:
        arg, heads = expression(arg), expression(heads)
        _require_matrix(arg, "merge_heads")
        return Basic.__new__(cls, arg, heads)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[1]

    @property
    def shape(self) -> tuple:
        return (self.arg.shape[0], self.arg.shape[1] * self.heads)


@functools.cache
def _block_width(cols: Expr, heads: Expr) -> Expr:
    """cols / heads, simplified once per pair (shape is asked for very often)."""
    return sp.simplify(cols / heads)


def _require_matrix(arg: Basic, what: str) -> None:
    if not isinstance(arg, MatrixExpr):
        raise NotAMatrixError(f"{what} takes a matrix expression, got {type(arg).__name__} {arg}")


# Public constructors (the names of CONTRACT.md).


def softmax(a: MatrixExpr) -> RowSoftmax:
    """Row-wise softmax."""
    return RowSoftmax(a)


def exp(a: MatrixExpr) -> Exp:
    """Entrywise exp."""
    return Exp(a)


def log(a: MatrixExpr) -> Log:
    """Entrywise natural logarithm."""
    return Log(a)


def tanh(a: MatrixExpr) -> Tanh:
    """Entrywise tanh."""
    return Tanh(a)


def sigmoid(a: MatrixExpr) -> Sigmoid:
    """Entrywise logistic sigmoid."""
    return Sigmoid(a)


def rowsum(a: MatrixExpr) -> RowSum:
    """Row sums as an n × 1 column."""
    return RowSum(a)


def sum(a: MatrixExpr) -> SumEntries:
    """Scalar sum of all entries."""
    return SumEntries(a)


def hadamard(*factors: MatrixExpr) -> MatrixExpr:
    """Entrywise product A ⊙ B ⊙ …; the factors must share one shape."""
    factors = tuple(expression(f) for f in factors)
    for f in factors:
        _require_matrix(f, "hadamard")
    for f in factors[1:]:
        if not _same_shape(factors[0].shape, f.shape):
            raise ShapeMismatchError("hadamard product", factors[0].shape, f.shape)
    return HadamardProduct(*factors) if len(factors) > 1 else factors[0]


def split_heads(a: MatrixExpr, heads) -> SplitHeads:
    """The per-head column blocks of a (heads as a batch)."""
    return SplitHeads(a, heads)


def merge_heads(a: MatrixExpr, heads) -> MergeHeads:
    """Concatenate per-head blocks side by side."""
    return MergeHeads(a, heads)


def _same_shape(a: tuple, b: tuple) -> bool:
    from symattn.lang.dims import same_dim

    return all(same_dim(x, y) for x, y in zip(a, b))


# Transformer-block nodes: GELU and row-wise LayerNorm (issue 6).

_INV_SQRT2 = 1 / sp.sqrt(2)
GELU_TANH_K = sp.sqrt(2 / sp.pi)  # √(2/π) of the tanh approximation
GELU_TANH_C = sp.Float("0.044715")


class Gelu(Elementwise):
    """GELU(x) = x Φ(x) = x (1 + erf(x/√2)) / 2, entrywise (the exact, erf form)."""

    function = "gelu"
    scalar = staticmethod(lambda x: x * (1 + sp.erf(x * _INV_SQRT2)) / 2)


class GeluTanh(Elementwise):
    """GELU's tanh approximation: x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""

    function = "gelu_tanh"
    scalar = staticmethod(lambda x: x * (1 + sp.tanh(GELU_TANH_K * (x + GELU_TANH_C * x**3))) / 2)


class GeluGrad(Elementwise):
    """GELU′(x) = Φ(x) + x φ(x) = (1 + erf(x/√2)) / 2 + x exp(−x²/2) / √(2π), entrywise.

    Appears in backward passes only; it is not differentiated itself.
    """

    function = "gelu_grad"
    scalar = staticmethod(lambda x: (1 + sp.erf(x * _INV_SQRT2)) / 2 + x * sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi))


def _gelu_tanh_grad(x):
    t = sp.tanh(GELU_TANH_K * (x + GELU_TANH_C * x**3))
    return (1 + t) / 2 + x * (1 - t**2) * GELU_TANH_K * (1 + 3 * GELU_TANH_C * x**2) / 2


class GeluTanhGrad(Elementwise):
    """The derivative of GELU's tanh approximation, entrywise: with t = tanh(k (x + c x³)), k = √(2/π),
    c = 0.044715: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2. Backward passes only."""

    function = "gelu_tanh_grad"
    scalar = staticmethod(_gelu_tanh_grad)


class _RowStatistic(MatrixExpr):
    """A row-wise statistic of A with the variance offset eps (a positive scalar)."""

    def __new__(cls, arg: MatrixExpr, eps) -> _RowStatistic:
        arg, eps = expression(arg), expression(eps)
        _require_matrix(arg, cls.__name__)
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
        return self.arg.shape

    def _entry(self, i, j, **kwargs):
        mean, var = self._row_moments(i, **kwargs)
        return (self.arg._entry(i, j, **kwargs) - mean) / sp.sqrt(var + self.eps)


class RowInvStd(_RowStatistic):
    """rstd(A)_i = 1 / √(σ²_i + ε): the n × 1 column of reciprocal row standard deviations.

    Appears in LayerNorm's backward pass; it is not differentiated itself.
    """

    @property
    def shape(self) -> tuple:
        return (self.arg.shape[0], sp.Integer(1))

    def _entry(self, i, j, **kwargs):
        _, var = self._row_moments(i, **kwargs)
        return 1 / sp.sqrt(var + self.eps)


def gelu(a: MatrixExpr, approximate: str = "none") -> Elementwise:
    """Entrywise GELU: exact (erf) for approximate="none", the tanh form for approximate="tanh" (as torch)."""
    if approximate == "none":
        return Gelu(a)
    if approximate == "tanh":
        return GeluTanh(a)
    raise SymattnError(f"gelu approximate must be 'none' or 'tanh', got {approximate!r}")


def layer_norm(a: MatrixExpr, eps) -> LayerNorm:
    """Each row of a standardised: (a − row mean) / √(row variance + eps)."""
    return LayerNorm(a, eps)


# Grouped-query heads (appended by helper "masks").


class _HeadGroups(MatrixExpr):
    """Per-head blocks regrouped between H query heads and H_kv kv heads (H_kv divides H)."""

    def __new__(cls, arg: MatrixExpr, kv_heads, heads):
        arg, kv_heads, heads = expression(arg), expression(kv_heads), expression(heads)
        _require_matrix(arg, cls.__name__)
        return Basic.__new__(cls, arg, kv_heads, heads)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def kv_heads(self) -> Expr:
        return self.args[1]

    @property
    def heads(self) -> Expr:
        return self.args[2]

    @property
    def shape(self) -> tuple:
        return self.arg.shape


class RepeatHeads(_HeadGroups):
    """H_kv per-head blocks repeated to H: query head h reads kv block ⌊h / (H / H_kv)⌋.

    Each kv block serves H / H_kv consecutive query heads (torch's enable_gqa convention);
    evaluated as a repeat along the heads axis.
    """


class SumGroups(_HeadGroups):
    """H per-head blocks summed over groups of H / H_kv consecutive heads into H_kv blocks.

    The adjoint of RepeatHeads: Σ_h tr(G_hᵀ A_{⌊h/g⌋}) = Σ_j tr((Σ_{h in group j} G_h)ᵀ A_j).
    Arguments in RepeatHeads' order: SumGroups(A, H_kv, H).
    """


def repeat_heads(a: MatrixExpr, kv_heads, heads) -> RepeatHeads:
    """kv_heads blocks repeated to serve heads query heads (grouped-query attention)."""
    return RepeatHeads(a, kv_heads, heads)


def sum_groups(a: MatrixExpr, heads, kv_heads) -> SumGroups:
    """heads blocks summed over groups of consecutive heads into kv_heads blocks."""
    return SumGroups(a, kv_heads, heads)
