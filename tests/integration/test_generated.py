"""The generated NumPy and PyTorch modules, numerically: finite differences, torch autograd, gradcheck.

Every module in generated/ (each spec, both backends, the standard and the
memory-efficient variant) runs on random shapes with leading batch dimensions, in
float64 and float32. The torch reference forwards are written from the math here,
not generated; weights are shared across the batch, so their gradients sum over it.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is needed for the autograd references")

SPECS = ("attention", "self_attention", "mha")
VARIANTS = ("", "_memeff")
TOLERANCE = {np.float64: 1e-9, np.float32: 2e-4}


def module(spec: str, backend: str, variant: str = ""):
    return importlib.import_module(f"symattn.generated.{spec}_{backend}{variant}")


def draw(spec: str, rng: np.random.Generator, dtype=np.float64, batch: tuple | None = None):
    """Random inputs (in the CONTRACT.md table's order) and options, with random sizes and batch."""
    if batch is None:
        batch = tuple(int(b) for b in rng.integers(1, 4, size=rng.integers(0, 3)))
    n, m, d_k, d_v = (int(s) for s in rng.integers(2, 7, size=4))
    heads = int(rng.integers(1, 4))

    def normal(*shape):
        return rng.normal(size=shape).astype(dtype)

    if spec == "attention":
        inputs = [normal(*batch, n, d_k), normal(*batch, m, d_k), normal(*batch, m, d_v)]
        options = {"scale": float(rng.uniform(0.2, 1.0))}
    elif spec == "self_attention":
        d_model = int(rng.integers(2, 7))
        inputs = [normal(*batch, n, d_model), normal(d_model, d_k), normal(d_model, d_k), normal(d_model, d_v)]
        options = {}
    else:
        d_model = heads * d_k
        inputs = [normal(*batch, n, d_model), normal(*batch, m, d_model), normal(*batch, m, d_model)]
        inputs += [normal(d_model, d_model) / math.sqrt(d_model) for _ in range(4)]
        options = {"num_heads": heads}
    return inputs, options


def with_blocks(options: dict, variant: str) -> dict:
    """Blocks of 2 query rows, so the memory-efficient loop runs several times and ends on a short block."""
    return {**options, "block_size": 2} if variant else options


def reference(spec: str, tensors: list, options: dict):
    """The forward written from the math in plain torch (autograd differentiates it)."""

    def attention(q, k, v, scale):
        return torch.softmax(scale * (q @ k.transpose(-2, -1)), dim=-1) @ v

    if spec == "attention":
        return attention(*tensors, options["scale"])
    if spec == "self_attention":
        x, w_q, w_k, w_v = tensors
        return attention(x @ w_q, x @ w_k, x @ w_v, 1 / math.sqrt(w_q.shape[1]))
    q, k, v, w_q, w_k, w_v, w_o = tensors
    heads = options["num_heads"]
    d_k = w_q.shape[1] // heads
    blocks = [slice(h * d_k, (h + 1) * d_k) for h in range(heads)]
    out = [attention(q @ w_q[:, b], k @ w_k[:, b], v @ w_v[:, b], 1 / math.sqrt(d_k)) for b in blocks]
    return torch.cat(out, dim=-1) @ w_o


def relative_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("seed", range(3))
def test_numpy_backward_matches_finite_differences(spec, variant, seed):
    # <grad_out, (f(x + h u) − f(x − h u)) / 2h> = Σ_inputs <backward(grad_out)_i, u_i>
    rng = np.random.default_rng(seed)
    gen = module(spec, "numpy", variant)
    inputs, options = draw(spec, rng)
    options = with_blocks(options, variant)
    out, saved = gen.forward(*inputs, **options)
    grad_out = rng.normal(size=out.shape)
    grads = gen.backward(saved, grad_out)
    directions = [rng.normal(size=x.shape) for x in inputs]
    h = 1e-6
    plus = gen.forward(*(x + h * u for x, u in zip(inputs, directions)), **options)[0]
    minus = gen.forward(*(x - h * u for x, u in zip(inputs, directions)), **options)[0]
    numeric = np.sum(grad_out * (plus - minus)) / (2 * h)
    names = list(grads)
    analytic = sum(np.sum(grads[name] * u) for name, u in zip(names, directions))
    assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(numeric))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("spec", SPECS)
def test_matches_torch_autograd(spec, backend, variant, dtype):
    rng = np.random.default_rng(7)
    inputs, options = draw(spec, rng, dtype)
    gen = module(spec, backend, variant)
    names = [*gen.SHAPES]
    tensors = [torch.tensor(x, requires_grad=True) for x in inputs]
    expected = reference(spec, tensors, options)
    grad_out = torch.tensor(rng.normal(size=tuple(expected.shape)).astype(dtype))
    expected.backward(grad_out)
    if backend == "numpy":
        out, saved = gen.forward(*inputs, **with_blocks(options, variant))
        grads = gen.backward(saved, grad_out.numpy())
    else:
        mine = [torch.tensor(x, requires_grad=True) for x in inputs]
        out_t = gen.forward(*mine, **with_blocks(options, variant))
        out_t.backward(grad_out)
        out, grads = out_t.detach().numpy(), {name: t.grad.numpy() for name, t in zip(names, mine)}
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert relative_error(out, expected.detach().numpy()) < tol
    for name, t in zip(names, tensors):
        assert grads[name].dtype == dtype, name
        assert grads[name].shape == t.shape, name
        assert relative_error(grads[name], t.grad.numpy()) < tol, name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", SPECS)
def test_torch_backends_pass_gradcheck(spec, variant):
    inputs, options = draw(spec, np.random.default_rng(3), batch=(2,))
    tensors = [torch.tensor(x, requires_grad=True) for x in inputs]
    gen = module(spec, "torch", variant)
    options = with_blocks(options, variant)
    assert torch.autograd.gradcheck(lambda *t: gen.forward(*t, **options), tensors)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_gradcheck_in_seed_004_setting(variant):
    # seed 004: Q, K, V of shape n × d with n = 8, d = 16, and no scaling
    gen = module("attention", "torch", variant)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(8, 16, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(3))
    options = with_blocks({"scale": 1.0}, variant)
    assert torch.autograd.gradcheck(lambda *t: gen.forward(*t, **options), (q, k, v))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_mha_matches_nn_multihead_attention(backend, variant, cross):
    # W_Q = in_proj_weight[:d].T, W_K = in_proj_weight[d:2d].T, W_V = in_proj_weight[2d:].T, W_O = out_proj.weight.T
    torch.manual_seed(0)
    batch, n, m, d_model, heads = 3, 5, (7 if cross else 5), 12, 4
    reference_mha = torch.nn.MultiheadAttention(d_model, heads, bias=False, batch_first=True, dtype=torch.float64)
    q = torch.randn(batch, n, d_model, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, m, d_model, dtype=torch.float64, requires_grad=True) if cross else q
    v = torch.randn(batch, m, d_model, dtype=torch.float64, requires_grad=True) if cross else q
    expected, _ = reference_mha(q, k, v, need_weights=False)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    w_in = reference_mha.in_proj_weight.detach()
    weights = [w_in[:d_model].T, w_in[d_model : 2 * d_model].T, w_in[2 * d_model :].T, reference_mha.out_proj.weight.T]
    weights = [w.detach().clone() for w in weights]
    options = with_blocks({"num_heads": heads}, variant)
    gen = module("mha", backend, variant)
    data = [q.detach(), k.detach(), v.detach()]
    if backend == "numpy":
        out, saved = gen.forward(*(t.numpy() for t in data + weights), **options)
        grads = gen.backward(saved, grad_out.numpy())
    else:
        leaves = [t.clone().requires_grad_() for t in data + weights]
        out_t = gen.forward(*leaves, **options)
        out_t.backward(grad_out)
        out = out_t.detach().numpy()
        grads = {name: t.grad.numpy() for name, t in zip(["Q", "K", "V", "W_Q", "W_K", "W_V", "W_O"], leaves)}
    assert relative_error(out, expected.detach().numpy()) < 1e-12
    grad_data = grads["Q"] + grads["K"] + grads["V"] if not cross else None
    if cross:
        for name, t in zip("QKV", (q, k, v)):
            assert relative_error(grads[name], t.grad.numpy()) < 1e-12, name
    else:  # the same X as Q, K and V: its gradient is dQ + dK + dV
        assert relative_error(grad_data, q.grad.numpy()) < 1e-12
    g_in = reference_mha.in_proj_weight.grad
    expected_w = {
        "W_Q": g_in[:d_model].T,
        "W_K": g_in[d_model : 2 * d_model].T,
        "W_V": g_in[2 * d_model :].T,
        "W_O": reference_mha.out_proj.weight.grad.T,
    }
    for name, g in expected_w.items():
        assert relative_error(grads[name], g.numpy()) < 1e-12, name


def test_memory_efficient_variant_saves_no_n_by_m_array():
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 40, 8)), rng.normal(size=(2, 30, 8)), rng.normal(size=(2, 30, 8))
    _, standard = module("attention", "numpy").forward(q, k, v)
    _, saved = module("attention", "numpy", "_memeff").forward(q, k, v, block_size=16)
    assert any(np.shape(a)[-2:] == (40, 30) for a in standard.values())  # P, n × m
    assert not any(np.shape(a)[-2:] == (40, 30) for a in saved.values() if isinstance(a, np.ndarray))
    assert saved["L"].shape == (2, 40, 1)  # the row log-sum-exp


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bad_inputs_raise_value_errors_naming_shapes(backend):
    gen = module("mha", backend)
    rng = np.random.default_rng(0)
    inputs = [rng.normal(size=(2, 5, 6)), rng.normal(size=(2, 7, 6)), rng.normal(size=(2, 7, 6))]
    inputs += [rng.normal(size=(6, 6)) for _ in range(4)]  # d_model = 6, two heads of d_k = 3
    convert = (lambda a: a) if backend == "numpy" else torch.tensor

    def call(*arrays, **options):
        return gen.forward(*(convert(a) for a in arrays), **({"num_heads": 2} | options))

    with pytest.raises(ValueError, match=r"Q: expected shape \(\.\.\., n, H \* d_k\), got \(6,\)"):
        call(inputs[0][0, 0], *inputs[1:])
    with pytest.raises(
        ValueError, match=r"K: expected shape \(\.\.\., m, H \* d_k\) = \(\.\.\., 7, 6\), got \(2, 7, 5\)"
    ):
        call(inputs[0], inputs[1][..., :5], *inputs[2:])
    with pytest.raises(ValueError, match=r"mixed dtypes: Q is (torch\.)?float64, K is (torch\.)?float32"):
        call(inputs[0], inputs[1].astype(np.float32), *inputs[2:])
    with pytest.raises(ValueError, match=r"V: expected a floating-point"):
        call(*inputs[:2], inputs[2].astype(np.int64), *inputs[3:])
    with pytest.raises(ValueError, match=r"batch dimensions of Q"):
        call(inputs[0], inputs[1][:1], *inputs[2:])
    with pytest.raises(ValueError, match=r"W_O: expected shape \(H \* d_k, H \* d_k\), got \(2, 6, 6\)"):
        call(*inputs[:6], np.stack([inputs[6]] * 2))
    with pytest.raises(ValueError, match=r"multiple of 4"):
        call(*inputs, num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads must be a positive integer"):
        call(*inputs, num_heads=0)


def test_numpy_backward_checks_grad_out():
    gen = module("attention", "numpy")
    q = np.ones((3, 4))
    _, saved = gen.forward(q, q, q)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(3, 4\), got \(4, 3\)"):
        gen.backward(saved, np.ones((4, 3)))
    with pytest.raises(ValueError, match="mixed dtypes"):
        gen.backward(saved, np.ones((3, 4), dtype=np.float32))


@pytest.mark.slow  # trains
def test_torch_modules_hold_weights_and_train():
    mha = module("mha", "torch").MultiHeadAttention(8, num_heads=2, dtype=torch.float64)
    assert [name for name, _ in mha.named_parameters()] == ["W_Q", "W_K", "W_V", "W_O"]
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mha(x, x, x).square().sum().backward()
    assert all(p.grad is not None and p.grad.shape == (8, 8) for p in mha.parameters())
    with pytest.raises(ValueError, match="multiple of"):
        module("mha", "torch").MultiHeadAttention(9, num_heads=2)
    layer = module("self_attention", "torch").SelfAttention(6, 4, 3)
    assert layer(torch.randn(3, 6)).shape == (3, 3)
    assert module("attention", "torch").Attention(scale=0.5)(*(torch.randn(4, 2) for _ in range(3))).shape == (4, 2)
