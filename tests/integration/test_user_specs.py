"""User specs with any intermediates named generate modules whose gradients match torch autograd.

Every input is differentiable: an input whose gradient is another value's cotangent
(B in A = S/√d_k + B has dB = dA) gets its own assignment, whichever intermediates are named.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")


def bias_spec(named: tuple[str, ...]) -> sa.Spec:
    """softmax(X W_Q (X W_K)ᵀ / √d_k + B) X W_V, B an n × n learned additive bias, with the given names."""
    n, d_model, d_k, d_v = dim("n"), dim("d_model"), dim("d_k"), dim("d_v")
    x = sp.MatrixSymbol("X", n, d_model)
    w_q, w_k = sp.MatrixSymbol("W_Q", d_model, d_k), sp.MatrixSymbol("W_K", d_model, d_k)
    w_v, b = sp.MatrixSymbol("W_V", d_model, d_v), sp.MatrixSymbol("B", n, n)
    s = x * w_q * (x * w_k).T
    a = s / sp.sqrt(d_k) + b
    p = sa.softmax(a)
    out = p * x * w_v
    values = {"S": s, "A": a, "P": p}
    return sa.Spec(
        "bias_attention", "softmax(S/√d_k + B) X W_V", (x, w_q, w_k, w_v, b), out, tuple((k, values[k]) for k in named)
    )


def load(spec: sa.Spec, backend: str) -> types.ModuleType:
    module = types.ModuleType(f"{spec.name}_{backend}")
    # first order only: the gradients are what is checked here (tests/integration/test_second_order.py: the rest)
    exec(compile(codegen.render(spec, backend, second_order=False), module.__name__, "exec"), module.__dict__)
    return module


def reference(x, w_q, w_k, w_v, b):
    """The same forward written directly in torch."""
    a = (x @ w_q) @ (x @ w_k).mT / w_q.shape[-1] ** 0.5 + b
    return torch.softmax(a, dim=-1) @ x @ w_v


SUBSETS = [c for r in range(4) for c in itertools.combinations(("S", "A", "P"), r)]


@pytest.mark.parametrize("named", SUBSETS, ids=lambda c: "+".join(c) or "none")
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_every_input_gets_its_gradient_whatever_is_named(named, backend):
    rng = np.random.default_rng(0)
    shapes = {"X": (2, 5, 4), "W_Q": (4, 3), "W_K": (4, 3), "W_V": (4, 2), "B": (2, 5, 5)}
    values = {k: rng.standard_normal(s) for k, s in shapes.items()}
    g = rng.standard_normal((2, 5, 2))
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    expected = torch.autograd.grad((reference(*ts.values()) * torch.tensor(g)).sum(), list(ts.values()))
    module = load(bias_spec(named), backend)
    if backend == "numpy":
        _, saved = module.forward(*values.values())
        got = module.backward(saved, g)
    else:
        ts2 = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
        out = module.forward(*ts2.values())
        got = dict(zip(ts2, torch.autograd.grad((out * torch.tensor(g)).sum(), list(ts2.values()))))
    for name, want in zip(shapes, expected):
        np.testing.assert_allclose(np.asarray(got[name]), want.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
