"""Entrywise functions f(A), one record each: the node class is the record.

A record states everything symattn knows about f, and every table (the parser, the printers,
LaTeX and text, cost, naming, the scheduling passes, the derivation's reasons) is read from it:

- ``function``: the name a spec calls it by (``sa.<function>``, the spec language); ``exported``
  says whether specs may call it (GELU′ appears in backward passes only);
- ``scalar``: f as a SymPy function of one scalar (explicit entries, exact evaluation);
- ``derivative()``: f′(A) as a matrix expression of the node and its argument, written with nodes
  that have records of their own, so that it is differentiated again (second order), printed,
  costed and checked like anything else. The VJP G ⊙ f′(A) and the JVP f′(A) ⊙ dA both read it
  (``vjp``, ``jvp``: a row-wise record writes its own); whether the VJP reads f(A) or A decides what
  the forward saves (``reads_value``, ``reads_input``);
- ``latex``, ``text``: how a derivation prints f;
- ``calls``: per backend, the call that evaluates f — a library function (``np.exp``), a helper
  of that backend's runtime (a bare name), or a template with ``{}`` for the argument;
  ``inplace``: the calls are ufuncs with ``out=`` (NumPy) and tensor methods with a ``_`` form;
- ``flops`` per entry (the cost model), ``letter`` (the name of a saved value), ``reason`` (the
  derivation step's two reasons);
- ``parameters``: the names of numbers f depends on besides A (clamp's bounds, leaky_relu's slope), held as the
  node's further SymPy arguments, so that xreplace and every rebuild (``with_arg``) keep them; ``scalar`` takes
  them after x, the calls name them (``{lo}``), ``example`` is a representative node
  (``symattn.lang.piecewise``).

Adding a function is one record here plus its export (``symattn/__init__.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol, OneMatrix
from sympy.matrices.expressions import HadamardPower

from symattn.errors import UnsupportedNodeError
from symattn.lang.algebra import hadamard_product, product, total
from symattn.lang.graph import postorder
from symattn.lang.naming.safe import expression
from symattn.lang.node_base import require_matrix, shape_of

# The backends a record gives calls for (the code generator's, and exact evaluation for verification); TRITON's
# calls are expressions of a tile inside a kernel (triton.language as tl), where a record has one.
NUMPY, TORCH, JAX, EXACT, TRITON = "numpy", "torch", "jax", "exact", "triton"

HADAMARD_MOVE = "Hadamard factor moved onto the cotangent"
CHAIN_RULE = ("chain rule, entrywise", HADAMARD_MOVE)

_INV_SQRT2 = 1 / sp.sqrt(2)
GELU_TANH_K = sp.sqrt(2 / sp.pi)  # √(2/π) of the tanh approximation
GELU_TANH_C = sp.Float("0.044715")

FUNCTIONS: dict[str, type] = {}  # function name → its record (every subclass below, in definition order)


class FunctionRecord(MatrixExpr):
    """A function node f(A) of one matrix argument, of A's shape, and what its record holds besides its structure
    (entrywise and row-wise alike)."""

    function: str = ""
    exported: bool = True
    latex: str = ""
    text: str = ""
    calls: Mapping[str, str] = {}
    inplace: bool = False
    flops: int = 1
    letter: str = "U"
    reason: tuple[str, str] = CHAIN_RULE
    parameters: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.function:
            FUNCTIONS[cls.function] = cls

    def __new__(cls, arg: MatrixExpr) -> FunctionRecord:
        arg = expression(arg)
        require_matrix(arg, cls.function)
        return Basic.__new__(cls, arg)

    @property
    def arg(self) -> MatrixExpr:
        return self.args[0]

    @property
    def shape(self) -> tuple:
        return shape_of(self.arg)

    @classmethod
    def example(cls, a: MatrixExpr) -> FunctionRecord:
        """A representative node of a (a record with parameters gives its own: the probes, the tests)."""
        return cls(a)

    def with_arg(self, a: MatrixExpr) -> FunctionRecord:
        """The same function, its parameters kept, of another argument."""
        return self.func(a, *self.args[1:])

    def scalar_of(self, x: Basic) -> Basic:
        """f(x) for a scalar x, with this node's parameters."""
        return self.scalar(x, *self.args[1:])

    def notation(self, latex: bool) -> str:
        """How a derivation prints f (its parameters too, where it has any): LaTeX or plain text."""
        return self.latex if latex else self.text

    def vjp(self, g: MatrixExpr) -> MatrixExpr:
        """The argument's cotangent Ā from the node's G (tr(Gᵀ dY) = tr(Āᵀ dA))."""
        raise NotImplementedError(f"{type(self).__name__} states no VJP")

    def jvp(self, da: MatrixExpr) -> MatrixExpr:
        """dY from dA."""
        raise NotImplementedError(f"{type(self).__name__} states no JVP")

    @classmethod
    @functools.cache
    def reads_value(cls) -> bool:
        """Does the VJP read f(A) (tanh: 𝟏𝟏ᵀ − T^∘2, softmax: P)? Then the forward saves f(A) for the backward."""
        probe = cls.example(MatrixSymbol("_probe", 2, 2))
        return probe in set(postorder(probe.vjp(MatrixSymbol("_G", *probe.shape))))

    @classmethod
    @functools.cache
    def reads_input(cls) -> bool:
        """Does the VJP read A (log: A^∘−1, softplus: σ(A))? Then the forward saves A for the backward."""
        probe = cls.example(MatrixSymbol("_probe", 2, 2))
        value = MatrixSymbol("_value", *probe.shape)  # f(A) itself read as a name: A inside it is not read
        return probe.arg in set(postorder(probe.vjp(MatrixSymbol("_G", *probe.shape)).xreplace({probe: value})))

    def call(self, backend: str) -> str:
        """The call that evaluates this function in the backend; UnsupportedNodeError naming both if it has none."""
        if backend not in self.calls:
            raise UnsupportedNodeError(self, f"the {backend} backend", [f"{self.function} in {b}" for b in self.calls])
        return self.calls[backend]


class Elementwise(FunctionRecord):
    """f(A) applied entry by entry; each subclass is the record of one f."""

    scalar = staticmethod(sp.Function("f"))
    finite = False  # is f(x) finite at every finite x (tanh, σ; not exp, log)? The Triton kernels' rule: a dS of
    # such functions times a cotangent G is 0 wherever G is (``zero_with``), so it takes no mask's where

    def _entry(self, i, j, **kwargs):
        return self.scalar_of(self.arg._entry(i, j, **kwargs))

    def derivative(self) -> MatrixExpr:
        """f′(A), entrywise, as a matrix expression."""
        raise NotImplementedError(f"{type(self).__name__} states no derivative")

    def vjp(self, g: MatrixExpr) -> MatrixExpr:
        """tr(Gᵀ d f(A)) = tr(Gᵀ (f′(A) ⊙ dA)) = tr((G ⊙ f′(A))ᵀ dA)."""
        return hadamard_product(g, self.derivative())

    def jvp(self, da: MatrixExpr) -> MatrixExpr:
        """d f(A) = f′(A) ⊙ dA."""
        return hadamard_product(self.derivative(), da)


def _ones_like(a: MatrixExpr) -> OneMatrix:
    return OneMatrix(*a.shape)


class Exp(Elementwise):
    """exp(A), entrywise; exp′ = exp."""

    function = "exp"
    scalar = staticmethod(sp.exp)
    latex, text = r"\exp", "exp"
    calls = {NUMPY: "np.exp", TORCH: "torch.exp", JAX: "jnp.exp", TRITON: "tl.exp"}
    inplace = True
    letter = "E"

    def derivative(self) -> MatrixExpr:
        return self


class Log(Elementwise):
    """log(A), entrywise; log′(x) = 1/x."""

    function = "log"
    scalar = staticmethod(sp.log)
    latex, text = r"\log", "log"
    calls = {NUMPY: "np.log", TORCH: "torch.log", JAX: "jnp.log", TRITON: "tl.log"}
    inplace = True

    def derivative(self) -> MatrixExpr:
        return HadamardPower(self.arg, -1)


class Tanh(Elementwise):
    """tanh(A), entrywise; tanh′ = 1 − tanh²."""

    function = "tanh"
    finite = True
    scalar = staticmethod(sp.tanh)
    latex, text = r"\tanh", "tanh"
    calls = {
        NUMPY: "np.tanh",
        TORCH: "torch.tanh",
        JAX: "jnp.tanh",
        TRITON: "(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)",  # core Triton has no tanh: 2σ(2x) − 1
    }
    inplace = True
    letter = "T"

    def derivative(self) -> MatrixExpr:
        return total(_ones_like(self), product(-1, HadamardPower(self, 2)))


class Sigmoid(Elementwise):
    """σ(A) = 1 / (1 + exp(−A)), entrywise; σ′ = σ (1 − σ)."""

    function = "sigmoid"
    finite = True
    scalar = staticmethod(lambda x: 1 / (1 + sp.exp(-x)))
    latex, text = r"\sigma", "σ"
    calls = {NUMPY: "sigmoid", TORCH: "torch.sigmoid", JAX: "sigmoid", TRITON: "tl.sigmoid"}
    letter = "Z"

    def derivative(self) -> MatrixExpr:
        return hadamard_product(self, total(_ones_like(self), product(-1, self)))


class Softplus(Elementwise):
    """softplus(A) = log(1 + exp(A)), entrywise (computed without overflow); softplus′ = σ."""

    function = "softplus"
    finite = True
    scalar = staticmethod(lambda x: sp.log(1 + sp.exp(x)))
    latex, text = r"\operatorname{softplus}", "softplus"
    calls = {
        NUMPY: "softplus",
        TORCH: "torch.nn.functional.softplus",
        JAX: "jax.nn.softplus",
        TRITON: "(tl.maximum({0}, 0.0) + tl.log(1.0 + tl.exp(-tl.abs({0}))))",  # max(x, 0) + log(1 + e^−|x|)
    }
    flops = 3

    def derivative(self) -> MatrixExpr:
        return Sigmoid(self.arg)


class Relu(Elementwise):
    """ReLU(A) = max(A, 0), entrywise; ReLU′ = step (0 at 0, as torch's relu has it)."""

    function = "relu"
    finite = True
    scalar = staticmethod(lambda x: sp.Piecewise((x, x > 0), (0, True)))
    latex, text = r"\operatorname{ReLU}", "ReLU"
    calls = {NUMPY: "np.maximum({0}, 0.0)", TORCH: "torch.relu", JAX: "jax.nn.relu", TRITON: "tl.maximum({0}, 0.0)"}

    def derivative(self) -> MatrixExpr:
        return Step(self.arg)


class Silu(Elementwise):
    """SiLU(A) = A ⊙ σ(A), entrywise (swish); SiLU′ = σ ⊙ (1 + A ⊙ (1 − σ))."""

    function = "silu"
    finite = True
    scalar = staticmethod(lambda x: x / (1 + sp.exp(-x)))
    latex, text = r"\operatorname{SiLU}", "SiLU"
    calls = {NUMPY: "silu", TORCH: "torch.nn.functional.silu", JAX: "jax.nn.silu", TRITON: "({0} * tl.sigmoid({0}))"}
    flops = 2

    def derivative(self) -> MatrixExpr:
        sigma = Sigmoid(self.arg)
        ones = _ones_like(self)
        return hadamard_product(sigma, total(ones, hadamard_product(self.arg, total(ones, product(-1, sigma)))))


class Step(Elementwise):
    """step(A) = 1 where A > 0, else 0 (NaN too, as torch's A > 0), entrywise: ReLU′ in backward passes, and a
    comparison of traced values, [a < b] = step(b − a) (``trace.forms.masks``); step′ = 0 (almost everywhere)."""

    function = "step"
    finite = True
    exported = False
    scalar = staticmethod(lambda x: sp.Piecewise((1, x > 0), (0, True)))
    latex, text = r"\operatorname{step}", "step"
    calls = {
        NUMPY: "np.where({0} > 0, np.ones_like({0}), 0.0)",  # (NaN: 0, as torch; np.heaviside gives NaN)
        TORCH: "torch.where({0} > 0, torch.ones_like({0}), 0.0)",
        JAX: "jnp.where({0} > 0, jnp.ones_like({0}), 0.0)",
        TRITON: "tl.where({0} > 0, 1.0, 0.0)",
    }

    def derivative(self) -> MatrixExpr:
        return product(0, _ones_like(self))


class Keep(Elementwise):
    """keep(A) = 0 where A > 0, −∞ elsewhere, entrywise: the additive mask that keeps the entries where A > 0 (A a
    0/1 matrix of kept entries computed per call from the inputs: masked_fill(cond, −inf) of a traced cond adds
    keep(𝟏𝟏ᵀ − [cond])); keep′ = 0, a mask's derivative (autograd's through a comparison)."""

    function = "keep_mask"
    exported = False
    scalar = staticmethod(lambda x: sp.Piecewise((0, x > 0), (-sp.oo, True)))
    latex, text = r"\operatorname{keep}", "keep"
    masks = True  # some entry may be −∞: a row softmax of it takes the masked form (rows of −∞ give zeros)
    calls = {
        NUMPY: "np.where({0} > 0, np.zeros_like({0}), -np.inf)",
        TORCH: "torch.zeros_like({0}).masked_fill(~({0} > 0), -torch.inf)",
        JAX: "jnp.where({0} > 0, jnp.zeros_like({0}), -jnp.inf)",
    }  # (no Triton call: the kernels take −∞ from masks of their own; a spec with keep runs in torch)

    def derivative(self) -> MatrixExpr:
        return product(0, _ones_like(self))


class sg(sp.Function):
    """The stop-gradient of a scalar: x's value, derivative 0 (a trainable scalar's, or a 0-d traced value's)."""

    _imp_ = staticmethod(lambda x: x)  # lambdify (mpmath, NumPy): the value itself

    @classmethod
    def eval(cls, x):
        if x.is_Number:
            return x
        return None

    def fdiff(self, argindex: int = 1) -> Basic:
        return sp.S.Zero


class StopGradient(Elementwise):
    """sg(A) = A, entrywise, differentiated as a constant: sg′ = 0 (torch's detach() and values computed under
    torch.no_grad(), JAX's lax.stop_gradient)."""

    function = "stop_gradient"
    finite = True
    scalar = staticmethod(sg)
    latex, text = r"\operatorname{sg}", "sg"
    calls = {NUMPY: "{}", TORCH: "({}).detach()", JAX: "jax.lax.stop_gradient", TRITON: "{0}"}
    flops = 0
    letter = "C"

    def derivative(self) -> MatrixExpr:
        return product(0, _ones_like(self))


class Gelu(Elementwise):
    """GELU(x) = x Φ(x) = x (1 + erf(x/√2)) / 2, entrywise (the exact, erf form); GELU′ is ``GeluGrad``."""

    function = "gelu"
    finite = True
    exported = False  # sa.gelu(a, approximate=…) chooses between the two forms
    scalar = staticmethod(lambda x: x * (1 + sp.erf(x * _INV_SQRT2)) / 2)
    latex, text = r"\operatorname{GELU}", "GELU"
    calls = {NUMPY: "gelu", TORCH: "gelu", JAX: "gelu"}

    def derivative(self) -> MatrixExpr:
        return GeluGrad(self.arg)


class GeluTanh(Elementwise):
    """GELU's tanh approximation: x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""

    function = "gelu_tanh"
    finite = True
    exported = False
    scalar = staticmethod(lambda x: x * (1 + sp.tanh(GELU_TANH_K * (x + GELU_TANH_C * x**3))) / 2)
    latex, text = r"\operatorname{GELU}_{\tanh}", "GELU_tanh"
    calls = {NUMPY: "gelu_tanh", TORCH: "gelu_tanh", JAX: "gelu_tanh"}

    def derivative(self) -> MatrixExpr:
        return GeluTanhGrad(self.arg)


class GeluGrad(Elementwise):
    """GELU′(x) = Φ(x) + x φ(x) = (1 + erf(x/√2)) / 2 + x exp(−x²/2) / √(2π), entrywise (backward passes)."""

    function = "gelu_grad"
    finite = True
    exported = False
    scalar = staticmethod(lambda x: (1 + sp.erf(x * _INV_SQRT2)) / 2 + x * sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi))
    latex, text = r"\operatorname{GELU}'", "GELU′"
    calls = {NUMPY: "gelu_grad", TORCH: "gelu_grad", JAX: "gelu_grad"}

    def derivative(self) -> MatrixExpr:
        """GELU″(A) = φ(A) ⊙ (2·𝟏𝟏ᵀ − A^{∘2}), φ(x) = exp(−x²/2)/√(2π) (the derivative of Φ + xφ)."""
        square = HadamardPower(self.arg, 2)
        density = product(1 / sp.sqrt(2 * sp.pi), Exp(product(sp.Rational(-1, 2), square)))
        return hadamard_product(density, total(product(2, _ones_like(self)), product(-1, square)))


def _gelu_tanh_grad(x):
    t = sp.tanh(GELU_TANH_K * (x + GELU_TANH_C * x**3))
    return (1 + t) / 2 + x * (1 - t**2) * GELU_TANH_K * (1 + 3 * GELU_TANH_C * x**2) / 2


class GeluTanhGrad(Elementwise):
    """The derivative of GELU's tanh approximation, entrywise: with t = tanh(k (x + c x³)), k = √(2/π),
    c = 0.044715: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2 (backward passes)."""

    function = "gelu_tanh_grad"
    finite = True
    exported = False
    scalar = staticmethod(_gelu_tanh_grad)
    latex, text = r"\operatorname{GELU}_{\tanh}'", "GELU_tanh′"
    calls = {NUMPY: "gelu_tanh_grad", TORCH: "gelu_tanh_grad", JAX: "gelu_tanh_grad"}

    def derivative(self) -> MatrixExpr:
        """With t = tanh(k (x + c x³)), s = 1 − t², w = k (1 + 3 c x²) (so t′ = s w, w′ = 6 k c x):
        GELU_tanh″(x) = s w/2 + (s w + x (−2 t s w) w + x s 6 k c x)/2 = s ⊙ (w − x t w² + 3 k c x²)."""
        a = self.arg
        ones = _ones_like(a)
        square = HadamardPower(a, 2)
        t = Tanh(product(GELU_TANH_K, total(a, product(GELU_TANH_C, HadamardPower(a, 3)))))
        s = total(ones, product(-1, HadamardPower(t, 2)))
        w = product(GELU_TANH_K, total(ones, product(3 * GELU_TANH_C, square)))
        bend = product(3 * GELU_TANH_K * GELU_TANH_C, square)
        inner = total(w, product(-1, hadamard_product(a, t, HadamardPower(w, 2))), bend)
        return hadamard_product(s, inner)
