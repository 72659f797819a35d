"""The drop-ins while training with dropout: torch's modules built with the same arguments, in train().

``MultiheadAttention(dropout=p)`` drops out the weights, D_h = P_h ⊙ Z_p(P_h), its mask drawn from torch's default
generator as torch's module draws it: the same seed gives torch's own output and gradients (float64), either
layout, with a padding mask. ``TransformerEncoderLayer(dropout=p)`` (torch's defaults: post-LN, ReLU, 0.1) drops
out where torch's does (the weights, the attention output, the activation's output, the feed-forward output),
four masks of torch's shapes drawn in torch's order, but not torch's bits (torch's layer draws some of its masks
in the memory layout of transposed intermediates). For both: the same seed reproduces a run, another seed gives
another, the backward is the exact derivative of the forward with the same draws (gradcheck, the seed reset
before each evaluation), dropout=0.0 in train() is eval(), and the kept fraction of the dropped values lies
within 3σ of 1 − p.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from symattn.generated import mha_torch, transformer_block_torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

E, H, FF, L, N = 4, 2, 6, 3, 2
P_DROP = 0.3
RELATIVE = 1e-12


def relative_error(got, want) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def attention_pair(batch_first: bool, dropout: float = P_DROP):
    torch.manual_seed(4)
    kwargs = {"dropout": dropout, "batch_first": batch_first, "dtype": torch.float64}
    ref = torch.nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) / 3)
    ours = mha_torch.MultiheadAttention(E, H, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def layer_pair(norm_first: bool, activation="relu", dropout: float = P_DROP, batch_first: bool = True):
    torch.manual_seed(5)
    kwargs = {"dim_feedforward": FF, "dropout": dropout, "activation": activation, "norm_first": norm_first}
    kwargs |= {"batch_first": batch_first, "dtype": torch.float64}
    ref = torch.nn.TransformerEncoderLayer(E, H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) / 3)
    ours = transformer_block_torch.TransformerEncoderLayer(E, H, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def seeded(run, seed: int = 11):
    """run() with torch's default generator seeded: the draws of one call, made again at each evaluation."""
    torch.manual_seed(seed)
    return run()


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_draws_torchs_masks(batch_first):
    """need_weights=False (torch's layers' call): the output and every gradient torch's, a padding mask among them."""
    ref, ours = attention_pair(batch_first)
    shape = (N, L, E) if batch_first else (L, N, E)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, -1] = True
    cotangent = torch.randn(shape, dtype=torch.float64)
    results = []
    for module in (ref, ours):
        out = seeded(lambda m=module: m(x, x, x, key_padding_mask=padding, need_weights=False)[0])
        grads = torch.autograd.grad((out * cotangent).sum(), [x, *module.parameters()])
        results.append((out, *grads))
    assert max(relative_error(a, b) for a, b in zip(results[1], results[0], strict=True)) <= RELATIVE
    ours.eval()
    assert relative_error(ours(x, x, x, need_weights=False)[0], results[1][0]) > 1e-3  # eval: no dropout


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_backward_is_the_derivative_of_its_draws(norm_first):
    _, ours = layer_pair(norm_first, "relu" if not norm_first else "gelu")
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    weight = ours.linear1.weight
    assert torch.autograd.gradcheck(lambda x, w: seeded(lambda: ours(x)), (x, weight), eps=1e-6, atol=1e-7)
    again, other = seeded(lambda: ours(x)), seeded(lambda: ours(x), seed=12)
    assert torch.equal(seeded(lambda: ours(x)), again) and relative_error(other, again) > 1e-3


def test_encoder_layer_without_dropout_or_in_eval_is_torchs_layer():
    ref, ours = layer_pair(False, dropout=0.0)
    x = torch.randn(N, L, E, dtype=torch.float64)
    assert relative_error(ours.train()(x), ref.eval()(x)) <= RELATIVE  # dropout 0.0 in train(): no draw
    ref, ours = layer_pair(False)
    assert relative_error(ours.eval()(x), ref.eval()(x)) <= RELATIVE


class _Draws(TorchFunctionMode):
    """The shapes of the masks a call draws (``Tensor.bernoulli_``), in order."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "bernoulli_":
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_layer_drops_out_where_torchs_does(batch_first):
    """Four masks, torch's places in torch's order: the weights, the attention output, the activation's output,
    the feed-forward output (each sequence's values, whatever the layout of the argument)."""
    _, ours = layer_pair(False, batch_first=batch_first)
    x = torch.randn((N, L, E) if batch_first else (L, N, E), dtype=torch.float64)
    with _Draws() as draws:
        ours(x)
    assert draws.shapes == [(N, H, L, L), (N, L, E), (N, L, FF), (N, L, E)]
    with _Draws() as draws:
        ours.eval()(x)
    assert draws.shapes == []


def test_the_kept_fraction_is_one_minus_p():
    _, ours = attention_pair(True)
    with torch.no_grad():  # V = X (identity projections, no bias): each output entry a sum of kept weights · x
        ours.in_proj_weight.copy_(torch.eye(E).repeat(3, 1))
        ours.in_proj_bias.zero_()
        ours.out_proj.weight.copy_(torch.eye(E))
        ours.out_proj.bias.zero_()
    rows = 20000
    x = torch.zeros(1, 1, E, dtype=torch.float64).expand(rows, 1, E).clone()
    x[..., 0] = 1.0  # one key per sequence: its weight is 1, its output entry 1/(1 − p) where kept, 0 where dropped
    with torch.no_grad():
        out = ours(x, x, x, need_weights=False)[0][:, 0, 0]
    kept = (out != 0).double().mean().item()
    assert torch.allclose(out[out != 0], torch.full_like(out[out != 0], 1 / (1 - P_DROP)))
    sigma = math.sqrt(P_DROP * (1 - P_DROP) / rows)
    assert abs(kept - (1 - P_DROP)) <= 3 * sigma


def test_the_weights_returned_while_dropping_out_are_torchs():
    """need_weights=True (torch's default) returns the weights that multiply V, D_h = Z_h ⊙ P_h, and takes their
    gradient: torch's, under the same seed, averaged over the heads or per head."""
    ref, ours = attention_pair(True)
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    for average in (True, False):
        results = []
        for module in (ref, ours):
            out, weights = seeded(lambda m=module, a=average: m(x, x, x, average_attn_weights=a))
            loss = (out * out).sum() + (weights * weights.detach().sin()).sum()
            results.append((out, weights, *torch.autograd.grad(loss, [x, *module.parameters()])))
        assert max(relative_error(a, b) for a, b in zip(results[1], results[0], strict=True)) <= RELATIVE


def test_multihead_attention_while_training_matches_torch_in_every_configuration():
    """bias × batch_first × kdim/vdim × need_weights × batched × average_attn_weights, with a float attn_mask: under
    the same seed, output, weights and every gradient torch's (float64)."""
    import itertools

    L_, S_ = 4, 5
    for bias, first, dims, weighted, batched, average in itertools.product(
        (True, False), (True, False), ((None, None), (3, 5)), (True, False), (True, False), (True, False)
    ):
        torch.manual_seed(0)
        kwargs = {"dropout": 0.2, "bias": bias, "kdim": dims[0], "vdim": dims[1], "batch_first": first}
        ref = torch.nn.MultiheadAttention(E, H, dtype=torch.float64, **kwargs)
        ours = mha_torch.MultiheadAttention(E, H, dtype=torch.float64, **kwargs)
        ours.load_state_dict(ref.state_dict())

        def shaped(rows, width, batched=batched, first=first):
            return ((N, rows, width) if first else (rows, N, width)) if batched else (rows, width)

        q = torch.randn(shaped(L_, E), dtype=torch.float64, requires_grad=True)
        k = torch.randn(shaped(S_, dims[0] or E), dtype=torch.float64, requires_grad=True)
        v = torch.randn(shaped(S_, dims[1] or E), dtype=torch.float64, requires_grad=True)
        mask = torch.randn(L_, S_, dtype=torch.float64)
        results = []
        for module in (ref, ours):
            torch.manual_seed(11)  # the same draws for both
            out, weights = module(q, k, v, attn_mask=mask, need_weights=weighted, average_attn_weights=average)
            loss = out.square().sum() + (0 if weights is None else weights.square().sum())
            grads = torch.autograd.grad(loss, [q, k, v, *module.parameters()])
            results.append([out, *([] if weights is None else [weights]), *grads])
        case = (bias, first, dims, weighted, batched, average)
        assert max(relative_error(a, b) for a, b in zip(results[1], results[0], strict=True)) <= RELATIVE, case


class _Masks(TorchFunctionMode):
    """The masks a call draws (each the tensor ``bernoulli_`` filled, divided by 1 − p in place after)."""

    def __init__(self):
        super().__init__()
        self.drawn = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "bernoulli_":
            self.drawn.append(out)
        return out


def _reference_layer(ref, x, masks, norm_first):
    """torch's encoder layer written out with the given masks in its four places (float64, batch first)."""
    F = torch.nn.functional
    attn, (z_weights, z_attention, z_hidden, z_output) = ref.self_attn, masks

    def self_attention(u):
        q, k, v = F.linear(u, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
        heads = lambda t: t.unflatten(-1, (H, E // H)).transpose(1, 2)  # noqa: E731
        weights = torch.softmax(heads(q) @ heads(k).mT / math.sqrt(E // H), dim=-1) * z_weights
        merged = (weights @ heads(v)).transpose(1, 2).flatten(-2)
        return F.linear(merged, attn.out_proj.weight, attn.out_proj.bias) * z_attention

    def feed_forward(u):
        return F.linear(F.relu(ref.linear1(u)) * z_hidden, ref.linear2.weight, ref.linear2.bias) * z_output

    if norm_first:
        y = x + self_attention(ref.norm1(x))
        return y + feed_forward(ref.norm2(y))
    x1 = ref.norm1(x + self_attention(x))
    return ref.norm2(x1 + feed_forward(x1))


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_is_torchs_layer_with_its_masks(norm_first):
    """With the masks the drop-in drew put in the four places of torch's layer (written out), the output and every
    gradient are the drop-in's: each mask multiplies what torch's layer drops out."""
    ref, ours = layer_pair(norm_first)
    x = torch.randn(N, L, E, dtype=torch.float64, requires_grad=True)
    with _Masks() as masks:
        got = ours(x)
    want = _reference_layer(ref, x, [m.detach() for m in masks.drawn], norm_first)
    cotangent = torch.randn_like(want)
    grads = [torch.autograd.grad((y * cotangent).sum(), [x, *m.parameters()]) for y, m in ((got, ours), (want, ref))]
    assert relative_error(got, want) <= RELATIVE
    assert max(relative_error(a, b) for a, b in zip(*grads, strict=True)) <= RELATIVE
