"""Dropout in the memory-efficient variant (issue 57): each block of rows of the mask Z_p is drawn from a seed the call
draws (torch's generator, or the caller's rng) and the block's identity (``dropout_block``: the seed, the mask's
stream, the block's first row), never whole; the backward, recomputing the blocks of P, draws the same blocks again
from the saved seed.

Specs: dropout on the attention weights (no mask; a causal mask argument, whose blocks skip keys; a sliding window
of positions, whose key range moves; per head), dropout on the scores and on the weights (two masks, two streams),
and weights made entrywise of P without a draw (P ⊙ P, a decay P ⊙ [0.9^|i − j|], through the same blocks). Each
NumPy and torch module (several blocks, n ≠ m both ways) must match torch autograd of an independent forward,
float64, whose mask the test rebuilds block by block with the module's own helper from the seed and stream the
module drew with, and the backward's blocks must be the forward's; gradcheck and the JVP's central difference with
the seed reset before each evaluation; the same seed the same numbers, another seed others; the keep rate within 3σ
of 1 − p; training=False exactly the spec without dropout, drawing nothing; no saved tensor of n × m entries at n =
m = 384. A mask outside the loop (dropout of Q, of O: n × d) is drawn whole, as the standard module draws it. So is
the hvp's mask (the second closed form takes its arrays whole); forward-mode AD and a second derivative through the
autograd Function are refused while training, as in the standard module.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest
import sympy as sp
from saved import saved_sizes

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, m, d = dim("n"), dim("m"), dim("d")
P_DROP, P_SCORES, BLOCK, HEADS = 0.2, 0.3, 3, 2
SIZES = [(8, 7), (7, 10)]
KINDS = ("plain", "masked", "window", "heads", "twice", "squared", "decay")
DRAWLESS = ("squared", "decay")  # weights made of P without a draw: P ⊙ P, P ⊙ [0.9^|i − j|]


def _window(i, j):
    return sp.Piecewise((0, (j <= i) & (i - j < 3)), (-sp.oo, True))


def _spec(kind: str, p: float = P_DROP) -> sa.Spec:
    width = HEADS * d if kind == "heads" else d
    q, k, v = sp.MatrixSymbol("Q", n, width), sp.MatrixSymbol("K", m, width), sp.MatrixSymbol("V", m, width)
    constants = (sp.MatrixSymbol("M", n, m),) if kind == "masked" else ()
    if kind == "heads":
        qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
        output = sa.merge_heads(sa.dropout(sa.softmax(qh @ kh.T / sp.sqrt(d)), p) @ vh, HEADS)
        return sa.Spec(name=f"dm_{kind}", summary="heads", inputs=(q, k, v), output=output)
    scores = q * k.T / sp.sqrt(d)
    scores = scores + constants[0] if constants else scores
    scores = scores + sa.entries(n, m, _window).expr if kind == "window" else scores
    scores = sa.dropout(scores, P_SCORES) if kind == "twice" else scores
    weights = sa.softmax(scores)
    decay = sa.entries(n, m, lambda i, j: sp.Rational(9, 10) ** sp.Abs(i - j))
    if kind in DRAWLESS:
        weights = sa.hadamard(weights, weights if kind == "squared" else decay)
    else:
        weights = sa.dropout(weights, p)
    name = f"dm_{kind}_{str(p).replace('.', '_')}"
    return sa.Spec(name=name, summary="dropped", inputs=(q, k, v), output=weights * v, constants=constants)


@functools.cache
def _module(kind: str, backend: str, variant: str = "memeff", p: float = P_DROP) -> types.ModuleType:
    spec = _spec(kind, p)
    module = types.ModuleType(f"{spec.name}_{backend}_{variant}")
    exec(compile(codegen.render(spec, backend, variant, second_order=False), module.__name__, "exec"), module.__dict__)
    return module


class Draws:
    """The module's dropout_block calls, recorded: (seed, stream, first row, the batch and rows of the block, cols)
    and the block returned, in call order."""

    def __init__(self, module):
        self.module, self.helper, self.calls = module, module.dropout_block, []

    def __enter__(self):
        def recorded(like, p, seed, stream, block, keys, cols):
            z = self.helper(like, p, seed, stream, block, keys, cols)
            self.calls.append(((seed, stream, block.start, tuple(like.shape[:-1]), cols), p, _numpy(z)))
            return z

        self.module.dropout_block = recorded
        return self

    def __exit__(self, *exc):
        self.module.dropout_block = self.helper

    def whole(self, stream: int, ones) -> np.ndarray:
        """The stream's whole mask, rebuilt block by block with the helper from what the calls drew with (every
        key): a function of the seed, the stream and the block alone."""
        blocks = {}
        for (seed, s, start, shape, cols), p, _ in self.calls:
            if s == stream:
                blocks[start] = _numpy(
                    self.helper(ones((*shape, cols)), p, seed, s, slice(start, start + BLOCK), slice(0, cols), cols)
                )
        return np.concatenate([blocks[start] for start in sorted(blocks)], axis=-2)

    def streams(self) -> list[int]:
        return sorted({call[0][1] for call in self.calls})


def _numpy(x) -> np.ndarray:
    """A copy (the module writes into the block it was given)."""
    return np.array(x.numpy() if isinstance(x, torch.Tensor) else x, copy=True)


def _inputs(kind, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, cols = size
    width = HEADS * 2 if kind == "heads" else 3
    tensors = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (rows, cols, cols)]
    cotangent = torch.randn(2, rows, width, generator=g, dtype=torch.float64)
    return tensors, cotangent


def _softmax(scores):
    """softmax of rows that may be all −∞: zeros there (as the modules give)."""
    empty = torch.isinf(scores).all(dim=-1, keepdim=True)
    return torch.where(empty, 0.0, torch.softmax(torch.where(empty, 0.0, scores), dim=-1))


def reference(kind, q, k, v, masks):
    """The spec's forward in torch, written independently, with the given masks."""
    if kind == "heads":

        def heads(x):
            return x.view(*x.shape[:-1], HEADS, 2).transpose(-3, -2)

        weights = torch.softmax(heads(q) @ heads(k).mT / math.sqrt(2), dim=-1) * masks[0]
        return (weights @ heads(v)).transpose(-3, -2).reshape(q.shape)
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    if kind == "masked":
        scores = scores.masked_fill(j > i, -math.inf)
    if kind == "window":
        scores = scores.masked_fill((j > i) | (i - j >= 3), -math.inf)
    if kind == "squared":
        return _softmax(scores) ** 2 @ v
    if kind == "decay":
        return _softmax(scores) * 0.9 ** (i - j).abs().double() @ v
    if kind == "twice":  # the scores' mask, then the weights'
        return _softmax(scores * masks[0]) * masks[1] @ v
    return _softmax(scores) * masks[0] @ v


def _run(module, backend, kind, tensors, cotangent, **options):
    """The module's output and gradients (NumPy arrays), torch seeded with 1, NumPy's rng seeded with 5."""
    options |= {"causal": True} if kind == "masked" else {}
    if backend == "torch":
        leaves = [x.clone().requires_grad_() for x in tensors]
        torch.manual_seed(1)
        out = module.forward(*leaves, block_size=BLOCK, **options)
        return out.detach().numpy(), [g.numpy() for g in torch.autograd.grad(out, leaves, cotangent)]
    arrays = [x.numpy() for x in tensors]
    options |= {"rng": np.random.default_rng(5)} if kind not in DRAWLESS else {}
    out, saved = module.forward(*arrays, block_size=BLOCK, **options)
    grads = module.backward(saved, cotangent.numpy())
    return out, [grads[name] for name in "QKV"]


def _twice_masks(draws, ones):
    """The scores' mask and the weights' (their streams told apart by p)."""
    by_p = {p: call[1] for call, p, _ in draws.calls}
    return [draws.whole(by_p[P_SCORES], ones), draws.whole(by_p[P_DROP], ones)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_backward_is_the_derivative_of_the_forward_with_its_draws(kind, backend, size):
    module = _module(kind, backend)
    tensors, cotangent = _inputs(kind, size, seed=len(kind))
    if kind in DRAWLESS:  # no draw: weights made of P alone go through the same blocks
        out, grads = _run(module, backend, kind, tensors, cotangent)
        masks = []
    else:
        with Draws(module) as draws:
            out, grads = _run(module, backend, kind, tensors, cotangent)
        forward, backward = _split(draws.calls)
        assert [c for c, _, _ in forward] == [c for c, _, _ in backward]  # the same blocks, drawn again
        assert all(np.array_equal(f, b) for (_, _, f), (_, _, b) in zip(forward, backward))
        ones = np.ones if backend == "numpy" else functools.partial(torch.ones, dtype=torch.float64)
        masks = _twice_masks(draws, ones) if kind == "twice" else [draws.whole(draws.streams()[0], ones)]
    leaves = [x.clone().requires_grad_() for x in tensors]
    want = reference(kind, *leaves, [torch.tensor(z) for z in masks])
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, w, name in zip(grads, torch.autograd.grad(want, leaves, cotangent), "QKV"):
        np.testing.assert_allclose(got, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def _split(calls):
    """The forward's calls and the backward's (the forward draws each block once, in order, then the backward)."""
    half = len(calls) // 2
    return calls[:half], calls[half:]


def test_gradcheck_and_the_jvp_with_the_seed_reset():
    """torch: gradcheck and the JVP against a central difference, torch.manual_seed before each evaluation; NumPy:
    the JVP with the same rng state as the forward it differentiates."""
    module = _module("plain", "torch")
    tensors, _ = _inputs("plain", (5, 4), seed=3)
    leaves = [x.requires_grad_() for x in tensors]

    def seeded(*xs):
        torch.manual_seed(11)  # every evaluation draws the same seed, so the same blocks
        return module.forward(*xs, block_size=2)

    assert torch.autograd.gradcheck(seeded, leaves, eps=1e-6, atol=1e-8)
    inputs = [x.detach() for x in tensors]
    tangents = [torch.randn_like(x) for x in inputs]
    torch.manual_seed(9)
    _, tangent = module.jvp(*inputs, dict(zip("QKV", tangents)), block_size=2)
    eps = 1e-6

    def at(sign):
        torch.manual_seed(9)
        return module.forward(*(x + sign * eps * t for x, t in zip(inputs, tangents)), block_size=2)

    torch.testing.assert_close(tangent, (at(1) - at(-1)) / (2 * eps), rtol=1e-6, atol=1e-8)
    numpy_module = _module("plain", "numpy")  # NumPy: the same rng state, the same seed
    arrays = {name: x.numpy() for name, x in zip("QKV", inputs)}
    directions = {name: t.numpy() for name, t in zip("QKV", tangents)}
    out, tangent = numpy_module.jvp(*arrays.values(), directions, block_size=2, rng=np.random.default_rng(3))

    def moved(sign):
        points = (arrays[name] + sign * eps * directions[name] for name in "QKV")
        return numpy_module.forward(*points, block_size=2, rng=np.random.default_rng(3))[0]

    np.testing.assert_array_equal(
        out, numpy_module.forward(*arrays.values(), block_size=2, rng=np.random.default_rng(3))[0]
    )
    np.testing.assert_allclose(tangent, (moved(1) - moved(-1)) / (2 * eps), rtol=1e-6, atol=1e-8)


def test_the_seed_reproduces_a_call_and_another_seed_draws_other_blocks():
    module = _module("plain", "torch")
    (q, k, v), _ = _inputs("plain", (9, 6))
    torch.manual_seed(1)
    first = module.forward(q, k, v, block_size=BLOCK)
    torch.manual_seed(1)
    assert torch.equal(first, module.forward(q, k, v, block_size=BLOCK))
    torch.manual_seed(2)
    assert not torch.allclose(first, module.forward(q, k, v, block_size=BLOCK))
    state = torch.get_rng_state()  # the caller's generator: its state alone decides, the global one untouched
    own = module.forward(q, k, v, block_size=BLOCK, rng=torch.Generator().manual_seed(4))
    assert torch.equal(own, module.forward(q, k, v, block_size=BLOCK, rng=torch.Generator().manual_seed(4)))
    assert torch.equal(torch.get_rng_state(), state)
    numpy_module = _module("plain", "numpy")
    arrays = [x.numpy() for x in (q, k, v)]
    out = numpy_module.forward(*arrays, block_size=BLOCK, rng=np.random.default_rng(3))[0]
    assert np.array_equal(out, numpy_module.forward(*arrays, block_size=BLOCK, rng=np.random.default_rng(3))[0])
    assert not np.allclose(out, numpy_module.forward(*arrays, block_size=BLOCK, rng=np.random.default_rng(4))[0])
    with pytest.raises(TypeError, match="dropout while training draws its mask from rng"):
        numpy_module.forward(*arrays)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_the_keep_rate_is_one_minus_p_within_three_sigma_and_blocks_differ(backend):
    module = _module("plain", backend, p=0.3)
    q, k, v = (torch.ones(1, 300, 2, dtype=torch.float64) for _ in range(3))
    with Draws(module) as draws:
        if backend == "torch":
            module.forward(q, k, v, block_size=60)
        else:
            module.forward(*(x.numpy() for x in (q, k, v)), block_size=60, rng=np.random.default_rng(0))
    blocks = [z for _, _, z in draws.calls]
    assert len(blocks) == 5 and not any(np.array_equal(blocks[0], z) for z in blocks[1:])
    z = np.concatenate(blocks, axis=-2)
    kept = z != 0
    assert np.all(z[kept] == np.float64(1) / np.float64(0.7))  # kept entries scaled by 1/(1 − p)
    assert abs(kept.mean() - 0.7) <= 3 * math.sqrt(0.3 * 0.7 / kept.size)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("kind", ["plain", "masked"])
def test_training_false_is_the_spec_without_dropout_and_draws_nothing(kind, backend):
    module, plain = _module(kind, backend), _module(kind, backend, p=0)
    tensors, _ = _inputs(kind, (8, 7))
    options = {"block_size": BLOCK} | ({"causal": True} if kind == "masked" else {})
    if backend == "numpy":
        arrays = [x.numpy() for x in tensors]
        got = module.forward(*arrays, training=False, **options)[0]
        np.testing.assert_array_equal(got, plain.forward(*arrays, **options)[0])
        return
    state = torch.get_rng_state()
    got = module.forward(*tensors, training=False, **options)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(got, plain.forward(*tensors, **options), rtol=0, atol=0)
    layer = (module.DmPlain02 if kind == "plain" else module.DmMasked02)(block_size=BLOCK)  # eval(): no draw
    causal = {"causal": True} if kind == "masked" else {}
    torch.testing.assert_close(layer.eval()(*tensors, **causal), got, rtol=0, atol=0)


def test_no_saved_tensor_holds_n_by_m_entries():
    """At n = m = 384 the memory-efficient module saves Q, K, V, L and a seed (a Python int): nothing of n·m entries,
    where the standard module saves the whole mask (the test's control)."""
    rows = 384
    tensors = [torch.randn(1, rows, 4, dtype=torch.float64) for _ in range(3)]
    memeff = saved_sizes(_module("plain", "torch"), [x.clone() for x in tensors], block_size=64)
    assert memeff and max(memeff) < rows * rows
    standard = saved_sizes(_module("plain", "torch", "standard"), [x.clone() for x in tensors])
    assert max(standard) >= rows * rows
    saved = _module("plain", "numpy").forward(*(x.numpy() for x in tensors), rng=np.random.default_rng(0))[1]
    assert max(np.size(x) for x in saved.values()) < rows * rows
    assert isinstance(saved["drop_seed"], int)


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_mask_outside_the_loop_is_drawn_whole_as_the_standard_variant_draws_it(where):
    """Dropout of Q (before the loop) or of O (after it): an n × d mask drawn whole from the same generator as the
    standard module draws it, so seeded alike the two variants give the same output and gradients."""
    q, k, v = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d)
    if where == "input":
        output = sa.softmax(sa.dropout(q, P_DROP) * k.T / sp.sqrt(d)) * v
    else:
        output = sa.dropout(sa.softmax(q * k.T / sp.sqrt(d)) * v, P_DROP)
    spec = sa.Spec(name=f"dropped_{where}", summary="dropped", inputs=(q, k, v), output=output)
    modules = []
    for variant in ("memeff", "standard"):
        module = types.ModuleType(f"{spec.name}_{variant}")
        exec(
            compile(codegen.render(spec, "torch", variant, second_order=False), module.__name__, "exec"),
            module.__dict__,
        )
        modules.append(module)
    tensors, cotangent = _inputs("plain", (8, 7), seed=2)
    results = []
    for module, options in zip(modules, ({"block_size": BLOCK}, {})):
        leaves = [x.clone().requires_grad_() for x in tensors]
        torch.manual_seed(6)
        out = module.forward(*leaves, **options)
        results.append([out, *torch.autograd.grad(out, leaves, cotangent)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_recomputing_the_forward_under_autograd_is_refused_while_training():
    """As in the standard module: torch.func.jvp and a second derivative through the autograd Function would
    recompute the forward, drawing another seed: refused in one line while training, computed in eval."""
    second = types.ModuleType("dm_second")
    source = codegen.render(_spec("plain"), "torch", "memeff")
    exec(compile(source, second.__name__, "exec"), second.__dict__)
    inputs = _inputs("plain", (3, 4), seed=6)[0]
    with pytest.raises(RuntimeError, match=r"forward-mode AD .* dropout while training is not supported"):
        torch.func.jvp(second.forward, tuple(inputs), tuple(torch.ones_like(x) for x in inputs))
    leaves = [x.clone().requires_grad_() for x in inputs]
    (grad,) = torch.autograd.grad(second.forward(*leaves).sum(), leaves[:1], create_graph=True)
    with pytest.raises(RuntimeError, match=r"a second derivative .* dropout while training is not supported"):
        torch.autograd.grad(grad.sum(), leaves)
    evaluated = functools.partial(second.forward, training=False, block_size=2)
    assert torch.autograd.gradgradcheck(evaluated, [x.detach().requires_grad_() for x in leaves])


def test_the_hvp_draws_a_whole_mask_as_the_standard_module_does():
    """The second closed form takes its arrays whole: the memory-efficient module's hvp draws the whole mask once,
    from the same generator, so seeded alike it is the standard module's."""
    modules = []
    for variant in ("memeff", "standard"):
        module = types.ModuleType(f"dm_hvp_{variant}")
        exec(compile(codegen.render(_spec("plain"), "torch", variant), module.__name__, "exec"), module.__dict__)
        modules.append(module)
    tensors, cotangent = _inputs("plain", (6, 5), seed=7)
    directions = {name: torch.randn_like(x) for name, x in zip("QKV", tensors)}
    products = []
    for module in modules:
        torch.manual_seed(8)
        products.append(module.hvp(*tensors, cotangent, directions))
    for name in "QKV":
        torch.testing.assert_close(products[0][name], products[1][name], rtol=1e-10, atol=1e-12)
