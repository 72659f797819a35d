"""Trainable scalars in generated modules: τ in softmax(τ Q Kᵀ) V is a 0-d input whose gradient
∂f/∂τ = sum(Ā ⊙ S) comes back 0-d, in the inputs' dtype, summed over the batch; a Python float,
a 0-d array, a 0-d tensor and an nn.Parameter are all accepted."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs.files import load_spec_file

torch = pytest.importorskip("torch", reason="torch autograd is the reference")

SPEC = Path(__file__).resolve().parents[2] / "examples" / "specs" / "temperature_attention.py"
N, D_MODEL, D_K, D_V = 5, 6, 4, 3


@functools.cache
def module(backend: str) -> types.ModuleType:
    made = types.ModuleType(f"temperature_{backend}")
    exec(compile(codegen.render(load_spec_file(SPEC), backend), made.__name__, "exec"), made.__dict__)
    return made


def reference(x, w_q, w_k, w_v, tau):
    return torch.softmax((x @ w_q) @ (x @ w_k).mT * tau, -1) @ (x @ w_v)


def inputs(batch: tuple, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(*batch, N, D_MODEL), (D_MODEL, D_K), (D_MODEL, D_K), (D_MODEL, D_V)]
    return [torch.randn(s, generator=g, dtype=dtype) * 0.5 for s in shapes]


@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["unbatched", "batched"])
def test_numpy_gradient_of_tau_is_0d_and_summed_over_the_batch(batch):
    # ∂f/∂τ = Σ_batch sum(Ā ⊙ S)
    x, w_q, w_k, w_v = inputs(batch)
    tau = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    leaves = [t.requires_grad_() for t in (x, w_q, w_k, w_v)]
    out = reference(*leaves, tau)
    g = torch.randn(out.shape, dtype=torch.float64)
    want = torch.autograd.grad(out, [*leaves, tau], g)
    made = module("numpy")
    got_out, saved = made.forward(*(t.detach().numpy() for t in (x, w_q, w_k, w_v)), 0.7)
    grads = made.backward(saved, g.numpy())
    assert np.allclose(got_out, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert grads["tau"].shape == () and grads["tau"].dtype == np.float64
    for name, w in zip(("X", "W_Q", "W_K", "W_V", "tau"), want):
        assert np.allclose(grads[name], w.numpy(), rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("tau", [0.7, np.float32(0.7), np.array(0.7, dtype=np.float32), 1])
def test_numpy_takes_tau_as_a_number_or_0d_array_in_the_inputs_dtype(tau):
    x, w_q, w_k, w_v = (t.numpy().astype(np.float32) for t in inputs((2,)))
    out, saved = module("numpy").forward(x, w_q, w_k, w_v, tau)
    grads = module("numpy").backward(saved, np.ones_like(out))
    assert out.dtype == np.float32 and grads["tau"].dtype == np.float32 and grads["tau"].shape == ()


def test_a_tau_that_is_not_a_scalar_is_refused():
    x, w_q, w_k, w_v = (t.numpy() for t in inputs(()))
    with pytest.raises(ValueError, match="tau: expected a real scalar"):
        module("numpy").forward(x, w_q, w_k, w_v, np.ones(2))
    with pytest.raises(ValueError, match="tau: expected a 0-d"):
        module("torch").forward(*map(torch.as_tensor, (x, w_q, w_k, w_v)), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_gradient_of_tau_matches_autograd_with_an_nn_parameter(dtype):
    x, w_q, w_k, w_v = inputs((2,), dtype)
    leaves = [t.requires_grad_() for t in (x, w_q, w_k, w_v)]
    tau = torch.nn.Parameter(torch.tensor(1.3, dtype=dtype))
    g = torch.randn(2, N, D_V, dtype=dtype)
    got = torch.autograd.grad(module("torch").forward(*leaves, tau), [*leaves, tau], g)
    want = torch.autograd.grad(reference(*leaves, tau), [*leaves, tau], g)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))
    assert got[-1].shape == ()


def test_torch_takes_a_python_float_and_gives_it_no_gradient():
    leaves = [t.requires_grad_() for t in inputs(())]
    out = module("torch").forward(*leaves, 0.5)
    assert torch.allclose(out, reference(*leaves, 0.5))
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_torch_gradcheck_includes_tau():
    x, w_q, w_k, w_v = (t.requires_grad_() for t in inputs((2,)))
    tau = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(module("torch").forward, (x, w_q, w_k, w_v, tau))


def test_the_module_holds_tau_as_a_0d_parameter():
    made = module("torch")
    layer = made.TemperatureAttention(D_MODEL, D_K, D_V, dtype=torch.float64)
    assert layer.tau.shape == () and float(layer.tau.detach()) == 1.0
    assert "tau" in dict(layer.named_parameters())
    x = inputs((2,))[0]
    layer(x).sum().backward()
    assert layer.tau.grad is not None and layer.tau.grad.shape == ()


def test_a_scalar_symbol_that_is_neither_a_dimension_nor_an_input_is_refused():
    n, d = sp.symbols("n d", positive=True, integer=True)
    x = sp.MatrixSymbol("X", n, d)
    loose = sa.Spec("loose", "τ X", (x,), sp.Symbol("tau", real=True) * x)
    with pytest.raises(SymattnError, match="neither an input's dimension nor an input"):
        codegen.render(loose, "numpy")


def test_grad_with_respect_to_tau():
    s = load_spec_file(SPEC)
    tau = s.input("tau")
    assert not isinstance(sa.grad(s.output, [tau])[tau], sp.MatrixExpr)


def test_cli_derives_and_verifies_tau_and_check_says_it_takes_no_scalar(capsys):
    from symattn.cli import main

    assert main(["derive", "--spec-file", str(SPEC), "--wrt", "tau", "--format", "text"]) == 0
    printed = capsys.readouterr().out
    assert "∂f/∂tau = 𝟏ᵀ (S ⊙ " in printed and "dtau" in printed  # tr(Āᵀ S) as a sum of entries
    assert main(["derive", "--spec-file", str(SPEC), "--wrt", "tau", "--verify"]) == 0
    capsys.readouterr()
    assert main(["check", "--spec-file", str(SPEC), "--wrt", "tau", "sum(hadamard(G, O))"]) == 2
    err = capsys.readouterr().err
    assert "trainable scalar" in err and err.count("\n") == 1
