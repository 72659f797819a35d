"""A schedule is consistent where it is made: its products' inner dimensions agree, and a statement writes in place
only into an array that has the value's batch axes exactly.

- ``consistency.check_products``: a product whose factors' inner dimensions differ (rebuilt without SymPy's
  validation) is symattn's error naming the assignment, raised by ``schedule_spec``, never a module that fails
  at run time with ``matmul: … mismatch in its core dimension``.
- ``Sections.fits``: a dying array is a value's buffer only when it is batched if and only if the value is.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import sympy as sp

import symattn as sa
from symattn.codegen.emit.sections import Sections
from symattn.codegen.schedule import build
from symattn.codegen.schedule.consistency import check_products, mismatched_product
from symattn.codegen.schedule.dag import Assignment
from symattn.errors import SymattnError
from symattn.lang.algebra import product
from symattn.specs import dim

n, d, m = dim("n"), dim("d"), dim("m")
X, W = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W_Q", d, m)


def test_a_consistent_product_passes_and_an_inconsistent_one_is_found():
    # X W (n × d)(d × m); X Wᵀ would be (n × d)(m × d): inner dimensions d and m
    assert mismatched_product(X * W + sp.OneMatrix(n, 1) * sp.OneMatrix(1, m)) is None
    wrong = product(X, W.T, canonical=False)  # as a pass rebuilding products without validation could make it
    assert mismatched_product(sa.tanh(wrong)) == (wrong, X, W.T)
    with pytest.raises(SymattnError, match=r"backward assignment dX = .*multiplies X \(n × d\) by W_Q.T \(m × d\)"):
        check_products([Assignment(sp.MatrixSymbol("dX", n, m), wrong)], "backward")


def test_schedule_spec_refuses_an_inconsistent_schedule(monkeypatch):
    """A pass that makes an inconsistent product (here: the aliases' pass, patched) gives SymattnError from
    schedule_spec naming the assignment, not a schedule that prints as a failing module."""
    spec = sa.Spec("consistent", "", (X, W), sa.tanh(X * W))
    real = build.inline_aliases

    def broken(values, outputs):
        values = real(values, outputs)
        first = values[0]
        return [Assignment(first.target, product(X, W.T, canonical=False), first.reduce_batch), *values[1:]]

    build.schedule_spec(spec)  # consistent as made
    monkeypatch.setattr(build, "inline_aliases", broken)
    with pytest.raises(SymattnError, match="inconsistent schedule: the backward assignment"):
        build.schedule_spec(spec)


@pytest.mark.parametrize(
    ("reads", "expected"),
    [
        ({"W_Q", "t"}, {"t"}),  # an unbatched value: only the unbatched dying array (u has the batch axes)
        ({"X", "u"}, {"u"}),  # a batched value: only the batched one (t has no batch axes to hold it)
    ],
)
def test_a_buffer_is_batched_if_and_only_if_the_value_is(reads, expected):
    printer = SimpleNamespace(inplace=True)
    sections = Sections(sched=None, printer=printer, mask=None, batched={"X", "u"}, protected=set())
    symbols = [sp.MatrixSymbol(name, n, n) for name in sorted(reads)]
    a = Assignment(sp.MatrixSymbol("Y", n, n), sp.MatAdd(*symbols))
    assert sections.fits(a, frozenset({"t", "u"})) == expected
    assert Sections(None, SimpleNamespace(inplace=False), None, {"X"}, set()).fits(a, frozenset({"t"})) == frozenset()
