"""sa.stop_gradient: sg(A) is A's value, differentiated as a constant. A spec with a stop-gradient inside the scores
(a query whose gradient is stopped) and one inside the core's entrywise map (a detached bias added to the scores)
derive with every step verified, and generate NumPy, torch, JAX and Triton modules whose outputs and gradients
match torch autograd of the same forward written with detach() (float64; float32 for the kernels)."""

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

B, N, D_MODEL, D_K, D_V = 2, 5, 6, 4, 3
n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
X = sa.matrix("X", n, d_model)
W_Q, W_K, W_V = (sa.matrix(name, d_model, d) for name, d in (("W_Q", d_k), ("W_K", d_k), ("W_V", d_v)))


def _stopped_query() -> sa.Spec:
    """softmax(sg(X W_Q) (X W_K)ᵀ / √d_k) X W_V: no gradient reaches W_Q."""
    S = sa.stop_gradient(X * W_Q) * (X * W_K).T
    return sa.Spec(
        name="stopped_query",
        summary="softmax(sg(X W_Q) (X W_K)ᵀ / √d_k) X W_V",
        inputs=(X, W_Q, W_K, W_V),
        output=sa.softmax(S / sp.sqrt(d_k)) * (X * W_V),
    )


def _stopped_bias() -> sa.Spec:
    """softmax(S/√d_k + sg(B)) X W_V, S = X W_Q (X W_K)ᵀ: a bias input whose gradient is stopped (frozen), read
    by the kernels as an n × m tile."""
    S = (X * W_Q) * (X * W_K).T
    bias = sa.matrix("B", n, n)
    return sa.Spec(
        name="stopped_bias",
        summary="softmax(S/√d_k + sg(B)) X W_V",
        inputs=(X, W_Q, W_K, W_V, bias),
        output=sa.softmax(S / sp.sqrt(d_k) + sa.stop_gradient(bias)) * (X * W_V),
    )


def _reference(name, x, w_q, w_k, w_v, b=None):
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    if name == "stopped_query":
        s = q.detach() @ k.mT / math.sqrt(D_K)
    else:
        s = q @ k.mT / math.sqrt(D_K) + b.detach()
    return torch.softmax(s, -1) @ v


SPECS = {"stopped_query": _stopped_query(), "stopped_bias": _stopped_bias()}
SHAPES = {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V), "B": (B, N, N)}


def _inputs(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = [x.name for x in SPECS[name].inputs]
    return {k: rng.standard_normal(SHAPES[k]) * (1.0 if k in "XB" else 0.5) for k in names}


def _want(name: str, values: dict, g: np.ndarray) -> tuple[np.ndarray, dict]:
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    out = _reference(name, *leaves.values())
    grads = torch.autograd.grad(out, list(leaves.values()), torch.tensor(g), allow_unused=True)
    return out.detach().numpy(), {k: np.zeros(SHAPES[k]) if t is None else t.numpy() for k, t in zip(leaves, grads)}


def _module(spec: sa.Spec, backend: str) -> types.ModuleType:
    made = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(codegen.render(spec, backend), made.__name__, "exec"), made.__dict__)
    return made


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_derivation_verifies_and_prints_sg(name):
    derivation = sa.derive(SPECS[name])
    assert derivation.verify().ok
    assert "sg(" in derivation.text() and r"\operatorname{sg}" in derivation.latex()


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_generated_modules_match_autograd_with_detach(name, backend):
    values = _inputs(name)
    g = np.random.default_rng(1).standard_normal((B, N, D_V))
    want_out, want = _want(name, values, g)
    made = _module(SPECS[name], backend)
    if backend == "numpy":
        out, saved = made.forward(*values.values())
        grads = made.backward(saved, g)
    elif backend == "torch":
        leaves = [torch.tensor(v, requires_grad=True) for v in values.values()]
        result = made.forward(*leaves)
        found = torch.autograd.grad(result, leaves, torch.tensor(g), allow_unused=True)
        out, grads = (
            result.detach().numpy(),
            {k: np.zeros(SHAPES[k]) if t is None else t.numpy() for k, t in zip(values, found)},
        )
    else:
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
        out, vjp = jax.vjp(made.forward, *values.values())
        grads = dict(zip(values, vjp(g)))
    assert np.max(np.abs(np.asarray(out) - want_out)) < 1e-10
    for k in values:
        assert np.max(np.abs(np.asarray(grads[k]) - want[k])) < 1e-10, k
    stopped = "W_Q" if name == "stopped_query" else "B"
    assert not np.any(np.asarray(grads[stopped]))  # exactly zero: nothing flows through sg


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_triton_kernels_match_autograd_with_detach(name, tmp_path):
    from triton_rendered import triton_module

    made = triton_module(SPECS[name], tmp_path)
    values = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in _inputs(name, 2).items()}
    out = made.forward(*values.values())
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    found = torch.autograd.grad(out, list(values.values()), g, allow_unused=True)
    want_out, want = _want(name, {k: v.detach().double().numpy() for k, v in values.items()}, g.double().numpy())
    assert np.max(np.abs(out.detach().numpy() - want_out)) < 1e-5
    for (k, v), t in zip(values.items(), found):
        got = np.zeros(v.shape) if t is None else t.numpy()
        assert np.max(np.abs(got - want[k])) < 1e-4, k


@pytest.mark.parametrize("name", sorted(SPECS))
def test_forward_mode_and_the_hessian_vector_product_match_torch_func(name):
    """The torch module's jvp (the tangent through sg is zero) and hvp (reverse over reverse, sg a constant of both
    differentials) against torch.func of the forward written with detach()."""
    made = _module(SPECS[name], "torch")
    values = {k: torch.tensor(v) for k, v in _inputs(name, 4).items()}
    generator = torch.Generator().manual_seed(5)
    tangents = {k: torch.randn(v.shape, generator=generator, dtype=v.dtype) for k, v in values.items()}
    out, tangent = made.jvp(*values.values(), tangents)
    want_out, want_tangent = torch.func.jvp(
        lambda *xs: _reference(name, *xs), tuple(values.values()), tuple(tangents.values())
    )
    assert (out - want_out).abs().max() < 1e-12 and (tangent - want_tangent).abs().max() < 1e-12
    g = torch.randn(out.shape, generator=generator, dtype=out.dtype)
    found = made.hvp(*values.values(), g, tangents)
    gradient = torch.func.grad(lambda *xs: (_reference(name, *xs) * g).sum(), argnums=tuple(range(len(values))))
    _, want = torch.func.jvp(gradient, tuple(values.values()), tuple(tangents.values()))
    for k, w in zip(values, want):
        assert (found[k] - w).abs().max() < 1e-12, k
