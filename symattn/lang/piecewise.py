"""Piecewise-linear entrywise functions with parameters: clamp, hardtanh, leaky ReLU, and their derivatives.

Each is a function record (``symattn.lang.functions``) whose parameters are numbers held as the node's further
SymPy arguments, A first: clamp(A, lo, hi) (a bound that is absent is ∓∞), LeakyReLU(A, a). The calls name the
parameters (``{lo}``, ``{hi}``, ``{slope}``) and the node fills them in; exact evaluation hands them to the
scalar. The derivatives are records too, with torch autograd's values at the kinks:

- clamp′ = 1 on [lo, hi], bounds included (torch's clamp_backward), 0 elsewhere;
- hardtanh′ = 1 on (lo, hi), bounds excluded (torch's hardtanh_backward), 0 elsewhere: the same value as clamp,
  another derivative at the two bounds;
- LeakyReLU′ = 1 where x > 0, a where x ≤ 0 (torch's leaky_relu_backward);

and their own derivatives are 0 (almost everywhere).

Dropout's mask Z_p(A) is here too (a record of one parameter, p): a constant of the call, drawn once by the
generated forward from the framework's generator (``draws``: the backends whose generated code draws it), fixed
where a derivation is verified (NumPy and exact evaluation: one mask per shape).
"""

from __future__ import annotations

import math

import sympy as sp
from sympy import Basic, MatrixExpr

from symattn.errors import SymattnError, UnsupportedNodeError
from symattn.lang.algebra import product
from symattn.lang.functions import EXACT, JAX, NUMPY, TORCH, TRITON, Elementwise, FunctionRecord
from symattn.lang.graph import nodes
from symattn.lang.naming.safe import expression
from symattn.lang.node_base import require_matrix

TORCH_SLOPE = sp.Rational(1, 100)  # F.leaky_relu's default negative_slope, 0.01
ABSENT = {"lo": sp.S.NegativeInfinity, "hi": sp.S.Infinity}  # a bound not given: no bound on that side


def parameter(value: object, what: str) -> Basic:
    """A parameter as an exact real SymPy number: a float as its shortest decimal (0.01 → 1/100), so that it
    prints as written and rounds back to itself."""
    if isinstance(value, float) and math.isfinite(value):
        value = sp.Rational(repr(value))
    value = expression(value, what)
    if not (value.is_number and value.is_extended_real):
        raise SymattnError(f"{what} must be a real number, got {value}")
    return value


def decimal(p: Basic, latex: bool) -> str:
    """A parameter as a derivation prints it: a terminating decimal as one (0.01), ±∞, else SymPy's form (1/3)."""
    if p.is_infinite:
        return ("-" if p.is_extended_negative else "") + (r"\infty" if latex else "∞")
    if p.is_Rational and not set(sp.factorint(p.q)) - {2, 5}:
        return repr(float(p)) if p.q != 1 else str(p)
    return sp.latex(p) if latex else str(p)


def literal(p: Basic) -> str:
    """A parameter in generated code: a float literal, None for an absent bound."""
    return "None" if p.is_infinite else repr(float(p))


class Parametrised(Elementwise):
    """An entrywise record with number parameters (``parameters``, after A in the node's args)."""

    example_parameters: tuple = ()

    @classmethod
    def example(cls, a: MatrixExpr) -> FunctionRecord:
        return cls(a, *cls.example_parameters)

    def parameter_values(self) -> dict[str, Basic]:
        """The parameters by name."""
        return dict(zip(self.parameters, self.args[1:], strict=True))

    def call(self, backend: str) -> str:
        """The record's template with this node's parameters filled in ({0} stays the operand)."""
        template = super().call(backend)
        return template.format("{0}", **{k: literal(v) for k, v in self.parameter_values().items()})

    def subscript(self, latex: bool) -> str:
        """The parameters as the name's subscript prints them."""
        return ", ".join(decimal(v, latex) for v in self.args[1:])

    def notation(self, latex: bool) -> str:
        name = super().notation(latex)
        return f"{name}_{{{self.subscript(latex)}}}" if latex else f"{name}_{self.subscript(latex)}"


def _bounds(lo: object, hi: object, what: str) -> tuple[Basic, Basic]:
    """(lo, hi) as SymPy numbers, an absent bound (None, ∓∞) as ∓∞; at least one finite, lo ≤ hi."""
    lo = ABSENT["lo"] if lo is None else parameter(lo, f"{what}'s lower bound")
    hi = ABSENT["hi"] if hi is None else parameter(hi, f"{what}'s upper bound")
    if lo == ABSENT["hi"] or hi == ABSENT["lo"] or (lo.is_infinite and hi.is_infinite):
        raise SymattnError(f"{what} needs a finite lower or upper bound, got [{lo}, {hi}]")
    if bool(lo > hi):
        raise SymattnError(f"{what}'s bounds must satisfy lo ≤ hi, got [{lo}, {hi}]")
    return lo, hi


# a clamp of one bound, by backend, where the two-sided call cannot take None for the other (tl.maximum of None)
ONE_SIDED = {TRITON: {"lo": "tl.maximum({0}, {lo})", "hi": "tl.minimum({0}, {hi})"}}
# a window's test of {0} against each bound present, by (bounds included, bound)
_CONDITIONS = {(True, "lo"): "{0} >= {lo}", (True, "hi"): "{0} <= {hi}", (False, "lo"): "{0} > {lo}"}
_CONDITIONS[False, "hi"] = "{0} < {hi}"


class _Bounded(Parametrised):
    """f(A, lo, hi) of two bounds, either of them absent (∓∞)."""

    parameters = ("lo", "hi")
    closed = True  # the bounds' own values inside the interval (the value's range; a window's: where it is 1)

    def __new__(cls, arg: MatrixExpr, lo: object = None, hi: object = None) -> _Bounded:
        arg = expression(arg)
        require_matrix(arg, cls.function)
        return Basic.__new__(cls, arg, *_bounds(lo, hi, cls.function))

    def subscript(self, latex: bool) -> str:
        """[lo, hi], an open end where the bound is excluded or absent."""
        lo, hi = self.args[1:]
        left = "[" if self.closed and not lo.is_infinite else "("
        right = "]" if self.closed and not hi.is_infinite else ")"
        return f"{left}{decimal(lo, latex)}, {decimal(hi, latex)}{right}"

    @property
    def present(self) -> list[str]:
        """The bounds given (finite), of "lo" and "hi"."""
        return [k for k, v in self.parameter_values().items() if not v.is_infinite]


class Clamp(_Bounded):
    """clamp(A, lo, hi) = min(max(A, lo), hi), entrywise (torch.clamp, clip); clamp′ = 1 on [lo, hi], the bounds
    included as torch's clamp_backward has them, 0 elsewhere (``ClampGrad``)."""

    function = "clamp"
    finite = True
    latex, text = r"\operatorname{clamp}", "clamp"
    calls = {
        NUMPY: "np.clip({0}, {lo}, {hi})",
        TORCH: "torch.clamp({0}, {lo}, {hi})",
        JAX: "jnp.clip({0}, {lo}, {hi})",
        TRITON: "tl.minimum(tl.maximum({0}, {lo}), {hi})",
    }
    flops = 2
    example_parameters = (sp.Rational(1, 2), sp.Rational(3, 2))

    @staticmethod
    def scalar(x: Basic, lo: Basic = ABSENT["lo"], hi: Basic = ABSENT["hi"]) -> Basic:
        lo, hi = sp.sympify(lo), sp.sympify(hi)
        pieces = [(b, beyond) for b, beyond in ((lo, x < lo), (hi, x > hi)) if not b.is_infinite]
        return sp.Piecewise(*pieces, (x, True))

    def call(self, backend: str) -> str:
        """The two-sided template, or where a backend's cannot take None for a bound (``ONE_SIDED``), its call of
        the one bound present."""
        one_sided = ONE_SIDED.get(backend, {})
        if len(self.present) == 2 or not one_sided:
            return super().call(backend)
        (bound,) = self.present
        return one_sided[bound].format("{0}", **{k: literal(v) for k, v in self.parameter_values().items()})

    def derivative(self) -> MatrixExpr:
        return ClampGrad(self.arg, *self.args[1:])


class Hardtanh(Clamp):
    """hardtanh(A, lo, hi): clamp's value, with torch's derivative: 1 on (lo, hi), the bounds excluded
    (hardtanh_backward), 0 elsewhere (``HardtanhGrad``); F.hardtanh's bounds default to [−1, 1]."""

    function = "hardtanh"
    latex, text = r"\operatorname{hardtanh}", "hardtanh"
    calls = {**Clamp.calls, TORCH: "torch.nn.functional.hardtanh({0}, {lo}, {hi})"}

    def __new__(cls, arg: MatrixExpr, lo: object = -1, hi: object = 1) -> Hardtanh:
        node = super().__new__(cls, arg, lo, hi)
        if len(node.present) < 2:
            raise SymattnError(f"hardtanh needs both bounds finite, got [{node.args[1]}, {node.args[2]}]")
        return node

    @staticmethod
    def scalar(x: Basic, lo: Basic = -1, hi: Basic = 1) -> Basic:
        """The bounds' own pieces closed, so that SymPy's derivative is 0 at them, as torch's."""
        return sp.Piecewise((lo, x <= lo), (hi, x >= hi), (x, True))

    def derivative(self) -> MatrixExpr:
        return HardtanhGrad(self.arg, *self.args[1:])


class _Window(_Bounded):
    """1 where A lies between the bounds, else 0, entrywise (a clamp's derivative); its derivative is 0."""

    exported = False
    example_parameters = (sp.Rational(1, 2), sp.Rational(3, 2))

    def condition(self) -> str:
        """The test of {0} against the bounds present."""
        tests = [_CONDITIONS[self.closed, k] for k in self.present]
        return tests[0] if len(tests) == 1 else " & ".join(f"({c})" for c in tests)

    def call(self, backend: str) -> str:
        if backend not in self.calls:
            raise UnsupportedNodeError(self, f"the {backend} backend", [f"{self.function} in {b}" for b in self.calls])
        template = self.calls[backend].replace("{cond}", self.condition())
        return template.format("{0}", **{k: literal(v) for k, v in self.parameter_values().items()})

    def derivative(self) -> MatrixExpr:
        return product(0, sp.OneMatrix(*self.shape))


_WINDOW_CALLS = {
    NUMPY: "({cond}).astype({0}.dtype)",
    TORCH: "({cond}).to({0}.dtype)",
    JAX: "({cond}).astype({0}.dtype)",
    TRITON: "tl.where({cond}, 1.0, 0.0)",
}


class ClampGrad(_Window):
    """clamp′(A) = 1 on [lo, hi], bounds included (torch's clamp_backward), else 0, entrywise (backward passes)."""

    function = "clamp_grad"
    finite = True
    latex, text = r"\mathbb{1}", "𝟙"
    calls = _WINDOW_CALLS

    @staticmethod
    def scalar(x: Basic, lo: Basic = ABSENT["lo"], hi: Basic = ABSENT["hi"]) -> Basic:
        lo, hi = sp.sympify(lo), sp.sympify(hi)
        inside = sp.And(*(c for c, b in ((x >= lo, lo), (x <= hi, hi)) if not b.is_infinite))
        return sp.Piecewise((1, inside), (0, True))


class HardtanhGrad(_Window):
    """hardtanh′(A) = 1 on (lo, hi), bounds excluded (torch's hardtanh_backward), else 0, entrywise."""

    function = "hardtanh_grad"
    finite = True
    latex, text = r"\mathbb{1}^{\circ}", "𝟙°"
    calls = _WINDOW_CALLS
    closed = False

    @staticmethod
    def scalar(x: Basic, lo: Basic = -1, hi: Basic = 1) -> Basic:
        return sp.Piecewise((1, (x > lo) & (x < hi)), (0, True))


def _slope(negative_slope: object) -> Basic:
    slope = parameter(negative_slope, "leaky_relu's negative_slope")
    if slope.is_infinite:
        raise SymattnError(f"leaky_relu's negative_slope must be finite, got {slope}")
    return slope


class _Sloped(Parametrised):
    """A function of A with a finite slope a (leaky_relu's negative_slope, torch's default 0.01) as its parameter."""

    parameters = ("slope",)
    example_parameters = (TORCH_SLOPE,)

    def __new__(cls, arg: MatrixExpr, slope: object = TORCH_SLOPE) -> _Sloped:
        arg = expression(arg)
        require_matrix(arg, cls.function)
        return Basic.__new__(cls, arg, _slope(slope))


class LeakyRelu(_Sloped):
    """LeakyReLU(A) = A where A > 0, a A elsewhere, entrywise (a = negative_slope, torch's default 0.01);
    LeakyReLU′ = 1 where A > 0, a where A ≤ 0, as torch's leaky_relu_backward (``LeakyStep``)."""

    function = "leaky_relu"
    finite = True
    latex, text = r"\operatorname{LeakyReLU}", "LeakyReLU"
    calls = {
        NUMPY: "np.where({0} > 0, {0}, {slope} * {0})",
        TORCH: "torch.nn.functional.leaky_relu({0}, {slope})",
        JAX: "jax.nn.leaky_relu({0}, {slope})",
        TRITON: "tl.where({0} > 0, {0}, {slope} * {0})",
    }
    flops = 2

    def __new__(cls, arg: MatrixExpr, negative_slope: object = TORCH_SLOPE) -> LeakyRelu:
        return super().__new__(cls, arg, negative_slope)

    @staticmethod
    def scalar(x: Basic, slope: Basic = TORCH_SLOPE) -> Basic:
        return sp.Piecewise((x, x > 0), (slope * x, True))

    def derivative(self) -> MatrixExpr:
        return LeakyStep(self.arg, self.args[1])


class LeakyStep(_Sloped):
    """LeakyReLU′(A) = 1 where A > 0, a where A ≤ 0 (torch's value at 0), entrywise (backward passes); its
    derivative is 0."""

    function = "leaky_step"
    finite = True
    exported = False
    latex, text = r"\operatorname{step}", "step"
    calls = {
        NUMPY: "np.where({0} > 0, 1.0, {slope}).astype({0}.dtype)",
        TORCH: "torch.where({0} > 0, 1.0, torch.full_like({0}, {slope}))",
        JAX: "jnp.where({0} > 0, 1.0, {slope}).astype({0}.dtype)",
        TRITON: "tl.where({0} > 0, 1.0, {slope})",
    }

    @staticmethod
    def scalar(x: Basic, slope: Basic = TORCH_SLOPE) -> Basic:
        return sp.Piecewise((1, x > 0), (slope, True))

    def derivative(self) -> MatrixExpr:
        return product(0, sp.OneMatrix(*self.shape))


# the keywords of a generated forward whose spec drops out: training (False: no draw), rng (the generator drawn from)
TRAINING, RNG = "training", "rng"


class DropoutMask(Parametrised):
    """Z_p(A): dropout's mask, of A's shape, drawn once per call: each entry 1/(1 − p) with probability 1 − p, else
    0 (Bernoulli(1 − p) / (1 − p), inverted dropout, so that E[Z] = 𝟏𝟏ᵀ). It reads A's shape only and is a constant
    of the call: Z′ = 0, no cotangent passes into A; every use of the node in one call reads the same draws (the
    forward computes it once, the backward reads the saved value). ``sa.dropout(A, p) = A ⊙ Z_p(A)``.

    The generated forward draws it from the framework's own generator (torch's: ``torch.manual_seed`` reproduces
    a run), with ``training=False`` no draw (Z = 𝟏𝟏ᵀ, the numbers of the spec without dropout). Verification
    evaluates one fixed mask per shape (``fixed_dropout_mask``: the derivation's identities hold for every Z)."""

    function = "dropout_mask"
    exported = False  # sa.dropout(A, p) writes A ⊙ Z_p(A)
    latex, text = "Z", "Z"
    parameters = ("p",)
    # verification's fixed mask (NumPy and exact evaluation); generated code draws it (``draws``)
    calls = {NUMPY: "fixed_dropout_mask({0}, {p})", EXACT: "fixed_dropout_mask({0}, {p})"}
    # the backends whose generated code draws the mask, by their call (the others refuse it)
    draws = {backend: f"dropout_mask({{0}}, {{p}}, {TRAINING}, {RNG})" for backend in (TORCH, NUMPY, JAX)}
    flops = 2
    letter = "Z"
    example_parameters = (sp.Rational(1, 10),)

    def __new__(cls, arg: MatrixExpr, p: object) -> DropoutMask:
        arg = expression(arg)
        require_matrix(arg, "dropout")
        p = parameter(p, "dropout's p")
        if not 0 <= p < 1:
            raise SymattnError(f"dropout's p must satisfy 0 ≤ p < 1, got {p}")
        return Basic.__new__(cls, arg, p)

    @staticmethod
    def scalar(x: Basic, p: Basic = 0) -> Basic:
        """No scalar function: an entry of Z is a draw, not a function of A's entry."""
        raise SymattnError("dropout's mask Z_p has no scalar function: its entries are draws, not functions of A")

    def drawing_call(self, backend: str) -> str:
        """The call generated code draws the mask with, this node's p filled in ({0} stays the operand)."""
        return self.draws[backend].format("{0}", p=literal(self.args[1]))

    def derivative(self) -> MatrixExpr:
        return product(0, sp.OneMatrix(*self.shape))


def draws(expr: Basic) -> bool:
    """Does expr draw (hold a dropout mask)?"""
    return any(isinstance(n, DropoutMask) for n in nodes(expr))
