"""Every function record (``symattn.lang.functions``, ``symattn.lang.rowwise``) against SymPy's calculus and
against each backend's call: a record is the one source of truth for its function, so it is checked here
once for all the tables built from it."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.autodiff.vjp import VJP_RULES
from symattn.codegen.backends.jax.backend import JaxMatrixPrinter
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
from symattn.derive.steps import REASONS
from symattn.errors import UnsupportedNodeError
from symattn.lang.functions import FUNCTIONS, Elementwise, FunctionRecord
from symattn.lang.naming.parse import parse
from symattn.lang.ops import Exp, Log, LogSoftmax, RowSoftmax, Sigmoid, Softplus, Tanh
from symattn.lang.rowwise import RowWise

# the records computed from A's entries; a drawn one (dropout's mask, ``draws``) is checked on its own below
DRAWN = sorted((r for r in FUNCTIONS.values() if hasattr(r, "draws")), key=lambda r: r.function)
ENTRYWISE = sorted(
    (r for r in FUNCTIONS.values() if issubclass(r, Elementwise) and r not in DRAWN), key=lambda r: r.function
)
ROWWISE = sorted((r for r in FUNCTIONS.values() if issubclass(r, RowWise)), key=lambda r: r.function)
X = sp.MatrixSymbol("X", 3, 4)
RNG = np.random.default_rng(7)
VALUES = RNG.uniform(0.2, 2.0, (3, 4))  # inside every function's domain (log needs x > 0)


def _scalar(record: type, order: int = 0):
    """f (or f′) of the record's scalar formula (its example's parameters), evaluated by mpmath: independent of
    every printer."""
    t = sp.Symbol("t")
    f = record.example(X).scalar_of(t)
    return np.vectorize(lambda v: float(sp.lambdify(t, sp.diff(f, t, order), "mpmath")(v)))


@pytest.mark.parametrize("record", ENTRYWISE, ids=lambda r: r.function)
def test_the_derivative_is_sympys_derivative_of_the_scalar(record):
    """f′(A) as the record writes it (a matrix expression of nodes), against d/dx of its scalar f."""
    got = sa.lambdify([X], record.example(X).derivative())(VALUES)
    assert np.max(np.abs(got - _scalar(record, 1)(VALUES))) < 1e-12


def _evaluate(printer, expr, namespace: dict):
    text = printer.doprint(expr)
    exec(printer.helper_source() + f"\n\ndef _f(X):\n    return {text}\n", namespace)
    return namespace["_f"]


def _backends() -> dict:
    """printer class → (its namespace, array maker, to-numpy); torch and JAX where installed."""
    found = {GeneratedNumPyPrinter: ({"np": np}, np.asarray, np.asarray)}
    try:
        import torch

        found[TorchMatrixPrinter] = ({"torch": torch}, torch.tensor, lambda t: t.numpy())
    except ImportError:  # pragma: no cover - torch is installed in CI
        pass
    try:
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_enable_x64", True)
        found[JaxMatrixPrinter] = ({"jax": jax, "jnp": jnp}, jnp.asarray, np.asarray)
    except ImportError:  # pragma: no cover - JAX is installed in CI
        pass
    return found


BACKENDS = _backends()


@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
@pytest.mark.parametrize("record", ENTRYWISE, ids=lambda r: r.function)
def test_every_backend_call_computes_the_scalar_function(record, printer):
    namespace, array, to_numpy = BACKENDS[printer]
    got = to_numpy(_evaluate(printer(), record.example(X), dict(namespace))(array(VALUES)))
    assert np.max(np.abs(got - _scalar(record)(VALUES))) < 1e-12


@pytest.mark.parametrize("record", ENTRYWISE + ROWWISE + DRAWN, ids=lambda r: r.function)
def test_exact_evaluation_agrees_with_numpy(record):
    values = np.array([[sp.Rational(1, 3), sp.Rational(-2, 5), 2], [1, sp.Rational(1, 7), -1]], dtype=object)
    if record is Log:
        values = np.abs(values) + 1
    x = sp.MatrixSymbol("X", 2, 3)
    node = record.example(x)
    exact = np.array(sa.lambdify([x], node, backend="exact")(values), dtype=float)
    # (equal infinities agree: keep's −∞)
    np.testing.assert_allclose(exact, sa.lambdify([x], node)(values.astype(float)), rtol=0, atol=1e-14)


def _row_reference(record: type, a: np.ndarray) -> np.ndarray:
    """softmax or log-softmax of each row, rows of -inf allowed (zero probabilities), by numpy directly."""
    finite = np.isfinite(a)
    e = np.where(finite, np.exp(np.where(finite, a, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total == 0, 1.0, total)
    with np.errstate(divide="ignore"):
        return {RowSoftmax: p, LogSoftmax: np.log(p)}[record]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
@pytest.mark.parametrize("record", ROWWISE, ids=lambda r: r.function)
def test_every_backend_call_computes_the_row_function(record, printer, masked):
    """The plain call on finite rows; the masked call on rows holding -inf, a whole row of them included."""
    namespace, array, to_numpy = BACKENDS[printer]
    a = RNG.standard_normal((2, 3, 4))
    p = printer()
    if masked:
        a[0, 1, [0, 2]] = -np.inf
        a[1, 2, :] = -np.inf
        p.mask = "M"
    f = _evaluate(p, record(X), dict(namespace) | {"M": 0.0 if masked else None})
    got = to_numpy(f(array(a)))
    want = _row_reference(record, a)
    assert np.array_equal(np.isneginf(got), np.isneginf(want)) and not np.isnan(got).any()
    finite = np.isfinite(want)
    assert np.max(np.abs(got[finite] - want[finite])) < 1e-12


@pytest.mark.parametrize("record", ROWWISE, ids=lambda r: r.function)
def test_the_row_vjp_is_the_adjoint_of_the_row_jvp_and_the_jvp_a_derivative(record):
    """tr(Gᵀ J(dA)) = tr(J*(G)ᵀ dA), and J(dA) against a central difference of the value."""
    g, da = sp.MatrixSymbol("G", 3, 4), sp.MatrixSymbol("dA", 3, 4)
    node = record(X)
    a, gv, dv = (RNG.standard_normal((3, 4)) for _ in range(3))
    jvp = sa.lambdify([X, da], node.jvp(da))(a, dv)
    vjp = sa.lambdify([X, g], node.vjp(g))(a, gv)
    assert abs(np.sum(gv * jvp) - np.sum(vjp * dv)) < 1e-12
    value, h = sa.lambdify([X], node), 1e-6
    central = (value(a + h * dv) - value(a - h * dv)) / (2 * h)
    assert np.max(np.abs(central - jvp)) < 1e-8


def test_what_a_derivative_reads_decides_what_is_saved():
    assert [r.reads_value() for r in (Exp, Tanh, Sigmoid, Softplus, Log)] == [True, True, True, False, False]
    assert [r.reads_input() for r in (Exp, Tanh, Sigmoid, Softplus, Log)] == [False, False, False, True, True]


def test_a_backend_without_the_function_is_named_with_the_node():
    with pytest.raises(UnsupportedNodeError, match=r"Softplus.*the fused backend"):
        Softplus(X).call("fused")
    with pytest.raises(UnsupportedNodeError, match=r"LogSoftmax.*masks in the fused backend"):
        LogSoftmax(X).masked_call("fused")


def test_every_record_is_complete():
    """A name, both notations, NumPy, torch and JAX calls (row-wise: masked too, and exact), a letter, a reason."""
    for record in FUNCTIONS.values():
        assert record.function and record.latex and record.text and record.letter, record
        generated = set(record.calls) | set(getattr(record, "draws", ()))  # a drawn record: its drawing calls
        assert {"numpy", "torch", "jax"} <= generated and "numpy" in record.calls, record
        assert len(record.reason) == 2 and all(record.reason), record
        if issubclass(record, RowWise):
            assert {"numpy", "torch", "jax"} <= set(record.masked_calls) and "exact" in record.calls, record
        assert record.exported == hasattr(sa, record.function), record


def test_every_differentiated_node_has_its_reasons():
    """The derivation prints two reasons for every node it differentiates: none falls back to a vaguer one."""
    missing = [k.__name__ for k in VJP_RULES if k not in REASONS and not issubclass(k, FunctionRecord)]
    assert not missing, missing


def test_the_parser_reads_every_exported_function():
    """f(X), and a record with parameters with its example's after X (clamp(X, 1/2, 3/2)): the same node."""
    for record in FUNCTIONS.values():
        if record.exported:
            node = record.example(X)
            parameters = "".join(f", {p}" for p in node.args[1:])
            assert parse(f"{record.function}(X{parameters})", {"X": X}) == node


@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
def test_relu_and_its_step_on_both_sides_of_zero_and_at_it(printer):
    """ReLU and step (ReLU′) where the records' fixture never goes (negative entries), and at 0 itself, where torch
    defines relu′(0) = 0; step′ = 0, so ReLU has no second derivative but zero."""
    from symattn.lang.functions import Relu, Step

    namespace, array, to_numpy = BACKENDS[printer]
    values = np.array([[-1.5, -0.25, 0.0, 0.5], [2.0, -3.0, 0.0, 1e-3], [-1e-3, 0.7, -0.7, 4.0]])
    for record, want in ((Relu, np.maximum(values, 0.0)), (Step, (values > 0).astype(float))):
        got = to_numpy(_evaluate(printer(), record(X), dict(namespace))(array(values)))
        assert np.array_equal(got, want), (record.function, got)
    assert Relu(X).derivative() == Step(X) and Step(X).derivative() == sp.ZeroMatrix(3, 4)


@pytest.mark.parametrize("record", DRAWN, ids=lambda r: r.function)
def test_a_drawn_record_is_a_constant_of_the_call(record):
    """Z′ = 0; verification's Z is one fixed draw per shape of 0 and 1/(1 − p); torch's draws are such entries, and
    with training False ones; the backends without draws refuse it in one line."""
    node = record.example(X)
    p = float(node.args[1])
    assert np.all(sa.lambdify([X], node.derivative())(VALUES) == 0)
    fixed = sa.lambdify([X], node)(VALUES)
    assert np.array_equal(fixed, sa.lambdify([X], node)(VALUES + 1)) and set(np.unique(fixed)) <= {0, 1 / (1 - p)}
    for printer, (namespace, array, to_numpy) in BACKENDS.items():
        if printer.backend not in record.draws:
            with pytest.raises(UnsupportedNodeError, match=f"generated {printer.backend} code"):
                printer().doprint(node)
            continue
        rng = None  # the generated forward's keywords: torch's default generator, NumPy's Generator, a JAX key
        if printer.backend == "numpy":
            rng = np.random.default_rng(0)
        elif printer.backend == "jax":
            rng = namespace["jax"].random.key(0)
        scope = dict(namespace, training=True, rng=rng)
        f = _evaluate(printer(), node, scope)
        drawn = to_numpy(f(array(np.ones((300, 300)))))
        assert set(np.unique(drawn)) == {0, 1 / (1 - p)}
        scope["training"] = False
        assert np.all(to_numpy(f(array(VALUES))) == 1)


@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
def test_keep_and_step_as_masks_on_both_sides_of_zero_at_it_and_at_nan(printer):
    """keep(A) = 0 where A > 0, −∞ elsewhere (NaN too), and step(NaN) = 0, as torch's A > 0 is False there: a
    comparison [a < b] = step(b − a) of −∞ with −∞ (b − a = NaN) is False in every backend, as in torch."""
    from symattn.lang.functions import Keep, Step

    namespace, array, to_numpy = BACKENDS[printer]
    values = np.array([[-1.5, 0.0, 0.5, np.nan], [2.0, -3.0, 1e-300, -1e-300], [np.inf, -np.inf, 0.7, 4.0]])
    wanted = {Keep: np.where(values > 0, 0.0, -np.inf), Step: (values > 0).astype(float)}
    for record, want in wanted.items():
        got = to_numpy(_evaluate(printer(), record(X), dict(namespace))(array(values)))
        assert np.array_equal(got, want), (record.function, got)
        assert record(X).derivative() == sp.ZeroMatrix(3, 4)


@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
def test_the_kth_largest_entry_of_each_row_in_every_backend(printer):
    """kth_k(A) = the k-th largest entry of each row (sorted descending, place k), a column, for every k ≤ m."""
    from symattn.lang.rowwise import KthLargest

    namespace, array, to_numpy = BACKENDS[printer]
    a = RNG.standard_normal((2, 3, 4))
    for k in range(1, 5):
        got = to_numpy(_evaluate(printer(), KthLargest(X, k), dict(namespace))(array(a)))
        assert np.array_equal(got, -np.sort(-a, axis=-1)[..., k - 1 : k]), k


def test_the_kth_largest_exactly_and_its_derivatives_are_the_selected_entrys():
    """Exact evaluation orders rows by value; the VJP is autograd's one-hot (topk's backward), the JVP its adjoint,
    and a central difference of the value agrees; k must be a whole number ≥ 1."""
    torch = pytest.importorskip("torch")
    from symattn.errors import SymattnError
    from symattn.lang.rowwise import KthLargest

    values = np.array([[sp.Rational(1, 3), sp.Rational(-2, 5), 2, 0], [1, sp.Rational(1, 7), -1, 5]], dtype=object)
    x2 = sp.MatrixSymbol("X", 2, 4)
    exact = sa.lambdify([x2], KthLargest(x2, 2), backend="exact")(values)
    assert exact.tolist() == [[sp.Rational(1, 3)], [1]]
    g, da = sp.MatrixSymbol("G", 3, 1), sp.MatrixSymbol("dA", 3, 4)
    node = KthLargest(X, 3)
    a, gv, dv = RNG.standard_normal((3, 4)), RNG.standard_normal((3, 1)), RNG.standard_normal((3, 4))
    vjp = sa.lambdify([X, g], node.vjp(g))(a, gv)
    leaf = torch.tensor(a, requires_grad=True)
    (want,) = torch.autograd.grad(torch.topk(leaf, 3, dim=-1).values[..., -1:], leaf, torch.tensor(gv))
    assert np.array_equal(vjp, want.numpy())
    jvp = sa.lambdify([X, da], node.jvp(da))(a, dv)
    assert abs(np.sum(gv * jvp) - np.sum(vjp * dv)) < 1e-12
    value, h = sa.lambdify([X], node), 1e-6
    assert np.max(np.abs((value(a + h * dv) - value(a - h * dv)) / (2 * h) - jvp)) < 1e-8
    for k in (0, 1.5, True):
        with pytest.raises(SymattnError, match="whole k ≥ 1"):
            KthLargest(X, k)
