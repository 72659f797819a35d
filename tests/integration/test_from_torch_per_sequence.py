"""sa.from_torch of constants that vary along the batch, one per sequence: a scale or a bias per sequence, per head
and sequence, per token (a prefix length made into a weight by comparisons with positions), and a scale computed
from a forward argument. Each is the spec's constant C of its per-sequence shape (1 × 1, n × 1, …) read at positions,
[C_ij], which generated code takes with the inputs' batch axes and the drop-in passes so; the drop-in matches torch
autograd of the original (output and every gradient, float64) at a new length, new inputs and new constants, and at
another batch size where the constant comes from an argument. A batch size the constant does not fit is refused in
one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from rendered import close, load  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.lang.positions import tables_read  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

B, H, D = 2, 2, 4
PER_HEAD_AND_SEQUENCE = torch.tensor([[0.5, 2.0], [1.5, -1.0]]).view(B, H, 1, 1)


class Scaled(torch.nn.Module):
    """softmax(q kᵀ ⊙ c) v, or sigmoid(q kᵀ + c) v (an added bias is no shift of a softmax), c a buffer with batch
    axes."""

    def __init__(self, c: torch.Tensor, op: str = "mul") -> None:
        super().__init__()
        self.register_buffer("scale", c)
        self.op = op

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2)
        p = torch.softmax(s * self.scale, -1) if self.op == "mul" else torch.sigmoid(s + self.scale)
        return p @ v


class PrefixWeighted(torch.nn.Module):
    """Each sequence's first prefix[b] query rows weighted 2, the rest ½: a per-token (B, 1, n, 1) constant made from
    an integer argument by a comparison with positions (issue 52's per-sequence prefix)."""

    def forward(self, q, k, v, prefix):
        rows = torch.arange(q.shape[-2])[None, :] < prefix[:, None]
        w = torch.where(rows, 2.0, 0.5).to(q.dtype)[:, None, :, None]
        return torch.softmax(q @ k.transpose(-1, -2) * w, -1) @ v


class Tempered(torch.nn.Module):
    """Scores divided by a per-sequence temperature passed to forward as integers."""

    def forward(self, q, k, v, temperature):
        return torch.softmax(q @ k.transpose(-1, -2) / temperature.to(q.dtype).view(-1, 1, 1, 1), -1) @ v


class HeadsScaled(torch.nn.Module):
    """Projections split into H heads, the per-head scores (B, H, n, n) times a buffer (B, h, 1, 1) under a softmax,
    or plus it under a sigmoid."""

    def __init__(self, c: torch.Tensor, op: str = "mul") -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.register_buffer("scale", c)
        self.op = op

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2)
        p = torch.softmax(s * self.scale, -1) if self.op == "mul" else torch.sigmoid(s + self.scale)
        return (p @ v).transpose(1, 2).reshape(b, n, width)


def _gradients(call, params: list, tensors: list, rest: tuple, cotangent=None):
    """call(*tensors, *rest) and the gradients of ⟨G, output⟩ with respect to the tensors and the parameters."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = call(*leaves, *rest)
    cotangent = torch.randn_like(out) if cotangent is None else cotangent
    return out.detach(), torch.autograd.grad(out, [*leaves, *params], cotangent), cotangent


def _matches(model, closed: ClosedForm, tensors: list, rest: tuple = (), what: str = "") -> None:
    """The drop-in (closed) and the original's autograd agree at these arguments: output and every gradient."""
    params = list(model.parameters())
    out, grads, cotangent = _gradients(closed, params, tensors, rest)
    want_out, want, _ = _gradients(model, params, tensors, rest, cotangent)
    close(out, want_out, f"{what}: output")
    for k, (a, b) in enumerate(zip(grads, want)):
        close(a, b, f"{what}: gradient {k}")


def _qkv(batch: int, n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, H, n, D, dtype=torch.float64, generator=g) for _ in range(3)]


def _per_sequence_constant(spec: sa.Spec):
    """The spec's one constant, read at positions (so with the inputs' batch axes in generated code)."""
    (c,) = spec.constants
    assert c in tables_read(spec.output), spec.output
    return c


BUFFERS = {  # the buffer, how it meets the scores, whether it is per key (1 × m) rather than 1 × 1
    "scale per sequence (B, 1, 1, 1)": (torch.tensor([0.5, 2.0]).view(B, 1, 1, 1), "mul", False),
    "bias per sequence (B, 1, 1, 1)": (torch.tensor([-1.0, 3.0]).view(B, 1, 1, 1), "add", False),
    "scale per head and sequence (B, H, 1, 1)": (PER_HEAD_AND_SEQUENCE, "mul", False),
    "bias per key (B, 1, 1, m)": (torch.linspace(-1, 1, B * 5).view(B, 1, 1, 5), "add", True),
}


@pytest.mark.parametrize("name", list(BUFFERS))
def test_a_buffer_per_sequence_is_a_constant_with_batch_axes_and_drops_in(name):
    c, op, per_key = BUFFERS[name]
    model = Scaled(c.double(), op)
    closed = ClosedForm(model, tuple(_qkv(B, 5, 0)))
    constant = _per_sequence_constant(closed.spec)
    assert constant.shape[0] == 1 and (constant.shape[1] != 1) == per_key, constant.shape
    n = 5 if per_key else 7  # a per-key buffer fixes the keys' length
    _matches(model, closed, _qkv(B, n, 1), what=f"{name} at n = {n}")
    with torch.no_grad():
        model.scale.mul_(-0.75)  # new buffer values: the constant program rebuilds C from them at the call
    _matches(model, closed, _qkv(B, n, 2), what=f"{name}, buffer changed")


def test_a_per_token_constant_from_an_argument_follows_each_call():
    """w (B, 1, n, 1) from prefix lengths: the spec's n × 1 constant; new lengths, a new n, another batch size."""
    model = PrefixWeighted()
    closed = ClosedForm(model, (*_qkv(B, 5, 0), torch.tensor([2, 4])))
    constant = _per_sequence_constant(closed.spec)
    assert constant.shape[1] == 1 and constant.shape[0] != 1
    _matches(model, closed, _qkv(B, 5, 1), (torch.tensor([5, 1]),), "new prefixes")
    _matches(model, closed, _qkv(3, 7, 2), (torch.tensor([6, 0, 3]),), "batch 3, n = 7")


def test_a_per_sequence_scale_computed_from_an_argument_takes_another_batch_size():
    model = Tempered()
    closed = ClosedForm(model, (*_qkv(B, 5, 0), torch.tensor([2, 4])))
    assert tuple(_per_sequence_constant(closed.spec).shape) == (1, 1)
    _matches(model, closed, _qkv(B, 6, 1), (torch.tensor([1, 3]),), "new temperatures")
    _matches(model, closed, _qkv(4, 7, 2), (torch.tensor([3, 1, 5, 2]),), "batch 4")


class DocumentMask(torch.nn.Module):
    """Issue 52's document mask: a key is seen where its document id is the query's, ids one row per sequence."""

    def forward(self, q, k, v, doc):
        same = doc[:, None, :, None] == doc[:, None, None, :]
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~same, float("-inf")), -1) @ v


class PrefixLM(torch.nn.Module):
    """Issue 52's prefix-LM mask: causal, but each sequence's first prefix[b] keys seen by every query."""

    def forward(self, q, k, v, prefix):
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        allowed = (j <= i)[None] | (j[None] < prefix[:, None, None])
        return torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~allowed[:, None], float("-inf")), -1) @ v


MASKS = {  # the model, its example's constant argument, the new calls' (batch 2 = H: each head its own sequence's)
    "document": (
        DocumentMask,
        torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]),
        [[0, 0, 0, 1, 1, 1, 1], [0, 1, 2] * 2 + [2]],
    ),
    "prefix_lm": (PrefixLM, torch.tensor([2, 4]), [1, 6]),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_a_mask_per_sequence_meeting_inputs_with_batch_and_head_axes_drops_in(name):
    """A bool mask (B, 1, n, m) made per sequence, the inputs (B, H, n, d): the additive mask M, batched along B with
    each head of a sequence given that sequence's mask (not one head per sequence where B = H)."""
    make, example, new = MASKS[name]
    model = make()
    closed = ClosedForm(model, (*_qkv(B, 5, 0), example))
    assert [str(c.name) for c in closed.spec.constants] == ["M"]
    _matches(model, closed, _qkv(B, 7, 1), (torch.tensor(new),), f"{name}, batch 2")
    more = torch.cat([torch.tensor(new), torch.tensor(new)[:1].flip(-1)])
    _matches(model, closed, _qkv(3, 7, 2), (more,), f"{name}, batch 3")


def test_a_constant_equal_for_every_sequence_at_the_example_traces_again_where_it_varies():
    """Equal along the batch at the trace, C is one constant (its first entry, guarded); a call where it varies, a new
    temperature or a buffer changed, traces again, and C is then one per sequence."""
    model = Tempered()
    closed = ClosedForm(model, (*_qkv(B, 5, 0), torch.tensor([2, 2])))
    assert not tables_read(closed.spec.output)  # one constant for every sequence
    _matches(model, closed, _qkv(B, 5, 1), (torch.tensor([2, 2]),), "equal temperatures")
    _matches(model, closed, _qkv(B, 5, 2), (torch.tensor([1, 3]),), "temperatures that differ")
    scaled = Scaled(torch.ones(B, 1, 1, 1, dtype=torch.float64))
    closed = ClosedForm(scaled, tuple(_qkv(B, 5, 0)))
    with torch.no_grad():
        scaled.scale[1] = 3.0
    _matches(scaled, closed, _qkv(B, 5, 3), what="a buffer changed to differ per sequence")


HEADS = {
    "scale per sequence (B, 1, 1, 1)": (torch.tensor([0.5, 2.0]).view(B, 1, 1, 1), "mul"),
    "scale per head and sequence (B, H, 1, 1)": (PER_HEAD_AND_SEQUENCE, "mul"),
    "bias per head and sequence (B, H, 1, 1)": (PER_HEAD_AND_SEQUENCE, "add"),
}


@pytest.mark.parametrize("name", list(HEADS))
def test_a_buffer_per_sequence_meeting_per_head_scores_drops_in(name):
    """At per-head values the constant is per head, r × (H·c), split into the heads (shared by them or not)."""
    c, op = HEADS[name]
    torch.manual_seed(0)
    model = HeadsScaled(c.double(), op).double()
    closed = ClosedForm(model, (torch.randn(B, 5, H * D, dtype=torch.float64),))
    (constant,) = closed.spec.constants
    assert constant in tables_read(closed.spec.output)
    for n, seed in ((5, 1), (7, 2)):
        x = torch.randn(B, n, H * D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        _matches(model, closed, [x], what=f"{name} at n = {n}")


@pytest.mark.parametrize("backend", ["torch", "numpy", "jax"])
def test_the_generated_module_takes_the_constant_with_the_inputs_batch_axes(backend):
    """Generated forward of a spec with a per-token constant (B, 1, n, 1), called with C as (B, H, n, 1): each
    sequence's own weights."""
    if backend == "jax":
        pytest.importorskip("jax", reason="jax is an optional extra").config.update("jax_enable_x64", True)
    c = torch.tensor([0.5, 2.0], dtype=torch.float64).view(B, 1, 1, 1) * torch.arange(1.0, 7.0).view(1, 1, 6, 1)
    q, k, v = _qkv(B, 6, 3)
    spec = sa.from_torch(Scaled(c), *_qkv(B, 6, 0))
    assert _per_sequence_constant(spec).shape[1] == 1
    module = load(spec, backend)
    given = c.expand(B, H, 6, 1)
    if backend == "torch":
        out = module.forward(q, k, v, given).detach()
    else:
        out = module.forward(q.numpy(), k.numpy(), v.numpy(), given.numpy())
        out = out[0] if isinstance(out, tuple) else out
    close(out, torch.softmax(q @ k.mT * c, -1) @ v, f"{backend}: output")


def test_a_batch_size_the_constant_does_not_fit_is_refused_in_one_line():
    model = Scaled(torch.tensor([0.5, 2.0], dtype=torch.float64).view(B, 1, 1, 1))
    closed = ClosedForm(model, tuple(_qkv(B, 5, 0)))
    with pytest.raises(sa.SymattnError, match=r"drop_in: the original forward fails at these arguments") as caught:
        closed(*_qkv(3, 5, 1))
    assert "\n" not in str(caught.value)


def test_a_parameter_with_batch_axes_is_refused_in_one_line():
    """A parameter is one matrix shared by every sequence (its gradient summed over them): not one per sequence."""
    model = Scaled(torch.ones(B, 1, 1, 1, dtype=torch.float64))
    del model.scale
    model.scale = torch.nn.Parameter(torch.tensor([0.5, 2.0], dtype=torch.float64).view(B, 1, 1, 1))
    with pytest.raises(sa.SymattnError, match=r"parameter scale of shape \(2, 1, 1, 1\) has leading axes") as caught:
        sa.from_torch(model, *_qkv(B, 5, 0))
    assert "\n" not in str(caught.value)


def test_check_backward_of_a_forward_with_a_constant_per_sequence_is_refused_in_one_line():
    """check_backward's points hold one sequence; a constant of two is no point of it."""

    def backward(module, q, k, v, temperature, g):
        return {}

    with pytest.raises(sa.SymattnError, match=r"check_backward: the constant C has 2 sequences") as caught:
        sa.check_backward(Tempered(), backward, *_qkv(B, 5, 0), torch.tensor([2, 4]))
    assert "\n" not in str(caught.value)
