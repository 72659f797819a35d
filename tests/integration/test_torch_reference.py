"""The closed forms against torch autograd of an independently written torch forward.

The torch forwards below are written from the math (tokens are rows, Q = X W^Q with
W^Q of shape d_model × d_k, head h = column block h of W^Q, W^K, W^V), not generated
from symattn. Outputs and every gradient are compared in float64; weights are shared
across the batch, so their gradients are summed over it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

import symattn as sa

torch = pytest.importorskip("torch", reason="torch is needed for the autograd reference")

TOLERANCE = 1e-10


def attention(q, k, v, scale: float):
    """softmax(scale · Q Kᵀ) V, softmax along each row."""
    return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v


def self_attention(x, w_q, w_k, w_v):
    """attention(X W_Q, X W_K, X W_V) with scale 1/√d_k."""
    return attention(x @ w_q, x @ w_k, x @ w_v, 1 / math.sqrt(w_q.shape[1]))


def mha(q, k, v, w_q, w_k, w_v, w_o, num_heads: int):
    """Concat over heads h of attention(Q W_Q[:, h], K W_K[:, h], V W_V[:, h]), times W_O."""
    d_k = w_q.shape[1] // num_heads
    heads = []
    for h in range(num_heads):
        block = slice(h * d_k, (h + 1) * d_k)
        heads.append(attention(q @ w_q[:, block], k @ w_k[:, block], v @ w_v[:, block], 1 / math.sqrt(d_k)))
    return torch.cat(heads, dim=-1) @ w_o


def compare(spec: sa.Spec, torch_forward, shapes: dict[str, tuple], batch: tuple, dims: dict | None = None):
    """Largest relative difference of the output and of each gradient, symattn against torch."""
    rng = np.random.default_rng(11)
    values = {
        name: rng.standard_normal(shape if name.startswith("W_") else batch + shape) for name, shape in shapes.items()
    }
    tensors = {name: torch.tensor(v, requires_grad=True) for name, v in values.items()}
    out = torch_forward(*(tensors[name] for name in spec.input_names))
    g = rng.standard_normal(tuple(out.shape))
    (out * torch.tensor(g)).sum().backward()

    derivation = sa.derive(spec)
    seed = derivation.tape.seed
    args = [*spec.inputs, seed]
    arrays = [values[name] for name in spec.input_names] + [g]
    errors = {"output": relative(sa.lambdify(spec.inputs, spec.output, dims=dims)(*arrays[:-1]), out.detach())}
    for name, closed_form in derivation.gradients.items():
        f = sa.lambdify(args, closed_form, sum_batch=name.startswith("W_"), dims=dims)
        errors[name] = relative(f(*arrays), tensors[name].grad)
    return errors


def relative(ours: np.ndarray, reference) -> float:
    reference = reference.numpy()
    assert np.shape(ours) == reference.shape
    return float(np.max(np.abs(ours - reference)) / max(1.0, np.max(np.abs(reference))))


@pytest.mark.parametrize("scale", [None, 1, sp.Rational(1, 3)])
@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_attention_matches_torch(scale, batch):
    spec = sa.spec("attention", scale=scale)
    factor = {None: 1 / math.sqrt(4), 1: 1.0}.get(scale, 1 / 3)
    shapes = {"Q": (3, 4), "K": (5, 4), "V": (5, 2)}
    errors = compare(spec, lambda q, k, v: attention(q, k, v, factor), shapes, batch)
    assert set(errors) == {"output", "Q", "K", "V"}
    assert all(e < TOLERANCE for e in errors.values()), errors


@pytest.mark.parametrize("batch", [(), (2,)])
def test_self_attention_matches_torch(batch):
    spec = sa.spec("self_attention")
    shapes = {"X": (4, 5), "W_Q": (5, 3), "W_K": (5, 3), "W_V": (5, 2)}
    errors = compare(spec, self_attention, shapes, batch)
    assert set(errors) == {"output", "X", "W_Q", "W_K", "W_V"}
    assert all(e < TOLERANCE for e in errors.values()), errors


@pytest.mark.parametrize(("num_heads", "symbolic"), [(1, False), (2, False), (3, False), (2, True), (4, True)])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_mha_matches_torch(num_heads, symbolic, batch):
    spec = sa.spec("mha", num_heads=None if symbolic else num_heads)
    d_model = 2 * num_heads
    shapes = {"Q": (3, d_model), "K": (4, d_model), "V": (4, d_model)}
    shapes |= {name: (d_model, d_model) for name in ("W_Q", "W_K", "W_V", "W_O")}
    dims = {"H": num_heads} if symbolic else None
    errors = compare(spec, lambda *a: mha(*a, num_heads=num_heads), shapes, batch, dims)
    assert set(errors) == {"output", "Q", "K", "V", "W_Q", "W_K", "W_V", "W_O"}
    assert all(e < TOLERANCE for e in errors.values()), errors


def test_self_attention_through_mha_matches_torch():
    # X fed as Q, K and V: torch differentiates the shared forward; symattn sums dQ + dK + dV.
    spec = sa.spec("mha", num_heads=2)
    derivation = sa.derive(spec)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 4))
    weights = {name: rng.standard_normal((4, 4)) for name in ("W_Q", "W_K", "W_V", "W_O")}
    tx = torch.tensor(x, requires_grad=True)
    out = mha(tx, tx, tx, *(torch.tensor(w) for w in weights.values()), num_heads=2)
    g = rng.standard_normal(tuple(out.shape))
    (out * torch.tensor(g)).sum().backward()
    args = [*spec.inputs, derivation.tape.seed]
    arrays = [x, x, x, *weights.values(), g]
    summed = sum(sa.lambdify(args, derivation.gradients[name])(*arrays) for name in ("Q", "K", "V"))
    assert relative(summed, tx.grad) < TOLERANCE
