"""The piecewise-linear records with parameters (clamp, hardtanh, leaky ReLU): their values and derivatives at the
kinks exactly as torch's autograd has them, in every backend; the parameters kept through every rebuild."""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

torch = pytest.importorskip("torch")  # the reference is torch's autograd (the floor leg has no torch)

from test_function_records import BACKENDS, _evaluate  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.errors import SymattnError  # noqa: E402
from symattn.lang.graph import rewrite  # noqa: E402
from symattn.lang.piecewise import Clamp, ClampGrad, Hardtanh, HardtanhGrad, LeakyRelu, LeakyStep  # noqa: E402

X = sp.MatrixSymbol("X", 3, 4)
F = torch.nn.functional

# (node of X, torch's function): the kinks (each bound, 0) are among the values below
CASES = {
    "clamp[-1,1]": (Clamp(X, -1, 1), lambda x: torch.clamp(x, -1, 1)),
    "clamp[-0.5,)": (Clamp(X, -0.5), lambda x: torch.clamp_min(x, -0.5)),
    "clamp(,0.5]": (Clamp(X, None, 0.5), lambda x: torch.clamp_max(x, 0.5)),
    "hardtanh": (Hardtanh(X), F.hardtanh),
    "hardtanh(-0.5,0.5)": (Hardtanh(X, -0.5, 0.5), lambda x: F.hardtanh(x, -0.5, 0.5)),
    "leaky_relu": (LeakyRelu(X), F.leaky_relu),
    "leaky_relu(0.2)": (LeakyRelu(X, 0.2), lambda x: F.leaky_relu(x, 0.2)),
}
VALUES = np.array([[-1.0, 1.0, 0.0, -0.5], [0.5, -2.0, 2.0, -0.25], [0.25, -1e-3, 1e-3, 1.5]])


def _torch_reference(f) -> tuple[np.ndarray, np.ndarray]:
    """f(x) and torch autograd's f′(x) (the gradient of sum f(x)), float64."""
    x = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
    y = f(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    return y.detach().numpy(), g.numpy()


@pytest.mark.parametrize("printer", list(BACKENDS), ids=lambda p: p.backend)
@pytest.mark.parametrize("case", list(CASES))
def test_value_and_derivative_at_the_kinks_are_torchs(case, printer):
    node, f = CASES[case]
    want_value, want_derivative = _torch_reference(f)
    namespace, array, to_numpy = BACKENDS[printer]
    for expr, want in ((node, want_value), (node.derivative(), want_derivative)):
        got = to_numpy(_evaluate(printer(), expr, dict(namespace))(array(VALUES)))
        assert np.array_equal(got, want), (case, type(expr).__name__, got, want)


@pytest.mark.parametrize("case", list(CASES))
def test_exact_evaluation_at_the_kinks_is_torchs(case):
    node, f = CASES[case]
    exact = np.vectorize(sp.Rational, otypes=[object])(VALUES.astype(str))
    for expr, want in zip((node, node.derivative()), _torch_reference(f), strict=True):
        got = np.array(sa.lambdify([X], expr, backend="exact")(exact), dtype=float)
        assert np.array_equal(got, want), (case, type(expr).__name__, got, want)


@pytest.mark.parametrize("case", list(CASES))
def test_the_second_derivative_is_zero(case):
    node, _ = CASES[case]
    assert node.derivative().derivative() == sp.ZeroMatrix(3, 4)
    assert sa.grad(sa.sum(node.derivative()), X)[X] in (0, sp.ZeroMatrix(3, 4))


def test_the_derivative_records_are_torchs_at_the_kinks():
    """clamp′ includes its bounds (clamp_backward), hardtanh′ excludes them (hardtanh_backward), LeakyReLU′(0) = a."""
    assert type(Clamp(X, -1, 1).derivative()) is ClampGrad and type(Hardtanh(X).derivative()) is HardtanhGrad
    assert LeakyRelu(X, 0.2).derivative() == LeakyStep(X, sp.Rational(1, 5))
    assert Clamp.scalar(sp.Integer(1), -1, 1) == 1 and ClampGrad.scalar(sp.Integer(1), -1, 1) == 1
    assert HardtanhGrad.scalar(sp.Integer(1), -1, 1) == 0
    assert LeakyStep.scalar(sp.Integer(0), sp.Rational(1, 5)) == sp.Rational(1, 5)


def test_the_parameters_survive_every_rebuild():
    y = sp.MatrixSymbol("Y", 3, 4)
    for node, _ in CASES.values():
        assert node.xreplace({X: y}).args[1:] == node.args[1:]
        assert node.with_arg(y) == node.xreplace({X: y})
        assert node.func(*node.args) == node
        assert rewrite(node.xreplace({X: y}), lambda e: None).xreplace({y: X}) == node


def test_the_parameters_print_in_latex_and_text():
    assert Clamp(X, -1, 1).notation(True) == r"\operatorname{clamp}_{[-1, 1]}"
    assert Clamp(X, 0).notation(False) == "clamp_[0, ∞)"
    assert Clamp(X, None, 0.5).notation(False) == "clamp_(-∞, 0.5]"
    assert Hardtanh(X).notation(False) == "hardtanh_[-1, 1]"
    assert Hardtanh(X).derivative().notation(False) == "𝟙°_(-1, 1)" and ClampGrad(X, 0).notation(False) == "𝟙_[0, ∞)"
    assert LeakyRelu(X).notation(True) == r"\operatorname{LeakyReLU}_{0.01}"
    assert LeakyRelu(X, sp.Rational(1, 3)).notation(True) == r"\operatorname{LeakyReLU}_{\frac{1}{3}}"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: sa.clamp(X), "needs a finite lower or upper bound"),
        (lambda: sa.clamp(X, 1, -1), "lo ≤ hi"),
        (lambda: sa.clamp(X, sp.Symbol("t"), 1), "must be a real number"),
        (lambda: sa.leaky_relu(X, float("inf")), "finite"),
        (lambda: sa.hardtanh(X, None, 1), "both bounds finite"),
    ],
)
def test_bad_parameters_are_refused_in_one_line(make, words):
    with pytest.raises(SymattnError, match=words) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_a_float_parameter_is_its_shortest_decimal():
    assert LeakyRelu(X, 0.01) == LeakyRelu(X) and LeakyRelu(X, 0.01).args[1] == sp.Rational(1, 100)
    assert sa.clamp(X, -1.5, 2).args[1:] == (sp.Rational(-3, 2), sp.Integer(2))
