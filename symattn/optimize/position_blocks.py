"""A block of rows of a matrix of positions or of dropout's mask: what a loop over blocks of query rows (the
memory-efficient variant, ``codegen.schedule.rowblocks``) computes of an ``Entries`` node, from the block's own
positions, and of a ``DropoutMask``, drawn from the call's seed and the block's first row; never whole. And the
part of a table's cotangent (``Scatter``) a block adds: scatter(W) = Σ_blocks scatter_block(W_b)."""

from __future__ import annotations

import zlib

import sympy as sp
from sympy import Basic, Expr, MatrixExpr
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul

from symattn.errors import SymattnError
from symattn.lang.piecewise import DropoutMask
from symattn.lang.positions import Entries, J, Scatter

HEAD = sp.Symbol("h", integer=True, nonnegative=True)  # the head of a per-head formula (``entries(…, heads=H)``)
SEED = "drop_seed"  # the generated code's name of a call's seed, which its blocks of dropout's mask are drawn from


class EntriesBlock(MatrixExpr):
    """The block of [f(i, j)] a loop over blocks of query rows reads: the rows of the loop's block (``rows``, its
    size symbol), the keys of its key range; args (source, rows, heads): source an Entries (heads 0), or the
    rows × H·cols Entries that ``entries(…, heads=H)`` splits into heads (heads H, the block per head). Code
    generation makes it (``schedule.rowblocks``) and the printers compute it from positions, never whole."""

    def __new__(cls, source: Entries, rows: Expr, heads: Expr = sp.S.Zero) -> EntriesBlock:
        return Basic.__new__(cls, source, sp.sympify(rows), sp.sympify(heads))

    @property
    def source(self) -> Entries:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[2]

    @property
    def shape(self) -> tuple:
        cols = self.source.cols / self.heads if self.heads else self.source.cols
        return (self.args[1], cols)

    @property
    def formula(self) -> Expr:
        """f(i, j), or with heads f(i, j, h) of ``I``, ``J``, ``HEAD``: the per-head formula, j a key of its head
        (the laid-out column j' = h·cols + j read back: ⌊j'/cols⌋ = h)."""
        return per_head(self.source.formula, self.shape[1]) if self.heads else self.source.formula


def per_head(laid_out: Basic, width: Expr) -> Basic:
    """A formula of the laid-out column j' = h·width + j (head ⌊j'/width⌋) as one of the head h and its key j."""
    per_head = laid_out.xreplace({sp.floor(J / width): HEAD})
    return per_head.xreplace({J: J + width * HEAD})  # (j + w·h − w·h: SymPy's sums cancel it)


class ScatterBlock(MatrixExpr):
    """The part of a table's cotangent scatter(W) (``Scatter``) that a loop's block of query rows adds:
    [Σ_{(i, j) in the block: (r, c)(i, j) = (k, l)} (W_b)ᵢⱼ]ₖₗ over the block's rows and the keys of its key range,
    so that scatter(W) = Σ_blocks scatter_block(W_b). args (W_b, rows, cols, index, heads) as Scatter's; with heads
    H, W_b is the block per head of split_heads(W, H) and the index (r, c) a formula of ``I``, ``J`` and ``HEAD``
    (the laid-out column read back, as ``EntriesBlock.formula``); its one operand is W_b. The printers sum it from
    the block's positions (the runtime's block_scatter)."""

    operand_count = 1  # ``lang.graph.children``: a walk descends into W_b only

    def __new__(cls, weights: MatrixExpr, whole: Scatter, heads: Expr = sp.S.Zero) -> ScatterBlock:
        index = whole.args[3]
        if heads:
            width = whole.weights.shape[1] / heads
            index = sp.Lambda(index.variables, sp.Tuple(*(per_head(x, width) for x in index.expr)))
        return Basic.__new__(cls, weights, *whole.shape, index, sp.sympify(heads))

    @property
    def weights(self) -> MatrixExpr:
        return self.args[0]

    @property
    def heads(self) -> Expr:
        return self.args[4]

    @property
    def shape(self) -> tuple:
        return self.args[1], self.args[2]

    @property
    def index(self) -> tuple[Expr, Expr]:
        """(r(i, j), c(i, j)), with heads of the head h too: the table entry position (i, j) reads."""
        return tuple(self.args[3].expr)


def split_heads_of(weights: MatrixExpr, heads: Expr) -> MatrixExpr | None:
    """split_heads(W, H) of W laid out per head (rows × H·cols), pushed through W's sums, entrywise products and
    scalar multiples: merge_heads(X, H) is X, a laid-out matrix of positions E is split_heads(E, H); None where W holds
    anything else."""
    from symattn.lang.ops import MergeHeads, SplitHeads

    if isinstance(weights, MergeHeads):
        return weights.arg if weights.heads == heads else None
    if isinstance(weights, Entries):
        return SplitHeads(weights, heads)
    if not isinstance(weights, (HadamardProduct, MatAdd, MatMul)):
        return None
    if isinstance(weights, MatMul) and sum(isinstance(a, MatrixExpr) for a in weights.args) != 1:
        return None
    parts = [split_heads_of(a, heads) if isinstance(a, MatrixExpr) else a for a in weights.args]
    return None if any(p is None for p in parts) else Basic.__new__(type(weights), *parts)


class DropoutBlock(MatrixExpr):
    """The block of rows of Z_p(A) (``DropoutMask``) a loop over blocks of query rows reads, A already its block
    (args: A_b, p, stream): drawn over every key of the block's rows from the call's seed, the stream and the
    block's first row alone (the runtime's ``dropout_block``), so a backward that recomputes the block draws the
    forward's numbers again, never an n × m mask. stream tells a spec's masks apart: the CRC-32 of the mask's
    text (the same node, the same stream, the same draws)."""

    def __new__(cls, mask: DropoutMask) -> DropoutBlock:
        stream = zlib.crc32(sp.srepr(mask).encode())
        return Basic.__new__(cls, mask.arg, mask.args[1], sp.Integer(stream))

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return self.arg.shape


def in_blocks(expr: Basic, rows: Expr) -> Basic:
    """expr with each matrix of positions in it (an Entries, or the split_heads of one) as its block of rows (an
    EntriesBlock of rows rows), each dropout mask as a DropoutBlock, and each table's cotangent (a Scatter, its
    weights' row-local values already their blocks; weights laid out per head, merge_heads(X) ⊙ …, split into heads)
    as a ScatterBlock: what a loop over blocks of query rows computes of them."""
    from symattn.lang.ops import MergeHeads, SplitHeads

    found: dict[Basic, Basic] = {}
    for node in sp.preorder_traversal(expr):
        if isinstance(node, Scatter):  # (W's matrices of positions, ∂f/∂b, as their blocks too; per head, W's split)
            heads = next((x.heads for x in sp.preorder_traversal(node.weights) if isinstance(x, MergeHeads)), None)
            split = node.weights if heads is None else split_heads_of(node.weights, heads)
            if split is None:
                why = f"its weights {node.weights} are no entrywise map of per-head values"
                raise SymattnError(f"a table's cotangent cannot be summed per head over blocks of rows: {why}")
            found[node] = ScatterBlock(in_blocks(split, rows), node, heads or sp.S.Zero)
        elif isinstance(node, SplitHeads) and isinstance(node.arg, Entries):
            found[node] = EntriesBlock(node.arg, rows, node.heads)
        elif isinstance(node, Entries):
            found.setdefault(node, EntriesBlock(node, rows))
        elif isinstance(node, DropoutMask):
            found[node] = DropoutBlock(node)
    return expr.xreplace(found) if found else expr  # (top down: a split_heads before the Entries in it)
