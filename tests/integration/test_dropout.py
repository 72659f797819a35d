"""Dropout in the language: sa.dropout(A, p) = A ⊙ Z_p(A), Z_p a Bernoulli(1 − p) / (1 − p) mask drawn once per call.

The derivation prints the mask as a constant of the call and verifies; the generated torch module draws Z from
torch's generator (the draws F.dropout makes from the same state), so torch.manual_seed reproduces a run and the
module matches torch autograd of F.dropout's forward seeded alike, output and gradients, float64; its backward is
the exact derivative of the forward with the same draws (gradcheck, the seed reset before each evaluation), its
jvp a central difference with the same draws; training=False is the spec without dropout and draws nothing; the
mask's keep rate over 10⁵ draws lies within 3σ of 1 − p. from_torch reads F.dropout / nn.Dropout in train() as the
node, the drop-in following the module's train()/eval() on every call. (The memory-efficient variant draws by
blocks: test_dropout_memeff.py; the Triton kernels by Philox: test_triton_dropout.py.)
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest
import sympy as sp
from rendered import load

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs import dim

torch = pytest.importorskip("torch")
F = torch.nn.functional

from symattn.trace.dropin import drop_in  # noqa: E402

P_DROP = 0.1
n, m, d = dim("n"), dim("m"), dim("d")
Q, K, V = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)


def attention_spec(p) -> sa.Spec:
    output = sa.dropout(sa.softmax(Q * K.T / sp.sqrt(d)), p) * V
    return sa.Spec(
        name=f"dropped_{str(p).replace('.', '_')}",
        summary="attention, weights dropped",
        inputs=(Q, K, V),
        output=output,
    )


def reference(q, k, v, p=P_DROP, training=True):
    """torch's attention with F.dropout on the weights (independent of symattn)."""
    return F.dropout(torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1), p, training) @ v


def _inputs(seed=0, sizes=(6, 9, 4)):
    g = torch.Generator().manual_seed(seed)
    rows, cols, width = sizes
    return [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]


@pytest.fixture(scope="module")
def module():
    return load(attention_spec(P_DROP), "torch")


def test_the_derivation_prints_the_mask_and_verifies():
    derivation = sa.derive(attention_spec(P_DROP))
    text = derivation.text()
    assert "Z_0.1(P) ⊙ (G Vᵀ)" in text  # P̄ = Z ⊙ (G Vᵀ): the cotangent through the same mask
    assert derivation.verify().ok


def test_dropout_of_p_zero_is_the_argument_and_a_bad_p_is_refused():
    a = sp.MatrixSymbol("A", n, m)
    assert sa.dropout(a, 0) == a
    for bad in (1, 1.5, -0.1):
        with pytest.raises(SymattnError, match="dropout's p must satisfy 0 ≤ p < 1"):
            sa.dropout(a, bad)


def test_the_seed_reproduces_the_forward_and_another_seed_draws_another_mask(module):
    q, k, v = _inputs()
    torch.manual_seed(1)
    first = module.forward(q, k, v)
    torch.manual_seed(1)
    again = module.forward(q, k, v)
    torch.manual_seed(2)
    other = module.forward(q, k, v)
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)
    state = torch.get_rng_state()  # a generator of the caller's own: its state alone decides the mask
    own = module.forward(q, k, v, rng=torch.Generator().manual_seed(1))
    assert torch.equal(own, module.forward(q, k, v, rng=torch.Generator().manual_seed(1)))
    assert torch.equal(own, first) and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("seed", [0, 5])
def test_the_module_matches_torch_dropout_seeded_alike(module, seed):
    inputs = _inputs(seed)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ours = [x.clone().requires_grad_() for x in inputs]
    torch.manual_seed(seed)
    want = reference(*leaves)
    torch.manual_seed(seed)
    got = module.forward(*ours)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for g, w in zip(torch.autograd.grad(got, ours, cotangent), torch.autograd.grad(want, leaves, cotangent)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_backward_is_the_derivative_of_the_forward_with_the_same_draws(module):
    leaves = [x.requires_grad_() for x in _inputs(3, sizes=(3, 4, 2))]

    def seeded(*xs):
        torch.manual_seed(11)  # every evaluation draws the same mask
        return module.forward(*xs)

    assert torch.autograd.gradcheck(seeded, leaves, eps=1e-6, atol=1e-8)


def test_the_jvp_is_a_central_difference_with_the_same_draws(module):
    inputs = _inputs(4)
    tangents = [torch.randn_like(x) for x in inputs]
    torch.manual_seed(9)
    _, tangent = module.jvp(*inputs, dict(zip("QKV", tangents)))
    eps = 1e-6

    def at(sign):
        torch.manual_seed(9)
        return module.forward(*(x + sign * eps * t for x, t in zip(inputs, tangents)))

    torch.testing.assert_close(tangent, (at(1) - at(-1)) / (2 * eps), rtol=1e-6, atol=1e-8)


def test_recomputing_the_forward_under_autograd_is_refused_while_training():
    """torch.func.jvp and a second derivative through the autograd Function recompute the forward from the inputs
    (it would draw another mask): refused in one line while training, computed in eval."""
    second = types.ModuleType("dropped_second")
    exec(compile(codegen.render(attention_spec(P_DROP), "torch"), second.__name__, "exec"), second.__dict__)
    inputs = _inputs(6, sizes=(3, 4, 2))
    with pytest.raises(RuntimeError, match=r"forward-mode AD .* dropout while training is not supported"):
        torch.func.jvp(second.forward, tuple(inputs), tuple(torch.ones_like(x) for x in inputs))
    leaves = [x.clone().requires_grad_() for x in inputs]
    (grad,) = torch.autograd.grad(second.forward(*leaves).sum(), leaves[:1], create_graph=True)
    with pytest.raises(RuntimeError, match=r"a second derivative .* dropout while training is not supported"):
        torch.autograd.grad(grad.sum(), leaves)
    evaluated = functools.partial(second.forward, training=False)
    assert torch.autograd.gradgradcheck(evaluated, [x.detach().requires_grad_() for x in leaves])


def test_training_false_is_attention_without_dropout_and_draws_nothing(module):
    inputs = _inputs(2)
    plain = load(attention_spec(0), "torch")
    state = torch.get_rng_state()
    got = module.forward(*inputs, training=False)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(got, plain.forward(*inputs), rtol=0, atol=0)
    torch.testing.assert_close(got, reference(*inputs, training=False), rtol=1e-12, atol=1e-13)


def test_the_nn_module_follows_train_and_eval(module):
    """The generated nn.Module passes its own training flag (no constructor argument): train() draws as forward
    does, eval() is the spec without dropout and draws nothing."""
    layer = module.Dropped01()
    assert layer.training and "training" not in layer.extra_repr()
    inputs = _inputs(8)
    torch.manual_seed(2)
    want = module.forward(*inputs)
    torch.manual_seed(2)
    torch.testing.assert_close(layer(*inputs), want, rtol=0, atol=0)
    state = torch.get_rng_state()
    torch.testing.assert_close(layer.eval()(*inputs), module.forward(*inputs, training=False), rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_keep_rate_is_one_minus_p_within_three_sigma():
    x = sp.MatrixSymbol("X", n, d)
    dropped = load(sa.Spec(name="dropped_x", summary="X dropped", inputs=(x,), output=sa.dropout(x, 0.3)), "torch")
    torch.manual_seed(0)
    y = dropped.forward(torch.ones(400, 250, dtype=torch.float64))
    kept = y != 0
    assert torch.all(y[kept] == 1 / 0.7)  # the kept entries scaled by 1/(1 − p)
    count, rate = kept.numel(), kept.double().mean().item()
    assert abs(rate - 0.7) <= 3 * math.sqrt(0.3 * 0.7 / count)


def test_the_numpy_module_draws_from_rng_and_matches_autograd_with_its_mask():
    """NumPy: Z = (rng.random(shape) ≥ p) / (1 − p) from the caller's Generator; the same seed the same numbers,
    another seed another mask, no rng while training a one-line TypeError; output and gradients those of torch
    autograd of A ⊙ Z with that Z; training=False the spec without dropout."""
    module = load(attention_spec(P_DROP), "numpy")
    q, k, v = (x.numpy() for x in _inputs(2))
    out, saved = module.forward(q, k, v, rng=np.random.default_rng(3))
    assert np.array_equal(out, module.forward(q, k, v, rng=np.random.default_rng(3))[0])
    assert not np.allclose(out, module.forward(q, k, v, rng=np.random.default_rng(4))[0])
    with pytest.raises(TypeError, match="dropout while training draws its mask from rng"):
        module.forward(q, k, v)
    mask = (np.random.default_rng(3).random((2, q.shape[-2], k.shape[-2])) >= P_DROP) / (1 - P_DROP)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    weights = torch.softmax(leaves[0] @ leaves[1].mT / math.sqrt(q.shape[-1]), dim=-1)
    want = (weights * torch.tensor(mask)) @ leaves[2]
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    cotangent = np.random.default_rng(0).standard_normal(out.shape)
    grads = module.backward(saved, cotangent)
    for name, w in zip("QKV", torch.autograd.grad(want, leaves, torch.tensor(cotangent))):
        np.testing.assert_allclose(grads[name], w.numpy(), rtol=1e-10, atol=1e-12)
    plain, _ = load(attention_spec(0), "numpy").forward(q, k, v)
    np.testing.assert_array_equal(module.forward(q, k, v, training=False)[0], plain)


def test_the_jax_module_draws_with_a_key_under_jit_and_grad():
    """JAX: Z = bernoulli(rng, 1 − p, shape) / (1 − p) with the caller's key (a traced argument, not static): the
    same key the same numbers, jit and not alike, another key another mask; output and vjp those of torch autograd of
    A ⊙ Z with that Z; training=False the spec without dropout; no key while training a one-line TypeError."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    jax.config.update("jax_enable_x64", True)
    module = load(attention_spec(P_DROP), "jax")
    q, k, v = (jnp.asarray(x.numpy()) for x in _inputs(2))
    key = jax.random.key(3)
    out = module.forward(q, k, v, rng=key)
    jitted = jax.jit(lambda a, b, c, r: module.forward(a, b, c, rng=r))
    assert np.array_equal(out, jitted(q, k, v, key))
    assert not np.allclose(out, module.forward(q, k, v, rng=jax.random.key(4)))
    with pytest.raises(TypeError, match="draws its mask with a JAX key"):
        module.forward(q, k, v)
    mask = np.asarray(jax.random.bernoulli(key, 1 - P_DROP, (2, q.shape[-2], k.shape[-2]))) / (1 - P_DROP)
    leaves = [torch.tensor(np.asarray(x), requires_grad=True) for x in (q, k, v)]
    weights = torch.softmax(leaves[0] @ leaves[1].mT / math.sqrt(q.shape[-1]), dim=-1)
    want = (weights * torch.tensor(mask)) @ leaves[2]
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    cotangent = np.random.default_rng(0).standard_normal(out.shape)
    _, pullback = jax.vjp(lambda a, b, c: module.forward(a, b, c, rng=key), q, k, v)
    for got, w in zip(pullback(jnp.asarray(cotangent)), torch.autograd.grad(want, leaves, torch.tensor(cotangent))):
        np.testing.assert_allclose(got, w.numpy(), rtol=1e-10, atol=1e-12)
    plain = load(attention_spec(0), "jax").forward(q, k, v)
    np.testing.assert_array_equal(module.forward(q, k, v, training=False), plain)
    tangents = [jnp.full_like(x, 0.3) for x in (q, k, v)]  # forward mode, the key a primal of no tangent
    _, tangent = jax.jvp(lambda a, b, c: module.forward_jvp(a, b, c, rng=key), (q, k, v), tuple(tangents))
    np.testing.assert_array_equal(tangent, module.jvp(q, k, v, dict(zip("QKV", tangents)), rng=key)[1])
    eps = 1e-6
    moved = [module.forward(*(x + s * eps * t for x, t in zip((q, k, v), tangents)), rng=key) for s in (1, -1)]
    np.testing.assert_allclose(tangent, (moved[0] - moved[1]) / (2 * eps), rtol=1e-6, atol=1e-8)


class DroppedAttention(torch.nn.Module):
    """One head of self-attention with dropout on the weights (F.dropout, the module's flag) and on the output
    (nn.Dropout), as models write it."""

    def __init__(self, width=4):
        super().__init__()
        self.q = torch.nn.Linear(width, width, dtype=torch.float64)
        self.k = torch.nn.Linear(width, width, dtype=torch.float64)
        self.out_dropout = torch.nn.Dropout(0.2)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-2, -1) / math.sqrt(x.shape[-1])
        attn = F.dropout(torch.softmax(scores, dim=-1), 0.1, self.training)
        return self.out_dropout(attn @ x)


def _leaves_and_grads(model, x, seed, cotangent, *constants):
    leaves = [x, *model.parameters()]
    torch.manual_seed(seed)
    out = model(x, *constants)
    return out, torch.autograd.grad(out, leaves, cotangent)


def test_from_torch_drops_in_dropout_and_follows_train_and_eval():
    torch.manual_seed(0)
    original = DroppedAttention().train()
    model = DroppedAttention().train()
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    cotangent = torch.randn(2, 5, 4, dtype=torch.float64)
    state = torch.get_rng_state()
    replacement = drop_in(model, x.detach())
    assert torch.equal(torch.get_rng_state(), state)  # the trace's own draws are not the run's
    assert any("Z_" in line for line in sa.derive(replacement.spec).text().splitlines())
    for seed in (3, 4):  # train(): torch's own draws, seeded alike
        want, want_grads = _leaves_and_grads(original, x, seed, cotangent)
        got, got_grads = _leaves_and_grads(model, x, seed, cotangent)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    original.eval(), model.eval()  # eval(): no draws, the function without dropout
    state = torch.get_rng_state()
    torch.testing.assert_close(model(x), original(x), rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.get_rng_state(), state)
    original.train(), model.train()  # and back
    want, _ = _leaves_and_grads(original, x, 8, cotangent)
    got, _ = _leaves_and_grads(model, x, 8, cotangent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_multi_head_module_drops_in_with_dropout_on_every_heads_weights():
    """BERT's self-attention (view + permute into heads, nn.Dropout on the 4-D weights) in train(): the drop-in's
    mask is torch's (seeded alike), output and every gradient; another seed, another output."""
    from torch_corpus.modules import BertSelfAttention

    torch.manual_seed(1)
    original = BertSelfAttention(8, 2).double().train()
    model = BertSelfAttention(8, 2).double().train()
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    drop_in(model, x.detach())
    cotangent = torch.randn(2, 5, 8, dtype=torch.float64)
    want, want_grads = _leaves_and_grads(original, x, 12, cotangent)
    got, got_grads = _leaves_and_grads(model, x, 12, cotangent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(_leaves_and_grads(model, x, 13, cotangent)[0], got)


class SdpaAttention(torch.nn.Module):
    """Two heads through F.scaled_dot_product_attention with dropout_p while training (Hugging Face's pattern)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x, mask=None):
        h = self.qkv(x).view(*x.shape[:-1], 2, 4).transpose(1, 2)
        y = F.scaled_dot_product_attention(h, h, h, attn_mask=mask, dropout_p=0.1 if self.training else 0.0)
        return y.transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_dropout_p_drops_in_with_torchs_mask(masked):
    """SDPA's dropout_p in train(), with a bool attn_mask or none: the node on the weights; on CPU torch's math path
    draws as F.dropout, so seeded alike the drop-in's output and gradients are torch's; eval() (dropout_p = 0) the
    same without draws."""
    torch.manual_seed(0)
    original, model = SdpaAttention().train(), SdpaAttention().train()
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    mask = (torch.ones(5, 5, dtype=torch.bool).tril(),) if masked else ()
    drop_in(model, x.detach(), *mask)
    cotangent = torch.randn(2, 5, 8, dtype=torch.float64)
    for seed in (3, 4):
        want, want_grads = _leaves_and_grads(original, x, seed, cotangent, *mask)
        got, got_grads = _leaves_and_grads(model, x, seed, cotangent, *mask)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.eval()(x, *mask), original.eval()(x, *mask), rtol=1e-10, atol=1e-12)


def test_check_backward_refuses_a_module_that_drops_out_in_one_line():
    """A hand-written backward of a random forward cannot be checked against one fixed mask: refused, in train()."""
    model = DroppedAttention().train()
    with pytest.raises(SymattnError, match="check_backward: the traced function drops out while training"):
        sa.check_backward(model, lambda module, x, g: None, torch.randn(2, 5, 4, dtype=torch.float64))


def test_two_dropouts_of_the_same_values_are_refused_not_merged():
    """dropout(x) + dropout(x) draws two independent masks; the language's one node of (x, p) would draw one (2 x ⊙ Z:
    another distribution, without a word): from_torch refuses the second in one line."""

    def twice(x):
        return torch.nn.functional.dropout(x, 0.1, True) + torch.nn.functional.dropout(x, 0.1, True)

    with pytest.raises(SymattnError, match="a second dropout") as refused:
        sa.from_torch(twice, torch.randn(2, 5, 4, dtype=torch.float64))
    assert "\n" not in str(refused.value)
