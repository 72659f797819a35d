"""Generated forward takes the spec's inputs, then its constants, positionally in Spec order, whatever their names
(CONTRACT.md, "Generated backends"): an input named b_… and a constant added before a softmax (the additive mask)
are positional like the rest, the mask keywords and names still work beside them, and a (1, k) parameter is taken
1-D as torch holds a bias, its gradient coming back 1-D."""

from __future__ import annotations

import inspect
import math
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")

N, M, D, D_K, D_V, BATCH = 5, 6, 4, 3, 2, (2,)
INPUTS = ("X", "Y", "W_Q", "b_Q", "W_K", "W_V")  # b_Q between two weights
CONSTANTS = ("M", "P")  # the additive mask first, then a fixed table


def masked_spec() -> sa.Spec:
    """softmax((X W_Q + 𝟏 b_Q)(Y W_K)ᵀ/√d_k + M) (Y + P) W_V: M the additive mask, P a positional table."""
    n, m, d, d_k, d_v = dim("n"), dim("m"), dim("d"), dim("d_k"), dim("d_v")
    x, y, p = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("Y", m, d), sp.MatrixSymbol("P", m, d)
    w_q, w_k = sp.MatrixSymbol("W_Q", d, d_k), sp.MatrixSymbol("W_K", d, d_k)
    w_v, b_q = sp.MatrixSymbol("W_V", d, d_v), sp.MatrixSymbol("b_Q", 1, d_k)
    mask = sp.MatrixSymbol("M", n, m)
    q = x * w_q + sp.OneMatrix(n, 1) * b_q
    out = sa.softmax(q * (y * w_k).T / sp.sqrt(d_k) + mask) * (y + p) * w_v
    inputs = (x, y, w_q, b_q, w_k, w_v)
    return sa.Spec("positional_masked", "softmax(Q Kᵀ/√d_k + M) (Y + P) W_V", inputs, out, constants=(mask, p))


_MODULES: dict[tuple[str, str], types.ModuleType] = {}


def load(backend: str, variant: str = "standard") -> types.ModuleType:
    """The spec's generated module (first order), rendered once per backend and variant."""
    if (backend, variant) not in _MODULES:
        source = codegen.render(masked_spec(), backend, variant, second_order=False)
        module = types.ModuleType(f"positional_masked_{backend}_{variant}")
        exec(compile(source, module.__name__, "exec"), module.__dict__)
        _MODULES[backend, variant] = module
    return _MODULES[backend, variant]


def reference(X, Y, W_Q, b_Q, W_K, W_V, M, P):
    """The same forward written directly in torch (M additive: 0 or -inf)."""
    scores = (X @ W_Q + b_Q) @ (Y @ W_K).mT / math.sqrt(W_Q.shape[-1]) + M
    return torch.softmax(scores, dim=-1) @ (Y + P) @ W_V


def values(bias_shape: tuple[int, ...] = (1, D_K)) -> tuple[dict, np.ndarray, np.ndarray]:
    """Inputs and P by name (float64), the bool mask (True = not allowed; each row keeps a key), a cotangent."""
    rng = np.random.default_rng(7)
    shapes = {"X": (*BATCH, N, D), "Y": (*BATCH, M, D), "W_Q": (D, D_K), "b_Q": bias_shape, "W_K": (D, D_K)}
    shapes |= {"W_V": (D, D_V), "P": (M, D)}
    arrays = {name: rng.standard_normal(shape) for name, shape in shapes.items()}
    blocked = rng.random((N, M)) < 0.4
    blocked[np.arange(N), np.arange(N)] = False
    return arrays, blocked, rng.standard_normal((*BATCH, N, D_V))


def expected(arrays: dict, blocked: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Output and input gradients by torch autograd of ``reference`` (bias in the shape given)."""
    leaves = {name: torch.tensor(arrays[name], requires_grad=True) for name in INPUTS}
    additive = torch.zeros(N, M, dtype=torch.float64).masked_fill(torch.tensor(blocked), float("-inf"))
    out = reference(*leaves.values(), additive, torch.tensor(arrays["P"]))
    grads = torch.autograd.grad(out, list(leaves.values()), torch.tensor(g))
    return out.detach().numpy(), {name: grad.numpy() for name, grad in zip(leaves, grads)}


def run(backend: str, module: types.ModuleType, positional: list, keywords: dict, g: np.ndarray):
    """(output, gradients of the inputs by name) of module.forward called with these arguments, in NumPy."""
    if backend == "numpy":
        out, saved = module.forward(*positional, **keywords)
        return out, module.backward(saved, g)
    if backend == "torch":
        leaves = [torch.tensor(a, requires_grad=True) if i < len(INPUTS) else a for i, a in enumerate(positional)]
        leaves = [torch.tensor(a) if isinstance(a, np.ndarray) else a for a in leaves]
        out = module.forward(*leaves, **{k: torch.tensor(v) for k, v in keywords.items()})
        grads = torch.autograd.grad(out, leaves[: len(INPUTS)], torch.tensor(g))
        return out.detach().numpy(), {name: grad.numpy() for name, grad in zip(INPUTS, grads)}
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    rest = [None if a is None else jnp.asarray(a) for a in positional[len(INPUTS) :]]
    kw = {k: jnp.asarray(v) for k, v in keywords.items()}
    primals = [jnp.asarray(a) for a in positional[: len(INPUTS)]]
    out, vjp = jax.vjp(lambda *xs: module.forward(*xs, *rest, **kw), *primals)
    return np.asarray(out), {name: np.asarray(grad) for name, grad in zip(INPUTS, vjp(jnp.asarray(g)))}


def close(got, want, what: str) -> None:
    assert np.shape(got) == np.shape(want), f"{what}: shape {np.shape(got)}, expected {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=what)


CASES = [("numpy", "standard"), ("numpy", "memeff"), ("torch", "standard"), ("torch", "memeff"), ("jax", "standard")]


@pytest.mark.parametrize("backend, variant", CASES, ids=["-".join(c) for c in CASES])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_forward_takes_inputs_then_constants_in_spec_order(backend, variant, mask_kind):
    """forward(*inputs, *constants): b_Q in its place among the inputs, the mask M before the table P (a bool,
    True = not allowed, or its additive 0/-inf matrix), matching torch autograd of an independent forward."""
    arrays, blocked, g = values()
    mask = blocked if mask_kind == "bool" else np.where(blocked, -np.inf, 0.0)
    module = load(backend, variant)
    out, grads = run(backend, module, [*(arrays[n] for n in INPUTS), mask, arrays["P"]], {}, g)
    want_out, want = expected(arrays, blocked, g)
    close(out, want_out, "output")
    assert set(grads) == set(INPUTS), sorted(grads)  # a constant gets no gradient, given in its position
    for name in INPUTS:
        close(grads[name], want[name], f"∂f/∂{name}")


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_the_positional_rule_keeps_the_keyword_spellings(backend):
    """Every argument by name, and the mask as attn_mask instead of in its position, give the same; the mask
    both ways is a TypeError naming both spellings, a mask of the wrong shape a ValueError naming M."""
    arrays, blocked, g = values()
    module = load(backend)
    params = list(inspect.signature(module.forward).parameters)
    assert params[: len(INPUTS) + len(CONSTANTS)] == [*INPUTS, *CONSTANTS]
    want_out, want = expected(arrays, blocked, g)
    out, grads = run(backend, module, [*(arrays[n] for n in INPUTS), None, arrays["P"]], {"attn_mask": blocked}, g)
    close(out, want_out, "output, attn_mask by keyword")
    for name in INPUTS:
        close(grads[name], want[name], f"∂f/∂{name}, attn_mask by keyword")
    library = {"numpy": np.asarray, "torch": torch.tensor}.get(backend) or pytest.importorskip("jax").numpy.asarray
    by_name = {name: library(arrays[name]) for name in (*INPUTS, "P")}
    with pytest.raises(TypeError, match=r"M both in its position and as attn_mask"):
        module.forward(**by_name, M=library(blocked), attn_mask=library(blocked))
    with pytest.raises(ValueError, match=rf"M: expected shape \(n, m\) = \({N}, {M}\) .*, got \({M}, {N}\)"):
        module.forward(**by_name, M=library(blocked.T))


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_a_bias_given_1d_is_taken_as_its_row_and_its_gradient_comes_back_1d(backend):
    """b_Q as torch holds a bias, (d_k,): the same output as the 1 × d_k row, its gradient of shape (d_k,)."""
    arrays, blocked, g = values(bias_shape=(D_K,))
    module = load(backend)
    out, grads = run(backend, module, [*(arrays[n] for n in INPUTS), blocked, arrays["P"]], {}, g)
    want_out, want = expected(arrays, blocked, g)
    close(out, want_out, "output")
    assert np.shape(grads["b_Q"]) == (D_K,)
    for name in INPUTS:
        close(grads[name], want[name], f"∂f/∂{name}")


def test_the_torch_module_forward_takes_its_inputs_and_constants_in_spec_order():
    """The nn.Module holds the weights; its forward takes the rest, X, Y, M, P, in Spec order."""
    module = load("torch")
    cls = module.PositionalMasked
    sizes = {"d": D, "d_k": D_K, "d_v": D_V}
    layer = cls(**{k: sizes[k] for k in inspect.signature(cls.__init__).parameters if k in sizes}, dtype=torch.float64)
    assert list(inspect.signature(layer.forward).parameters)[:4] == ["X", "Y", "M", "P"]
    arrays, blocked, _ = values()
    x, y, p = (torch.tensor(arrays[name]) for name in ("X", "Y", "P"))
    m = torch.tensor(blocked)
    got = layer(x, y, m, p)
    want = module.forward(x, y, layer.W_Q, layer.b_Q, layer.W_K, layer.W_V, m, p)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
