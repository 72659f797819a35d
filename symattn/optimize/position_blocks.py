"""A block of rows of a matrix of positions or of dropout's mask: what a loop over blocks of query rows (the
memory-efficient variant, ``codegen.schedule.rowblocks``) computes of an ``Entries`` node, from the block's own
positions, and of a ``DropoutMask``, drawn from the call's seed and the block's first row; never whole."""

from __future__ import annotations

import zlib

import sympy as sp
from sympy import Basic, Expr, MatrixExpr

from symattn.lang.piecewise import DropoutMask
from symattn.lang.positions import Entries, J

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
        if not self.heads:
            return self.source.formula
        width = self.shape[1]
        laid_out = self.source.formula.xreplace({sp.floor(J / width): HEAD})
        return laid_out.xreplace({J: J + width * HEAD})  # (j + w·h − w·h: SymPy's sums cancel it)


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
    EntriesBlock of rows rows), and each dropout mask as a DropoutBlock: what a loop over blocks of query rows
    computes of them."""
    from symattn.lang.ops import SplitHeads

    found: dict[Basic, Basic] = {}
    for node in sp.preorder_traversal(expr):
        if isinstance(node, SplitHeads) and isinstance(node.arg, Entries):
            found[node] = EntriesBlock(node.arg, rows, node.heads)
        elif isinstance(node, Entries):
            found.setdefault(node, EntriesBlock(node, rows))
        elif isinstance(node, DropoutMask):
            found[node] = DropoutBlock(node)
    return expr.xreplace(found) if found else expr  # (top down: a split_heads before the Entries in it)
