"""Every node of the language (a type with a VJP rule) has a print method in every printer.

The backends' printers (NumPy evaluation, exact evaluation, generated NumPy, torch and JAX)
and the notation printer dispatch by type (``_print_<Class>``); a node type or one of its own
node classes (``Elementwise``, below the generic ``Expr``/``MatrixExpr``) must be printed.
"""

from __future__ import annotations

import pytest
from sympy import Expr, MatrixExpr

from symattn.autodiff.vjp import VJP_RULES
from symattn.codegen.backends.jax.backend import JaxMatrixPrinter
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
from symattn.derive.formats.latex import MathPrinter
from symattn.numeric.printers import ExactPrinter, NumPyMatrixPrinter

PRINTERS = (NumPyMatrixPrinter, ExactPrinter, GeneratedNumPyPrinter, TorchMatrixPrinter, JaxMatrixPrinter, MathPrinter)


def _own_classes(node: type) -> list[type]:
    """node's classes up to the generic Expr / MatrixExpr, whose print methods would print anything."""
    mro = node.__mro__
    stop = min(mro.index(base) for base in (Expr, MatrixExpr) if base in mro)
    return list(mro[:stop])


@pytest.mark.parametrize("printer", PRINTERS, ids=lambda p: p.__name__)
def test_every_node_has_a_print_method(printer):
    missing = [
        node.__name__
        for node in VJP_RULES
        if not any(hasattr(printer, f"_print_{c.__name__}") for c in _own_classes(node))
    ]
    assert not missing, f"{printer.__name__} prints no {', '.join(missing)}"


def test_the_language_has_nodes():
    assert len(VJP_RULES) > 10 and all(_own_classes(node) for node in VJP_RULES)
