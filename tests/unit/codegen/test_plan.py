"""The print plan (``schedule.plan``): the decisions about buffers and products made before printing, and the
printers printing exactly what it says.

Every printed form is also checked by evaluating it on random arrays against the expression's value.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
import sympy as sp
from sympy import HadamardProduct, MatAdd, MatMul, MatrixSymbol, OneMatrix, Transpose

from symattn.codegen.backends.common_runtime import chain
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
from symattn.codegen.emit.sections import INPLACE_WIDTH, Sections
from symattn.codegen.schedule.plan import (
    AT_CALL,
    NO_BUFFERS,
    Plan,
    broadcast_column,
    cheapest_tree,
    flipped,
    scaled_factor,
)
from symattn.lang.functions import Exp
from symattn.numeric import low_precision
from symattn.numeric.lambdify import lambdify
from symattn.specs import dim

n, m, d = dim("n"), dim("m"), dim("d")
A, B, C = (MatrixSymbol(s, n, m) for s in "ABC")
Q, K = MatrixSymbol("Q", n, d), MatrixSymbol("K", m, d)
V = MatrixSymbol("V", m, d)
u = MatrixSymbol("u", n, 1)
SIZES = {"n": 6, "m": 7, "d": 3}
PRECISION = {name: getattr(low_precision, name) for name in ("wide_matmul", "narrow_matmul", "matmul_tn")}


def _print(printer_class, expr, plan=NO_BUFFERS) -> str:
    printer = printer_class()
    with printer.planned(plan):
        return printer.doprint(expr)


def _evaluate(text: str, values: dict) -> np.ndarray:
    """The printed NumPy text's value (the names of the plan's buffers are overwritten: copies are passed; the
    runtime's chain and its products of a float16 run's precision are at hand)."""
    namespace = {"np": np, "chain": chain, **PRECISION, **{k: v.copy() for k, v in values.items()}}
    return eval(compile(ast.parse(text, mode="eval"), "<plan>", "eval"), namespace)  # our own printed text


def _values() -> dict:
    rng = np.random.default_rng(0)
    shapes = {"A": "nm", "B": "nm", "C": "nm", "Q": "nd", "K": "md", "V": "md", "u": "n1"}
    return {k: rng.standard_normal([SIZES.get(c, 1) for c in s]) for k, s in shapes.items()}


def _reference(expr) -> np.ndarray:
    """expr's value by the evaluation printer (numeric.lambdify), independent of the generated-code printers."""
    values = _values()
    symbols = sorted(expr.atoms(MatrixSymbol), key=str)
    return lambdify(symbols, expr)(*(values[str(s.name)] for s in symbols))


@pytest.mark.parametrize(
    ("expr", "consumable", "buffer"),
    [
        (MatAdd(A, B), {"A"}, "A"),
        (MatAdd(A, B), {"B"}, "B"),
        (MatAdd(A, MatMul(-1, B)), {"B"}, None),  # a subtracted term is never the root
        (MatAdd(A, MatMul(u, OneMatrix(1, m))), {"u"}, None),  # nor a broadcast
        (HadamardProduct(MatAdd(A, B), C), {"A"}, "A"),  # the root of the root
        (MatAdd(A, B), set(), None),
    ],
)
def test_buffer_is_the_first_positive_full_term_with_one(expr, consumable, buffer):
    assert Plan(frozenset(consumable)).buffer(expr) == buffer


def test_printers_print_what_the_plan_says():
    expr = HadamardProduct(MatAdd(A, MatMul(-1, B)), C)
    plan = Plan(frozenset({"A"}))
    numpy_text = _print(GeneratedNumPyPrinter, expr, plan)
    assert numpy_text == "np.multiply(np.subtract(A, B, out=A), C, out=A)"
    assert _print(TorchMatrixPrinter, expr, plan) == "A.sub_(B).mul_(C)"
    assert _print(GeneratedNumPyPrinter, expr) == "(A - B) * C"  # no plan: new arrays
    np.testing.assert_allclose(_evaluate(numpy_text, _values()), _reference(expr))


def test_an_entrywise_function_into_its_dying_argument():
    expr = Exp(MatAdd(A, B))
    plan = Plan(frozenset({"A"}))
    assert _print(GeneratedNumPyPrinter, expr, plan) == "np.exp(np.add(A, B, out=A), out=A)"
    assert _print(TorchMatrixPrinter, expr, plan) == "A.add_(B).exp_()"


def test_a_long_inplace_chain_prints_as_plain_arithmetic():
    names = [MatrixSymbol(f"value_with_a_long_name_{i}", n, m) for i in range(6)]
    expr = MatAdd(*names)
    sections = Sections(sched=None, printer=GeneratedNumPyPrinter(), mask=None, batched=set(), protected=set())
    inplace = _print(GeneratedNumPyPrinter, expr, Plan(frozenset({"value_with_a_long_name_0"})))
    assert len(inplace) > INPLACE_WIDTH
    assert sections.value(expr, Plan(frozenset({"value_with_a_long_name_0"}))) == _print(GeneratedNumPyPrinter, expr)


def test_a_chain_whose_best_order_depends_on_the_sizes_is_ordered_at_call_time():
    """Q Kᵀ V costs 4·n·m·d left to right and 2·m·d² + 2·n·d² right to left: which is less depends on n, m
    against d, which the spec leaves open, so no order is printed; the runtime ``chain`` picks it from the
    arrays' shapes (and computes the same product)."""
    assert cheapest_tree([Q, Transpose(K), V]) == AT_CALL
    assert cheapest_tree([Q, Transpose(K)]) is None
    assert cheapest_tree([A, Transpose(B), A]) == AT_CALL  # 4·n²·m against 4·n·m²: alike only where n = m
    text = _print(GeneratedNumPyPrinter, MatMul(Q, Transpose(K), V))
    assert text == "chain(Q, K.mT, V)"
    namespace = _values()
    np.testing.assert_allclose(_evaluate(text, namespace), _reference(MatMul(Q, Transpose(K), V)))
    scaled = _print(GeneratedNumPyPrinter, MatMul(2, Q, Transpose(K), V))
    assert scaled.startswith("chain(") and "2 * " in scaled
    np.testing.assert_allclose(_evaluate(scaled, namespace), 2 * _reference(MatMul(Q, Transpose(K), V)))


def test_an_order_cheapest_at_every_size_is_printed():
    """u vᵀ Aᵀ (a column, a row, an m × n matrix): (u vᵀ) Aᵀ costs 2·n·m + 2·n²·m, u (vᵀ Aᵀ) 2·m·n + 2·n²,
    less at every size: printed in that order, no call-time choice."""
    v = MatrixSymbol("v", m, 1)
    tree = cheapest_tree([u, Transpose(v), Transpose(A)])  # u vᵀ Aᵀ: (vᵀ Aᵀ) first, a row, at every size
    assert tree is not None and tree != AT_CALL and tree.args[0] == u
    # (vᵀ Aᵀ reads the n × m A: the runtime's narrow_matmul, a @ b but for a float16 run's float32 A)
    assert _print(GeneratedNumPyPrinter, MatMul(u, Transpose(v), Transpose(A))) == "u @ (narrow_matmul(v.mT, A.mT))"


class _Recorded(np.ndarray):
    """An array that records the operands' shapes of each product it takes part in (for the runtime chain)."""

    products: list = []

    def __matmul__(self, other):
        _Recorded.products.append((self.shape, other.shape))
        return np.matmul(np.asarray(self), np.asarray(other)).view(_Recorded)


def _recorded_chain(*arrays: np.ndarray) -> np.ndarray:
    """chain(*arrays) with every product it takes recorded in _Recorded.products."""
    _Recorded.products = []
    return np.asarray(chain(*(a.view(_Recorded) for a in arrays)))


@pytest.mark.parametrize(("sizes", "best"), [((2, 512, 8, 512), "left"), ((512, 8, 512, 8), "right")])
def test_the_runtime_chain_takes_the_cheapest_order_at_the_shapes(sizes, best):
    """chain(A, B, C) for (a × b)(b × c)(c × e): (A B) C costs a·b·c + a·c·e, A (B C) b·c·e + a·b·e; the runtime
    takes the cheaper one at the shapes it is given, and its value is the product."""
    a, b, c, e = sizes
    rng = np.random.default_rng(1)
    mats = [rng.standard_normal(s) for s in ((a, b), (b, c), (c, e))]
    value = _recorded_chain(*mats)
    spent = sum(p[-2] * p[-1] * q[-1] for p, q in _Recorded.products)
    left, right = a * b * c + a * c * e, b * c * e + a * b * e
    assert spent == (left if best == "left" else right) == min(left, right)
    np.testing.assert_allclose(value, mats[0] @ mats[1] @ mats[2])


def test_the_runtime_chain_pays_an_unbatched_product_once():
    """Two weights multiplied once for the batch (g × g), then the batched rows: at a batch of 64 that is the
    cheaper order, although without the batch X (W_1 W_2) and (X W_1) W_2 cost alike."""
    rng = np.random.default_rng(2)
    _recorded_chain(rng.standard_normal((64, 16, 16)), rng.standard_normal((16, 16)), rng.standard_normal((16, 16)))
    assert _Recorded.products[0] == ((16, 16), (16, 16))  # W_1 W_2 first


def test_the_scalar_multiplies_the_smallest_factor():
    assert scaled_factor([Q, Transpose(K)]) == 0  # n × d and d × m alike: the first
    assert scaled_factor([A, K]) == 1  # n × m against m × d
    expr = MatMul(sp.Rational(1, 2), A, K)
    text = _print(GeneratedNumPyPrinter, expr)
    assert text == "narrow_matmul(A, (0.5) * K)"  # (A is n × m: a float16 run's float32 A is rounded once)
    np.testing.assert_allclose(_evaluate(text, _values()), _reference(expr))


def test_a_long_transposed_product_is_flipped_where_the_backend_asks():
    assert flipped(Transpose(A), Q, 8)  # Aᵀ Q: A's m columns against Q's d
    assert not flipped(Transpose(A), Q, None)
    assert not flipped(Transpose(Q), A, 8)
    assert _print(TorchMatrixPrinter, MatMul(Transpose(A), Q)) == "matmul_tn(A, Q)"
    # NumPy's matmul_tn is A.mT @ Q (a float16 run's product left float32, a part add_rows sums before one rounding)
    assert _print(GeneratedNumPyPrinter, MatMul(Transpose(A), Q)) == "matmul_tn(A, Q)"
    np.testing.assert_allclose(_evaluate("matmul_tn(A, Q)", _values()), _reference(MatMul(Transpose(A), Q)))


def test_broadcast_column_is_the_smaller_value():
    assert broadcast_column(MatMul(u, OneMatrix(1, m))) == u
    assert broadcast_column(A) is None
