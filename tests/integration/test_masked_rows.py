"""A user spec with a row-wise function of masked scores (log-softmax over Q Kᵀ/√d_k + M): the generated
modules build M from causal / key_padding_mask, use the function's masked form, and match torch autograd of
an independently written forward; a row whose keys are all masked gives -inf log-probabilities, never NaN."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from symattn.codegen import generate as codegen
from symattn.specs.files import load_spec_file

torch = pytest.importorskip("torch", reason="torch autograd is the reference")

SPEC = """
import sympy as sp
import symattn as sa
from symattn.specs import dim

n, d_model, d_k = dim("n"), dim("d_model"), dim("d_k")
X = sa.matrix("X", n, d_model)
W_Q, W_K = sa.matrix("W_Q", d_model, d_k), sa.matrix("W_K", d_model, d_k)
M = sa.matrix("M", n, n)
out = sa.log_softmax(X * W_Q * (X * W_K).T / sp.sqrt(d_k) + M)
spec = sa.Spec("masked_pointer", "log_softmax(Q Kᵀ/√d_k + M)", (X, W_Q, W_K), out, constants=(M,))
"""
B, N, D_MODEL, D_K = 2, 5, 6, 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("spec")) / "masked_pointer.py"
    path.write_text(SPEC, encoding="utf-8")
    return load_spec_file(path)


def _module(spec, backend: str) -> types.ModuleType:
    made = types.ModuleType(f"masked_pointer_{backend}")
    exec(compile(codegen.render(spec, backend), made.__name__, "exec"), made.__dict__)
    return made


def _reference(X, W_Q, W_K, blocked):
    """log_softmax of the scores plus -inf where blocked (True: not allowed), written directly in torch."""
    scores = (X @ W_Q) @ (X @ W_K).mT / D_K**0.5
    return torch.log_softmax(scores + torch.zeros_like(scores).masked_fill(blocked, float("-inf")), -1)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_masked_log_softmax_matches_autograd_and_keeps_empty_rows_finite_in_gradient(spec, backend):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s) for s in ((B, N, D_MODEL), (D_MODEL, D_K), (D_MODEL, D_K))]
    padding = np.zeros((B, N), dtype=bool)
    padding[1] = True  # every key of the second batch element masked: its rows have no allowed key
    blocked = torch.triu(torch.ones(N, N, dtype=torch.bool), 1) | torch.tensor(padding)[:, None, :]
    g = rng.standard_normal((B, N, N))
    leaves = [torch.tensor(v[:1] if v.ndim == 3 else v, requires_grad=True) for v in values]
    want = _reference(*leaves, blocked[:1])  # the first element (the second's rows are NaN in torch)
    want_grads = torch.autograd.grad(want, leaves, torch.tensor(g[:1]))
    made = _module(spec, backend)
    if backend == "numpy":
        out, saved = made.forward(*values, causal=True, key_padding_mask=padding)
        first = made.forward(*(v[:1] if v.ndim == 3 else v for v in values), causal=True, key_padding_mask=padding[:1])
        grads = made.backward(first[1], g[:1])
        grads = [grads[k] for k in ("X", "W_Q", "W_K")]
        grads[0] = grads[0][0]
        every = made.backward(saved, g)
    else:
        ins = [torch.tensor(v, requires_grad=True) for v in values]
        out = made.forward(*ins, causal=True, key_padding_mask=torch.tensor(padding))
        grads = torch.autograd.grad(out[0], ins, torch.tensor(g[0]), retain_graph=True)
        grads = [grads[0][0].numpy(), grads[1].numpy(), grads[2].numpy()]
        every = dict(zip("abc", torch.autograd.grad(out, ins, torch.tensor(g))))
        out = out.detach().numpy()
    assert np.all(np.isneginf(out[1])) and not np.isnan(out).any()
    finite = np.isfinite(want[0].detach().numpy())
    assert np.array_equal(finite, np.isfinite(out[0]))
    assert np.max(np.abs(out[0][finite] - want[0].detach().numpy()[finite])) < 1e-12
    for got, ref in zip(grads, (want_grads[0][0], want_grads[1], want_grads[2])):
        assert np.max(np.abs(got - ref.numpy())) < 1e-10
    assert all(np.isfinite(np.asarray(v)).all() for v in every.values())
