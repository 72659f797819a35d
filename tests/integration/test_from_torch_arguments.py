"""sa.from_torch's specs take the traced code's own tensors (CONTRACT.md, "From PyTorch code"): a bool mask argument
is a constant in its position, named by its parameter, and generated forward reads the bool as the code did; a
module's parameters pass in torch's layout (a bias (d,)), from ``parameters()`` in order or ``state_dict()`` by
name, their gradients coming back in that layout. Each is checked against torch autograd of the original."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from rendered import close, load  # noqa: E402

import symattn as sa  # noqa: E402

N, M, D, D_V, BATCH = 5, 6, 4, 3, (2,)


def masked_fill_attention(q, k, v, mask):
    """mask True where a query may not see a key: masked_fill(mask, -inf)."""
    scores = (q @ k.mT / math.sqrt(q.shape[-1])).masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v, allowed):
    """torch's scaled_dot_product_attention with a bool attn_mask: True where a query may see a key."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def dropped_weights(q, k, v, drop):
    """The attention weights zeroed where drop is True after the softmax: masked_fill(drop, 0.0)."""
    weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1).masked_fill(drop, 0.0)
    return weights @ v


# the function, its mask's name, how the spec reads a bool there, whether True means "allowed", batched or not
MASKED = [
    (masked_fill_attention, "mask", "additive", False, BATCH),
    (masked_fill_attention, "mask", "additive", False, ()),
    (sdpa_attention, "allowed", "additive_false", True, ()),
    (dropped_weights, "drop", "keep", False, ()),
]


def tensors(seed: int, allowed: bool, mask_batch: tuple[int, ...]) -> list:
    """q, k, v (float64, batched) and a bool mask that leaves every query a key (whichever way True reads)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((N, D), (M, D), (M, D_V))
    q, k, v = (torch.randn(*BATCH, rows, width, generator=g, dtype=torch.float64) for rows, width in shapes)
    blocked = torch.rand(*mask_batch, N, M, generator=g) < 0.4
    blocked[..., torch.arange(N), torch.arange(N)] = False
    return [q, k, v, ~blocked if allowed else blocked]


@pytest.mark.parametrize("fn, name, form, allowed, mask_batch", MASKED, ids=lambda x: getattr(x, "__name__", None))
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_a_bool_mask_argument_is_a_constant_in_its_position(fn, name, form, allowed, mask_batch, backend):
    example = tensors(0, allowed, mask_batch)
    spec = sa.from_torch(fn, *example)
    assert spec.input_names == ("q", "k", "v")
    assert [str(c.name) for c in spec.constants] == [name] and dict(spec.bool_forms) == {name: form}
    module = load(spec, backend)
    args = tensors(1, allowed, mask_batch)  # new values: the mask as the function takes it, bool, in its position
    leaves = [a.clone().requires_grad_() for a in args[:3]]
    want_out = fn(*leaves, args[3])
    cotangent = torch.randn(want_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(want_out, leaves, cotangent)
    if backend == "torch":
        leaves = [a.clone().requires_grad_() for a in args[:3]]
        out = module.forward(*leaves, args[3])
        got = dict(zip(spec.input_names, torch.autograd.grad(out, leaves, cotangent)))
    else:
        out, saved = module.forward(*(a.numpy() for a in args))
        got = module.backward(saved, cotangent.numpy())
    close(out.detach() if backend == "torch" else out, want_out.detach(), "output")
    assert set(got) == {"q", "k", "v"}, sorted(got)  # the mask is a constant: no gradient
    for input_name, w in zip(spec.input_names, want):
        close(got[input_name], w, f"∂f/∂{input_name}")


HIDDEN = torch.rand(N, M, generator=torch.Generator().manual_seed(5)) < 0.3  # a fixed bool table (no positions)
HIDDEN[:, 0] = False  # (every row keeps a key)


def causal_and_masked(q, k, v, mask):
    """A fixed bool table held by the code (a constant M of the spec), then the bool argument: masked_fill(mask,
    -inf). (A mask the code makes of positions, torch.ones(n, m).triu(1), is no constant: test_positions_from_torch.)"""
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(HIDDEN, float("-inf"))
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def test_the_bool_argument_comes_first_among_the_constants_and_drop_in_keeps_the_call():
    """The argument's constant before the one made inside (traced first), in the spec and in the generated
    forward's positions; the drop-in passes both in that order."""
    from symattn.trace.dropin import ClosedForm

    example = tensors(0, False, ())
    spec = sa.from_torch(causal_and_masked, *example)
    assert [str(c.name) for c in spec.constants] == ["mask", "M"] and dict(spec.bool_forms) == {"mask": "additive"}
    module = load(spec, "torch")
    args = tensors(1, False, ())
    causal = torch.zeros(N, M, dtype=torch.float64).masked_fill(HIDDEN, -math.inf)
    closed = ClosedForm(causal_and_masked, tuple(example), generated=module)
    cotangent = torch.randn(*BATCH, N, D_V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaves = [a.clone().requires_grad_() for a in args[:3]]
    want = torch.autograd.grad(causal_and_masked(*leaves, args[3]), leaves, cotangent)
    for call in (lambda *xs: module.forward(*xs, args[3], causal), lambda *xs: closed(*xs, args[3])):
        leaves = [a.clone().requires_grad_() for a in args[:3]]
        got = torch.autograd.grad(call(*leaves), leaves, cotangent)
        for input_name, g, w in zip(spec.input_names, got, want):
            close(g, w, f"∂f/∂{input_name}")


class Projected(torch.nn.Module):
    """A LayerNorm and biased Linear projections around single-head attention: every parameter in torch's layout,
    the weights (out, in), the biases and the norm's weight and bias (d,)."""

    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(d, width) for _ in range(3))
        self.out_proj = torch.nn.Linear(width, d)

    def forward(self, x):
        y = self.norm(x)
        q, k, v = self.q_proj(y), self.k_proj(y), self.v_proj(y)
        weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
        return self.out_proj(weights @ v)


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Projected(D, 6).double()
    with torch.no_grad():  # a norm and biases away from their initial 1 and 0
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model, torch.randn(*BATCH, N, D, dtype=torch.float64)


@pytest.mark.parametrize("passed", ["parameters", "state_dict"])
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_a_modules_parameters_pass_in_torchs_layout(passed, backend):
    model, x = _model()
    spec = sa.from_torch(model, x)
    names = [key.replace(".", "_") for key, _ in model.named_parameters()]
    assert spec.input_names == ("x", *names)
    module = load(spec, backend)
    params = list(model.parameters())
    want_out = model(x.clone().requires_grad_())
    cotangent = torch.randn(want_out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [x.clone().requires_grad_(), *params]
    want = dict(zip(spec.input_names, torch.autograd.grad(model(leaves[0]), leaves, cotangent)))

    def call(x_value, values: list):
        if passed == "parameters":
            return module.forward(x_value, *values)
        state = dict(zip((key for key, _ in model.state_dict().items()), values))  # no buffers: the parameters
        return module.forward(x_value, **{key.replace(".", "_"): value for key, value in state.items()})

    if backend == "torch":
        given = [x.clone().requires_grad_(), *(p.detach().clone().requires_grad_() for p in params)]
        out = call(given[0], given[1:])
        got = dict(zip(spec.input_names, torch.autograd.grad(out, given, cotangent)))
        out = out.detach()
    else:
        out, saved = call(x.numpy(), [p.detach().numpy() for p in params])
        got = module.backward(saved, cotangent.numpy())
    close(out, want_out.detach(), "output")
    for name in spec.input_names:
        close(got[name], want[name], f"∂f/∂{name}")
    assert np.shape(got["q_proj_bias"]) == (6,) and np.shape(got["norm_weight"]) == (D,)
