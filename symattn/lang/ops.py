"""The nodes symattn adds to SymPy's matrix expressions, and their constructors.

The structural nodes define their shape and explicit entries (``_entry``), nothing else: how
they are differentiated, printed or evaluated lives in the modules of those operations
(``vjp``, ``latex``, ``printers``). The function nodes (entrywise and row-wise) are records
that state all of that themselves (``symattn.lang.functions``, ``symattn.lang.rowwise``); their
constructors (``exp``, ``softmax``, …) are made here from the records.
"""

from __future__ import annotations

import functools

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.matrices.expressions import HadamardProduct

from symattn.errors import ShapeMismatchError
from symattn.lang.functions import (  # noqa: F401  (every node importable from here)
    FUNCTIONS,
    GELU_TANH_C,
    GELU_TANH_K,
    Elementwise,
    Exp,
    Gelu,
    GeluGrad,
    GeluTanh,
    GeluTanhGrad,
    Log,
    Relu,
    Sigmoid,
    Silu,
    Softplus,
    Step,
    StopGradient,
    Tanh,
)
from symattn.lang.lazy import lifted
from symattn.lang.naming.safe import expression
from symattn.lang.node_base import require_matrix, shape_of
from symattn.lang.ops_block import LayerNorm, RowInvStd, gelu, layer_norm  # noqa: F401
from symattn.lang.piecewise import (  # noqa: F401
    Clamp,
    ClampGrad,
    DropoutMask,
    Hardtanh,
    HardtanhGrad,
    LeakyRelu,
    LeakyStep,
)
from symattn.lang.rowwise import LogSoftmax, RowSoftmax, RowSum, RowWise  # noqa: F401


class SumEntries(Expr):
    """sum(A) = 𝟏ᵀ A 𝟏: the scalar sum of all entries of A; sum(0) = 0 (X − X folded by SymPy: the value it
    scales is zero, and a spec whose output that makes zero depends on no input)."""

    is_commutative = True

    def __new__(cls, arg: MatrixExpr) -> SumEntries | sp.Integer:
        arg = expression(arg)
        require_matrix(arg, "sum")
        if arg.is_ZeroMatrix:
            return sp.Integer(0)
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
        require_matrix(arg, "split_heads")
        return Basic.__new__(cls, arg, heads)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[1]

    @property
    def shape(self) -> tuple:
        return (shape_of(self.arg)[0], _block_width(shape_of(self.arg)[1], self.heads))


class MergeHeads(MatrixExpr):
    """Concat(head_1, …, head_H): H stacked n × k matrices side by side, n × (H·k)."""

    def __new__(cls, arg: MatrixExpr, heads) -> MergeHeads:
        arg, heads = expression(arg), expression(heads)
        require_matrix(arg, "merge_heads")
        return Basic.__new__(cls, arg, heads)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[1]

    @property
    def shape(self) -> tuple:
        return (shape_of(self.arg)[0], shape_of(self.arg)[1] * self.heads)


@functools.cache
def _block_width(cols: Expr, heads: Expr) -> Expr:
    """cols / heads, simplified once per pair (shape is asked for very often)."""
    return sp.simplify(cols / heads)


# Public constructors (the names a spec is written with).


def _constructor(record: type) -> object:
    """The public constructor of a function's record (sa.exp, sa.softmax, …): f(a) → record(a); a record with
    parameters takes them after a (sa.clamp(a, lo, hi), sa.leaky_relu(a, negative_slope))."""

    def construct(a: MatrixExpr, *parameters: object, **named: object) -> MatrixExpr:
        return record(a, *parameters, **named)

    construct.__name__ = construct.__qualname__ = record.function
    construct.__doc__ = record.__doc__
    return lifted(construct)


# every exported function of the records (symattn.lang.functions, symattn.lang.rowwise) by its name
CONSTRUCTORS = {name: _constructor(record) for name, record in FUNCTIONS.items() if record.exported}
globals().update(CONSTRUCTORS)


@lifted
def rowsum(a: MatrixExpr) -> RowSum:
    """Row sums as an n × 1 column."""
    return RowSum(a)


@lifted
def sum(a: MatrixExpr) -> SumEntries:
    """Scalar sum of all entries."""
    return SumEntries(a)


@lifted
def hadamard(*factors: MatrixExpr) -> MatrixExpr:
    """Entrywise product A ⊙ B ⊙ …; the factors must share one shape."""
    factors = tuple(expression(f) for f in factors)
    for f in factors:
        require_matrix(f, "hadamard")
    for f in factors[1:]:
        if not _same_shape(factors[0].shape, f.shape):
            raise ShapeMismatchError("hadamard product", factors[0].shape, f.shape)
    return HadamardProduct(*factors) if len(factors) > 1 else factors[0]


@lifted
def dropout(a: MatrixExpr, p: object) -> MatrixExpr:
    """dropout(A, p) = A ⊙ Z_p(A), Z_p a Bernoulli(1 − p) / (1 − p) mask drawn once per call (``DropoutMask``):
    Ā = G ⊙ Z_p, dY = dA ⊙ Z_p, the same draws; p = 0 is A itself. Two dropouts of the same A with the same p in
    one spec are one node, so one mask."""
    mask = DropoutMask(a, p)
    return mask.arg if mask.args[1] == 0 else hadamard(mask.arg, mask)


@lifted
def split_heads(a: MatrixExpr, heads) -> SplitHeads:
    """The per-head column blocks of a (heads as a batch)."""
    return SplitHeads(a, heads)


@lifted
def merge_heads(a: MatrixExpr, heads) -> MergeHeads:
    """Concatenate per-head blocks side by side."""
    return MergeHeads(a, heads)


def _same_shape(a: tuple, b: tuple) -> bool:
    from symattn.lang.dims import same_dim

    return all(same_dim(x, y) for x, y in zip(a, b))


# Grouped-query heads: H_kv key/value heads shared by H query heads.


class _HeadGroups(MatrixExpr):
    """Per-head blocks regrouped between H query heads and H_kv kv heads (H_kv divides H)."""

    def __new__(cls, arg: MatrixExpr, kv_heads, heads):
        arg, kv_heads, heads = expression(arg), expression(kv_heads), expression(heads)
        require_matrix(arg, cls.__name__)
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
        return shape_of(self.arg)


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


@lifted
def repeat_heads(a: MatrixExpr, kv_heads, heads) -> RepeatHeads:
    """kv_heads blocks repeated to serve heads query heads (grouped-query attention)."""
    return RepeatHeads(a, kv_heads, heads)


@lifted
def sum_groups(a: MatrixExpr, heads, kv_heads) -> SumGroups:
    """heads blocks summed over groups of consecutive heads into kv_heads blocks."""
    return SumGroups(a, kv_heads, heads)
