"""The library forms' pieces: a column block pushed down a projection to its weight's block, a slice of the last
axis found in an index, a constant reduced along an axis only where it does not vary (and checked again)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import sympy as sp  # noqa: E402
from sympy import MatrixSymbol, OneMatrix, Transpose  # noqa: E402

from symattn.errors import SymattnError  # noqa: E402
from symattn.lang.algebra import product, total  # noqa: E402
from symattn.trace.forms.blocks import columns  # noqa: E402
from symattn.trace.forms.heads import first_along  # noqa: E402
from symattn.trace.forms.rotary import _last_slice  # noqa: E402
from symattn.trace.tracer import Trace  # noqa: E402
from symattn.trace.values import Refused  # noqa: E402


def _trace_with(*inputs: tuple[str, tuple[int, int]]) -> tuple[Trace, list]:
    t = Trace()
    for name, shape in inputs:
        t.add_input(name, torch.zeros(shape))
    return t, [s for _, s in t.inputs]


def test_a_column_block_of_x_wt_plus_a_bias_is_x_times_a_row_block_of_w_plus_the_bias_block():
    t, (x, w, b) = _trace_with(("x", (5, 4)), ("w", (12, 4)), ("b", (1, 12)))
    t.dims.equate(x.shape[1], w.shape[1])
    x, w, b = (s for _, s in t.inputs)
    block = columns(t, total(product(x, Transpose(w)), product(OneMatrix(x.shape[0], 1), b)), (4, 8, 1, None))
    (wb, bb) = (blk.symbol for blk in t.blocks)
    assert (str(wb.name), str(bb.name)) == ("w_1", "b_1")
    assert block == total(product(x, Transpose(wb)), product(OneMatrix(x.shape[0], 1), bb))
    assert [(blk.axis, blk.start, blk.stop) for blk in t.blocks] == [(-2, 4, 8), (-1, 4, 8)]
    assert wb.shape[0] == bb.shape[1] and t.dims.size(wb.shape[0]) == 4  # one length for the piece's blocks


def test_a_block_of_a_row_wise_function_is_refused():
    from symattn.lang.ops import softmax

    t, (x,) = _trace_with(("x", (5, 4)))
    with pytest.raises(Refused, match="a block of RowSoftmax"):
        columns(t, softmax(x), (0, 2, 0, None))
    with pytest.raises(Refused, match="no input"):
        columns(t, MatrixSymbol("C", sp.Integer(5), sp.Integer(4)), (0, 2, 0, None))


@pytest.mark.parametrize(
    "index, found",
    [
        ((Ellipsis, slice(None, 2)), slice(None, 2)),
        ((slice(None), slice(None), slice(None), slice(1, None, 2)), slice(1, None, 2)),
        ((slice(None), slice(2)), None),  # three axes given of four: not the last axis
        (slice(2), None),  # the first axis
        ((Ellipsis, slice(None)), None),  # the whole last axis
        ((0, Ellipsis, slice(2)), None),
    ],
)
def test_a_slice_of_the_last_axis_is_found_in_an_index(index, found):
    assert _last_slice(index, 4) == found


def test_a_constant_is_reduced_along_an_axis_only_where_it_does_not_vary():
    table = torch.arange(6.0).view(1, 1, 2, 3).expand(3, 1, 2, 3)
    assert first_along(table, (0,)).shape == (1, 1, 2, 3)
    varying = table.clone()
    varying[2, 0, 0, 0] = 7.0
    with pytest.raises(SymattnError, match=r"now varies along axes \(0,\)"):
        first_along(varying, (0,))
