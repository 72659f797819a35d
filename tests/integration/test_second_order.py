"""Second order through the generated modules: torch double backward (gradgradcheck, float64) and the NumPy
Hessian-vector product against central finite differences of the closed-form backward."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from symattn.specs import family

torch = pytest.importorskip("torch")

# spec -> (builder of float64 inputs from a generator, keyword options)
SIZES = {"n": 3, "m": 4, "d": 4}


def _inputs(spec: str, rng: np.random.Generator) -> tuple[dict, dict]:
    """Small random inputs of each built-in spec (batch 2) and its keywords."""
    n, m, d = SIZES["n"], SIZES["m"], SIZES["d"]
    r = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    if spec == "attention":
        return {"Q": r(2, n, d), "K": r(2, m, d), "V": r(2, m, 3)}, {}
    if spec == "self_attention":
        return {"X": r(2, n, d), "W_Q": r(d, 3), "W_K": r(d, 3), "W_V": r(d, 2)}, {}
    if spec == "mha":
        names = ("W_Q", "W_K", "W_V", "W_O")
        return {"Q": r(2, n, d), "K": r(2, m, d), "V": r(2, m, d), **{w: r(d, d) / 2 for w in names}}, {"num_heads": 2}
    if spec == "transformer_block":  # LayerNorm (rstd) and GELU′ are differentiated again
        weights = {w: r(d, d) / 2 for w in ("W_Q", "W_K", "W_V", "W_O")}
        norms = {"gamma_1": 1 + r(1, d) / 4, "beta_1": r(1, d), "gamma_2": 1 + r(1, d) / 4, "beta_2": r(1, d)}
        return {"X": r(2, n, d), **weights, **norms, "W_1": r(d, 3), "W_2": r(3, d) / 2}, {"num_heads": 2}
    raise KeyError(spec)


def _differences(module, values: dict, grad_out, direction: dict, options: dict | None = None) -> dict:
    """H v by central differences, (∇f(x + h v) − ∇f(x − h v)) / 2h for f = tr(grad_outᵀ Y), h = 1e-5, each
    gradient from the module's closed-form backward (the inputs passed by name)."""
    h, options = 1e-5, options or {}

    def gradients(sign):
        shifted = {k: v + sign * h * direction[k] for k, v in values.items()}
        return module.backward(module.forward(**shifted, **options)[1], grad_out)

    plus, minus = gradients(1), gradients(-1)
    return {k: (plus[k] - minus[k]) / (2 * h) for k in values}


CASES = ["attention", "self_attention", "mha", "transformer_block"]
VARIANTS = ["", "_memeff"]
MODULES = [(spec, v) for spec in CASES for v in VARIANTS if not v or family(spec).row_blocks]  # memeff: row blocks


@pytest.mark.parametrize(("spec", "variant"), MODULES)
def test_gradgradcheck(spec, variant):
    """d/dx <V, ∂f/∂x> of the generated torch Function matches finite differences (torch.autograd.gradgradcheck)."""
    module = importlib.import_module(f"symattn.generated.{spec}_torch{variant}")
    arrays, options = _inputs(spec, np.random.default_rng(0))
    names = list(arrays)
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays.values()]

    def f(*xs):
        return module.forward(**dict(zip(names, xs)), **options)

    assert torch.autograd.gradgradcheck(f, tensors)


@pytest.mark.parametrize("spec", ["attention", "mha"])
@pytest.mark.parametrize("mask", ["causal", "bool", "float", "padding"])
def test_gradgradcheck_masks(spec, mask):
    """Masks (bool, a float one that takes no gradient, key padding, causal) and biases keep second order right."""
    module = importlib.import_module(f"symattn.generated.{spec}_torch")
    rng = np.random.default_rng(1)
    arrays, options = _inputs(spec, rng)
    n, m = SIZES["n"], SIZES["m"]
    keywords = {
        "causal": {"causal": True},
        "bool": {"attn_mask": torch.tensor(rng.random((n, m)) < 0.3)},
        "float": {"attn_mask": torch.tensor(rng.standard_normal((n, m)))},
        "padding": {"key_padding_mask": torch.tensor([[False, True, False, False], [False, False, False, True]])},
    }[mask]
    if spec == "mha":
        d = SIZES["d"]
        arrays |= {"b_Q": rng.standard_normal((1, d)), "b_O": rng.standard_normal((1, d))}
    names = list(arrays)
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays.values()]

    def f(*xs):
        return module.forward(**dict(zip(names, xs)), **options, **keywords)

    assert torch.autograd.gradgradcheck(f, tensors)


def test_float_mask_gradient_differentiated_again_raises():
    """The gradient of a float attn_mask has no second closed form: differentiating it raises, never a silent 0."""
    from symattn.generated import attention_torch

    rng = np.random.default_rng(2)
    arrays, _ = _inputs("attention", rng)
    q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays.values())
    mask = torch.tensor(rng.standard_normal((SIZES["n"], SIZES["m"])), requires_grad=True)
    out = attention_torch.forward(q, k, v, attn_mask=mask)
    (g_mask,) = torch.autograd.grad(out.sum(), [mask], create_graph=True)
    with pytest.raises(RuntimeError, match="attn_mask cannot be differentiated again"):
        torch.autograd.grad(g_mask.pow(2).sum(), [q])


def test_third_order_raises():
    """The closed forms go to the second order: a third derivative raises clearly."""
    from symattn.generated import attention_torch

    arrays, _ = _inputs("attention", np.random.default_rng(3))
    q, k, v = (torch.tensor(a, requires_grad=True) for a in arrays.values())
    out = attention_torch.forward(q, k, v)
    (gq,) = torch.autograd.grad(out.pow(2).sum(), [q], create_graph=True)
    (hq,) = torch.autograd.grad(gq.pow(2).sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError, match="third derivative is not supported"):
        torch.autograd.grad(hq.sum(), [q])


@pytest.mark.parametrize(("spec", "variant"), MODULES)
def test_numpy_hvp_matches_finite_differences(spec, variant):
    """H v = (∇f(x + h v) − ∇f(x − h v)) / 2h for f = tr(Gᵀ Y), the gradients from the closed-form backward."""
    module = importlib.import_module(f"symattn.generated.{spec}_numpy{variant}")
    rng = np.random.default_rng(4)
    arrays, options = _inputs(spec, rng)
    out, _ = module.forward(**arrays, **options)
    grad_out = rng.standard_normal(out.shape)
    direction = {name: rng.standard_normal(a.shape) for name, a in arrays.items()}
    hv = module.hvp(**arrays, grad_out=grad_out, direction=direction, **options)
    differences = _differences(module, arrays, grad_out, direction, options)
    for name in arrays:
        expected = differences[name]
        error = np.abs(hv[name] - expected).max() / max(1.0, np.abs(expected).max())
        assert error < 1e-7, (name, error)
    assert set(hv) == set(arrays)


def test_numpy_hvp_rejects_an_unknown_direction():
    from symattn.generated import attention_numpy

    arrays, _ = _inputs("attention", np.random.default_rng(5))
    out, _ = attention_numpy.forward(**arrays)
    with pytest.raises(ValueError, match="'X' is no input"):
        attention_numpy.hvp(**arrays, grad_out=np.ones_like(out), direction={"X": arrays["Q"]})


GALLERY_NAMES = [
    "sigmoid_attention",
    "bias_attention",
    "softcap_attention",
    "gated_attention",
    "differential_attention",
    "linear_attention",
    "cosine_attention",
    "qk_norm_attention",
    "temperature_attention",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", GALLERY_NAMES)
def test_gallery_gradgradcheck(name):
    """Every gallery spec (examples/specs, rendered as --spec-file renders it) is right under double backward,
    trainable scalars (τ, λ) included, and its NumPy hvp matches finite differences of its backward."""
    from test_gallery import REFERENCES, gallery_spec, module

    spec = gallery_spec(name)
    shapes, _ = REFERENCES[name]
    rng = np.random.default_rng(6)
    values = {k: np.asarray(rng.standard_normal(s) * 0.5) for k, s in shapes.items()}  # a scalar (τ, λ): 0-d
    tensors = [torch.tensor(v, requires_grad=True) for v in values.values()]
    made = module(spec, "torch")
    assert torch.autograd.gradgradcheck(lambda *xs: made.forward(*xs), tensors)
    numpy_module = module(spec, "numpy")
    out, _ = numpy_module.forward(*values.values())
    grad_out = rng.standard_normal(out.shape)
    direction = {k: rng.standard_normal(v.shape) for k, v in values.items()}
    hv = numpy_module.hvp(*values.values(), grad_out, direction)
    differences = _differences(numpy_module, values, grad_out, direction)
    for k in values:
        expected = differences[k]
        assert np.abs(hv[k] - expected).max() / max(1.0, np.abs(expected).max()) < 1e-7, k


@pytest.mark.parametrize("named", [(), ("P",)], ids=["unnamed", "P named"])
def test_a_spec_with_nothing_named_is_right_under_double_backward(named):
    """softmax(X Xᵀ) X: X is query, key and value at once; unnamed, the second closed form broadcasts a
    difference that the in-place pass writes as sub_ (printed once, else it is subtracted twice)."""
    import types

    import sympy as sp

    import symattn as sa
    from symattn.codegen import generate as codegen
    from symattn.specs import dim

    x = sp.MatrixSymbol("X", dim("n"), dim("d"))
    p = sa.softmax(x * x.T)
    spec = sa.Spec("xx_attention", "softmax(X Xᵀ) X", (x,), p * x, tuple((k, p) for k in named))
    made = {}
    for backend in ("torch", "numpy"):
        made[backend] = types.ModuleType(f"xx_{backend}")
        exec(compile(codegen.render(spec, backend), backend, "exec"), made[backend].__dict__)
    rng = np.random.default_rng(3)
    value = rng.standard_normal((2, 4, 3))
    assert torch.autograd.gradgradcheck(made["torch"].forward, (torch.tensor(value, requires_grad=True),))
    numpy_module = made["numpy"]
    grad_out, direction = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 3))
    hv = numpy_module.hvp(value, grad_out, {"X": direction})["X"]
    h = 1e-5
    plus, minus = (
        numpy_module.backward(numpy_module.forward(value + s * h * direction)[1], grad_out)["X"] for s in (1, -1)
    )
    assert np.abs(hv - (plus - minus) / (2 * h)).max() < 1e-7


def test_gelu_tanh_block_is_right_under_double_backward():
    """The tanh-approximated GELU's derivative is differentiated again (GELU_tanh″ from Tanh and powers): the
    block with approximate="tanh" passes gradgradcheck, and its NumPy hvp matches finite differences."""
    import types

    from symattn.codegen import generate as codegen
    from symattn.specs.block import transformer_block

    spec = transformer_block(num_heads=2, approximate="tanh")
    made = {}
    for backend in ("numpy", "torch"):
        made[backend] = types.ModuleType(f"gelu_tanh_block_{backend}")
        exec(compile(codegen.render(spec, backend), made[backend].__name__, "exec"), made[backend].__dict__)
    rng = np.random.default_rng(9)
    arrays, _ = _inputs("transformer_block", rng)
    d = SIZES["d"]
    arrays |= {f"b_{w}": rng.standard_normal((1, d)) for w in ("Q", "K", "V", "O", "2")} | {
        "b_1": rng.standard_normal((1, 3))
    }
    options = {}  # two heads, bound in the spec; the biases are inputs like any other
    names = list(arrays)
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays.values()]
    assert torch.autograd.gradgradcheck(lambda *xs: made["torch"].forward(**dict(zip(names, xs)), **options), tensors)
    numpy_module = made["numpy"]
    out, _ = numpy_module.forward(**arrays, **options)
    grad_out = rng.standard_normal(out.shape)
    direction = {k: rng.standard_normal(a.shape) for k, a in arrays.items()}
    hv = numpy_module.hvp(**arrays, grad_out=grad_out, direction=direction, **options)
    differences = _differences(numpy_module, arrays, grad_out, direction, options)
    for k in arrays:
        expected = differences[k]
        assert np.abs(hv[k] - expected).max() / max(1.0, np.abs(expected).max()) < 1e-7, k


@pytest.mark.parametrize(("name", "scalar"), [("temperature_attention", "tau"), ("differential_attention", "lam")])
def test_a_trainable_scalar_at_zero_gives_a_finite_hessian(name, scalar):
    """τ = 0 and λ = 0 are legal values: the second closed form never divides by a trainable scalar (the
    sharing of G_τ = 𝟏ᵀ(Xᵀ G_Aᵀ Q ⊙ W_K)𝟏 with dW_K = τ Xᵀ G_Aᵀ Q once read 1/τ · dW_K), so the
    Hessian-vector product there is finite and matches finite differences."""
    from test_gallery import REFERENCES, gallery_spec, module

    spec = gallery_spec(name)
    shapes, _ = REFERENCES[name]
    rng = np.random.default_rng(10)
    values = {k: np.asarray(rng.standard_normal(s) * 0.5) for k, s in shapes.items()} | {scalar: np.asarray(0.0)}
    numpy_module = module(spec, "numpy")
    out, _ = numpy_module.forward(*values.values())
    grad_out = rng.standard_normal(out.shape)
    direction = {k: rng.standard_normal(v.shape) for k, v in values.items()}
    hv = numpy_module.hvp(*values.values(), grad_out, direction)
    differences = _differences(numpy_module, values, grad_out, direction)
    for k in values:
        expected = differences[k]
        assert np.isfinite(hv[k]).all() and np.abs(hv[k] - expected).max() <= 1e-7 * max(1.0, np.abs(expected).max()), k
