"""Attention through the piecewise-linear records with parameters: softmax of clamped scores, LeakyReLU of the
scores and ReLU(S)^∘2, each summed over the keys / n. Each derives with every step verified and prints its
parameters; the generated NumPy, torch and JAX modules (float64) and the Triton kernels (float32) match torch
autograd of the same forward, and so do the scores' kinks: scores put exactly at the clamp's bounds and at 0
take torch's derivative there."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch", reason="torch autograd is the reference")
F = torch.nn.functional

B, N, D_MODEL, D_K, D_V = 2, 5, 6, 4, 3
n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K, W_V = (sa.matrix(name, d_model, d) for name, d in (("W_Q", d_k), ("W_K", d_k), ("W_V", d_v)))
SCORES = (X * W_Q) * (X * W_K).T / sp.sqrt(d_k)

# name → (output, torch's weights of the scaled scores a, summed over the keys (True) or a softmax's (False), words)
FORMS = {
    "clamped_softmax": (sa.softmax(sa.clamp(SCORES, -1, 1)), lambda a: torch.softmax(torch.clamp(a, -1, 1), -1)),
    "clamped_min": (sa.clamp(SCORES, 0) / n, lambda a: torch.clamp_min(a, 0) / a.shape[-1]),
    "hardtanh": (sa.hardtanh(SCORES, -0.5, 0.5) / n, lambda a: F.hardtanh(a, -0.5, 0.5) / a.shape[-1]),
    "leaky": (sa.leaky_relu(SCORES, 0.1) / n, lambda a: F.leaky_relu(a, 0.1) / a.shape[-1]),
    "relu_squared": (sa.hadamard(sa.relu(SCORES), sa.relu(SCORES)) / n, lambda a: F.relu(a) ** 2 / a.shape[-1]),
}
WORDS = {
    "clamped_softmax": ("clamp_[-1, 1](", r"\operatorname{clamp}_{[-1, 1]}"),
    "clamped_min": ("clamp_[0, ∞)(", r"\operatorname{clamp}_{[0, \infty)}"),
    "hardtanh": ("hardtanh_[-0.5, 0.5](", r"\operatorname{hardtanh}_{[-0.5, 0.5]}"),
    "leaky": ("LeakyReLU_0.1(", r"\operatorname{LeakyReLU}_{0.1}"),
    "relu_squared": ("ReLU(", r"\operatorname{ReLU}"),
}
SHAPES = {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)}


def _spec(name: str) -> sa.Spec:
    weights, _ = FORMS[name]
    return sa.Spec(name=name, summary=f"{name} attention", inputs=(X, W_Q, W_K, W_V), output=weights * (X * W_V))


SPECS = {name: _spec(name) for name in FORMS}


def _reference(name, x, w_q, w_k, w_v):
    a = (x @ w_q) @ (x @ w_k).mT / math.sqrt(D_K)
    return FORMS[name][1](a) @ (x @ w_v)


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(shape) * (1.5 if k == "X" else 0.7) for k, shape in SHAPES.items()}


def _want(name: str, values: dict, g: np.ndarray) -> tuple[np.ndarray, dict]:
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    out = _reference(name, *leaves.values())
    grads = torch.autograd.grad(out, list(leaves.values()), torch.tensor(g))
    return out.detach().numpy(), {k: t.numpy() for k, t in zip(leaves, grads, strict=True)}


def _module(spec: sa.Spec, backend: str) -> types.ModuleType:
    made = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(codegen.render(spec, backend), made.__name__, "exec"), made.__dict__)
    return made


def _run(made, backend: str, values: dict, g: np.ndarray) -> tuple[np.ndarray, dict]:
    if backend == "numpy":
        out, saved = made.forward(*values.values())
        return out, made.backward(saved, g)
    if backend == "torch":
        leaves = [torch.tensor(v, requires_grad=True) for v in values.values()]
        result = made.forward(*leaves)
        found = torch.autograd.grad(result, leaves, torch.tensor(g))
        return result.detach().numpy(), {k: t.numpy() for k, t in zip(values, found, strict=True)}
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    out, vjp = jax.vjp(made.forward, *values.values())
    return out, dict(zip(values, vjp(g), strict=True))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_derivation_verifies_and_prints_the_parameters(name):
    derivation = sa.derive(SPECS[name])
    assert derivation.verify().ok
    text, latex = WORDS[name]
    assert text in derivation.text() and latex in derivation.latex()


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_generated_modules_match_autograd(name, backend):
    values = _inputs()
    g = np.random.default_rng(1).standard_normal((B, N, D_V))
    want_out, want = _want(name, values, g)
    out, grads = _run(_module(SPECS[name], backend), backend, values, g)
    assert np.max(np.abs(np.asarray(out) - want_out)) < 1e-10
    for k in values:
        assert np.max(np.abs(np.asarray(grads[k]) - want[k])) < 1e-10, k


def _at_the_kinks(name: str) -> dict[str, np.ndarray]:
    """Inputs whose scaled scores hit the kinks exactly: X W_Q (X W_K)ᵀ/√d_k = X Xᵀ/2 with W_Q = W_K = [I; 0]
    (d_k = 4), X's rows chosen so that entries are exactly −1, −½, 0, ½ and 1."""
    values = _inputs(3)
    x = np.zeros((B, N, D_MODEL))
    x[..., 0] = [[1.0, -1.0, 0.0, 2.0, 0.5], [0.5, 1.0, -2.0, 0.0, -1.0]]
    x[..., 1] = [[0.0, 1.0, 1.0, 0.0, -0.5], [1.0, 0.0, 0.0, -1.0, 1.0]]
    eye = np.zeros((D_MODEL, D_K))
    eye[:D_K, :D_K] = np.eye(D_K)
    return values | {"X": x, "W_Q": eye, "W_K": eye.copy()}


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_scores_exactly_at_the_kinks_take_torchs_derivative(name, backend):
    values = _at_the_kinks(name)
    a = values["X"] @ values["X"].swapaxes(-1, -2) / 2
    assert {-1.0, -0.5, 0.0, 0.5, 1.0} <= set(a.ravel().tolist())
    g = np.random.default_rng(4).standard_normal((B, N, D_V))
    want_out, want = _want(name, values, g)
    out, grads = _run(_module(SPECS[name], backend), backend, values, g)
    assert np.max(np.abs(np.asarray(out) - want_out)) < 1e-12
    for k in values:
        assert np.max(np.abs(np.asarray(grads[k]) - want[k])) < 1e-12, k


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_triton_kernels_match_autograd(name, tmp_path):
    from triton_rendered import triton_module

    made = triton_module(SPECS[name], tmp_path)
    values = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in _inputs(2).items()}
    out = made.forward(*values.values())
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    found = torch.autograd.grad(out, list(values.values()), g)
    want_out, want = _want(name, {k: v.detach().double().numpy() for k, v in values.items()}, g.double().numpy())
    assert _relative(out.detach().numpy(), want_out) < 1e-5
    for (k, _), t in zip(values.items(), found, strict=True):
        assert _relative(t.numpy(), want[k]) < 1e-5, k


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest error relative to the largest entry (float32: ReLU(S)^∘2's entries reach hundreds)."""
    return float(np.max(np.abs(got - want)) / max(1.0, np.max(np.abs(want))))
