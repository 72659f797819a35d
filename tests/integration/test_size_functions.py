"""A function of the sizes in a spec (log n: length-scaled attention, softmax(log n · Q Kᵀ / √d) V) is a Python
number in every generated module: printed through the runtime's size_math (Python's math), not the array library's
function, which raises on an int (torch.log(n)) or carries a dtype (NumPy's float64 widening a float32 run)."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import sympy as sp
from rendered import load

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")


def length_scaled() -> sa.Spec:
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    scores = sp.log(n) * sp.exp(sp.Integer(1) / m) / sp.sqrt(d) * q * k.T
    return sa.Spec("length_scaled", "softmax(log n e^{1/m} Q Kᵀ / √d) V", (q, k, v), sa.softmax(scores) * v)


def reference(q, k, v):
    """The spec's function by torch ops, float64."""
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    return torch.softmax(math.log(n) * math.exp(1 / m) / math.sqrt(d) * q @ k.mT, -1) @ v


def _inputs(dtype=torch.float64, n=6, m=7):
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(2, size, 4, generator=generator, dtype=dtype) for size in (n, m, m)]


def _gradients(out, inputs, cotangent):
    return torch.autograd.grad(out, inputs, cotangent)


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_every_backend_prints_the_sizes_function_with_pythons_math(backend):
    source = codegen.render(length_scaled(), backend, second_order=False)
    assert 'size_math("log", n)' in source and 'size_math("exp", 1 / m)' in source
    assert "torch.log(n)" not in source and "np.log(n)" not in source and "jnp.log(n)" not in source


def test_the_torch_module_matches_autograd_and_compiles_at_two_lengths():
    module = load(length_scaled(), "torch")
    inputs = [x.requires_grad_() for x in _inputs()]
    out = module.forward(*inputs)
    want = reference(*inputs)
    cotangent = torch.randn_like(out)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, expected in zip(_gradients(out, inputs, cotangent), _gradients(want, inputs, cotangent)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    compiled = torch.compile(module.forward, dynamic=True, fullgraph=True)
    for n in (6, 9):  # log n read at each length, not baked in at the first
        inputs = _inputs(n=n)
        torch.testing.assert_close(compiled(*inputs), reference(*inputs), rtol=1e-12, atol=1e-12)


def test_the_torch_modules_forward_mode_and_second_order_match_autograd():
    module = types.ModuleType("length_scaled_torch")
    exec(compile(codegen.render(length_scaled(), "torch"), module.__name__, "exec"), module.__dict__)
    inputs = [x.requires_grad_() for x in _inputs()]
    tangents = tuple(torch.randn_like(x) for x in inputs)
    _, tangent = torch.func.jvp(module.forward, tuple(inputs), tangents)
    torch.testing.assert_close(tangent, torch.func.jvp(reference, tuple(inputs), tangents)[1], rtol=1e-10, atol=1e-12)

    def hessian_along_tangents(function):  # double backward: reverse over reverse
        first = torch.autograd.grad(function(*inputs).square().sum(), inputs, create_graph=True)
        return torch.autograd.grad(sum((g * t).sum() for g, t in zip(first, tangents)), inputs)

    for got, want in zip(hessian_along_tangents(module.forward), hessian_along_tangents(reference)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_numpy_module_keeps_float32_and_matches():
    module = load(length_scaled(), "numpy")
    q, k, v = (x.numpy() for x in _inputs(torch.float32))
    out, saved = module.forward(q, k, v)
    assert out.dtype == np.float32  # a Python float from math: no float64 scalar widens the run
    assert all(g.dtype == np.float32 for g in module.backward(saved, np.ones_like(out)).values())
    want = reference(*(torch.from_numpy(x).double() for x in (q, k, v))).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_the_jax_module_matches_under_jit():
    jax = pytest.importorskip("jax")
    module = load(length_scaled(), "jax")
    q, k, v = (x.numpy() for x in _inputs(torch.float32))
    out = jax.jit(module.forward)(q, k, v)
    want = reference(*(torch.from_numpy(x).double() for x in (q, k, v))).numpy()
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)


def test_the_triton_module_matches_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    from triton_rendered import triton_module

    module = triton_module(length_scaled(), tmp_path)
    inputs = [x.float().requires_grad_() for x in _inputs()]
    out = module.forward(*inputs)
    double = [x.detach().double().requires_grad_() for x in inputs]
    want = reference(*double)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(_gradients(out, inputs, cotangent), _gradients(want, double, cotangent.double())):
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)
