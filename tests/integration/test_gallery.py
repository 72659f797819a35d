"""The gallery of user specs (examples/specs/): each derivation verifies, and each generated module
(NumPy and torch, float64 and float32) matches torch autograd of an independently written torch forward,
keeps the inputs' dtype in its output and every gradient, and generates whichever intermediates are named.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from pathlib import Path

import numpy as np
import pytest

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs.files import load_spec_file

torch = pytest.importorskip("torch", reason="torch autograd is the reference")

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}  # relative to the largest entry of the reference
B, N, D_MODEL, D_K, D_V = 2, 5, 6, 4, 3


def _attention(q, k, v, scores=lambda s, d: s / d**0.5, weights=lambda a: torch.softmax(a, -1)):
    return weights(scores(q @ k.mT, q.shape[-1])) @ v


def _unit_rows(m):
    return m / (m * m).sum(-1, keepdim=True).sqrt()


def _layer_norm(x, gamma, beta):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5) * gamma + beta


# spec name -> (input shapes in the spec's order, the forward written directly in torch)
REFERENCES = {
    "sigmoid_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: _attention(X @ W_Q, X @ W_K, X @ W_V, weights=torch.sigmoid),
    ),
    "bias_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V), "B": (B, N, N)},
        lambda X, W_Q, W_K, W_V, B: _attention(X @ W_Q, X @ W_K, X @ W_V, scores=lambda s, d: s / d**0.5 + B),
    ),
    "softcap_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: _attention(
            X @ W_Q, X @ W_K, X @ W_V, scores=lambda s, d: 50 * torch.tanh(s / d**0.5 / 50)
        ),
    ),
    "gated_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)}
        | {"W_G": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V, W_G: _attention(X @ W_Q, X @ W_K, X @ W_V) * torch.sigmoid(X @ W_G),
    ),
    "differential_attention": (
        {"X": (B, N, D_MODEL), "W_Q1": (D_MODEL, D_K), "W_K1": (D_MODEL, D_K), "W_Q2": (D_MODEL, D_K)}
        | {"W_K2": (D_MODEL, D_K), "W_V": (D_MODEL, D_V), "lam": ()},
        lambda X, W_Q1, W_K1, W_Q2, W_K2, W_V, lam: (
            _attention(X @ W_Q1, X @ W_K1, X @ W_V) - lam * _attention(X @ W_Q2, X @ W_K2, X @ W_V)
        ),
    ),
    "temperature_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V), "tau": ()},
        lambda X, W_Q, W_K, W_V, tau: _attention(X @ W_Q, X @ W_K, X @ W_V, scores=lambda s, d: s * tau),
    ),
    "linear_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: (
            torch.sigmoid(X @ W_Q)
            @ (torch.sigmoid(X @ W_K).mT @ (X @ W_V))
            / (torch.sigmoid(X @ W_Q) @ torch.sigmoid(X @ W_K).sum(-2, keepdim=True).mT)
        ),
    ),
    "cosine_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: torch.softmax(10 * _unit_rows(X @ W_Q) @ _unit_rows(X @ W_K).mT, -1) @ (X @ W_V),
    ),
    "qk_norm_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)}
        | {"gamma_Q": (1, D_K), "beta_Q": (1, D_K), "gamma_K": (1, D_K), "beta_K": (1, D_K)},
        lambda X, W_Q, W_K, W_V, gamma_Q, beta_Q, gamma_K, beta_K: _attention(
            _layer_norm(X @ W_Q, gamma_Q, beta_Q), _layer_norm(X @ W_K, gamma_K, beta_K), X @ W_V
        ),
    ),
    "softplus_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: _attention(
            X @ W_Q,
            X @ W_K,
            X @ W_V,
            weights=lambda a: torch.nn.functional.softplus(a) / torch.nn.functional.softplus(a).sum(-1, keepdim=True),
        ),
    ),
    "relu_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V: _attention(X @ W_Q, X @ W_K, X @ W_V, weights=lambda a: torch.relu(a) / a.shape[-2]),
    ),
    "pointer_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K)},
        lambda X, W_Q, W_K: torch.log_softmax((X @ W_Q) @ (X @ W_K).mT / W_Q.shape[-1] ** 0.5, -1),
    ),
}
NAMES = sorted(REFERENCES)


def test_the_gallery_has_a_reference_for_every_spec_file():
    assert sorted(p.stem for p in GALLERY.glob("*.py")) == NAMES
    assert len(NAMES) >= 8


@functools.cache
def gallery_spec(name: str) -> sa.Spec:
    return load_spec_file(GALLERY / f"{name}.py")


_MODULES: dict = {}


def module(spec: sa.Spec, backend: str) -> types.ModuleType:
    """The generated module of spec (rendered once per spec and backend)."""
    key = (id(spec), backend)
    if key in _MODULES:
        return _MODULES[key][1]
    made = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(codegen.render(spec, backend), made.__name__, "exec"), made.__dict__)
    _MODULES[key] = (spec, made)  # the spec kept alive, so that its id is not reused
    return made


def _case(name: str, dtype: str, seed: int = 0):
    """Random inputs (float64 numpy, scaled to keep the scores moderate), a cotangent, torch autograd's gradients."""
    shapes, forward = REFERENCES[name]
    rng = np.random.default_rng(seed)
    values = {
        k: rng.standard_normal(s) * (1.0 if k == "X" or k.startswith(("gamma", "beta")) else 0.5)
        for k, s in shapes.items()
    }
    values = {k: np.asarray(v + (0.8 if v.ndim == 0 else 0.0)).astype(dtype) for k, v in values.items()}
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in values.items()}
    out = forward(**leaves)
    g = rng.standard_normal(tuple(out.shape)).astype(dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), torch.tensor(g, dtype=torch.float64))
    return values, g, out.detach().numpy(), dict(zip(values, (t.numpy() for t in grads)))


def _run(spec: sa.Spec, backend: str, values: dict, g: np.ndarray) -> tuple[np.ndarray, dict]:
    """The generated module's output and gradients (in the inputs' dtype)."""
    made = module(spec, backend)
    if backend == "numpy":
        out, saved = made.forward(*values.values())
        return out, made.backward(saved, g)
    leaves = [torch.tensor(v, requires_grad=True) for v in values.values()]
    out = made.forward(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.tensor(g))
    return out.detach().numpy(), {k: t.numpy() for k, t in zip(values, grads)}


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the reference's largest entry, at least 1 (a zero gradient: absolute)."""
    return float(np.max(np.abs(got.astype(np.float64) - want)) / max(np.max(np.abs(want)), 1.0))


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_gallery_module_matches_torch_autograd_and_keeps_the_dtype(name, backend, dtype):
    values, g, want_out, want = _case(name, dtype)
    out, grads = _run(gallery_spec(name), backend, values, g)
    errors = {"output": _relative(out, want_out)} | {k: _relative(grads[k], want[k]) for k in values}
    assert max(errors.values()) <= TOLERANCE[dtype], errors
    assert out.dtype == np.dtype(dtype) and all(grads[k].dtype == np.dtype(dtype) for k in values)
    assert all(grads[k].shape == values[k].shape for k in values)


def test_linear_attention_keeps_its_normaliser_a_column():
    """Z = φ(Q) φ(K)ᵀ 𝟏 is computed once, n × 1, and broadcast: no n × d_v array of it in either pass."""
    text = codegen.render(gallery_spec("linear_attention"), "numpy", second_order=False)
    assert "    Z = narrow_matmul(F_Q, F_K.mT.sum(axis=-1, keepdims=True))" in text
    assert "repeat" not in text and "np.ones((n, 1)" not in text


@pytest.mark.slow  # about 50 renders of user modules (first order)
@pytest.mark.parametrize("named", ["none", "each"])
@pytest.mark.parametrize("name", NAMES)
def test_gallery_spec_generates_whichever_intermediates_are_named(name, named):
    """None named, or each intermediate named alone: the same gradients (an input's gradient may be a cotangent)."""
    s = gallery_spec(name)
    choices = [()] if named == "none" else [(pair,) for pair in s.intermediates]
    values, g, _, want = _case(name, "float64", seed=1)
    for intermediates in choices:
        variant = dataclasses.replace(s, intermediates=intermediates)
        made = types.ModuleType(f"{name}_{named}")  # first order only: the gradients are what is checked here
        exec(compile(codegen.render(variant, "numpy", second_order=False), made.__name__, "exec"), made.__dict__)
        _, saved = made.forward(*values.values())
        grads = made.backward(saved, g)
        errors = {k: _relative(grads[k], want[k]) for k in values}
        assert max(errors.values()) <= TOLERANCE["float64"], (intermediates, errors)


@pytest.mark.slow  # every printed equality evaluated
@pytest.mark.parametrize("name", NAMES)
def test_gallery_derivation_verifies(name):
    report = sa.derive(gallery_spec(name)).verify()
    assert report.ok, report
