"""sa.from_torch of constants and masks with batch and head axes, as library attention makes them: T5's zero
position_bias (1, H, n, n), ALiBi's per-head distances, a padding mask expanded to (B, H, n, m), a bool mask per
head, sdpa's float per-head attn_mask, position tables (B, 1, n, d) equal for every sequence. Each traces, and the
drop-in matches torch autograd of the original (output and every gradient) at new inputs, batch size and length;
a constant varying along the batch (and the heads) is a constant per sequence."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rendered import close, load  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

D, H = 8, 2


def _keep(lengths: list[int], n: int) -> torch.Tensor:
    return torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]


class HeadsAttention(torch.nn.Module):
    """Self-attention whose scores meet a constant of the kind named (``kind``) before the softmax."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(D, D) for _ in range(3))
        self.kind = kind
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]).view(1, H, 1, 1))

    def heads(self, x):
        return x.view(*x.shape[:2], H, D // H).transpose(1, 2)

    def forward(self, hidden_states, mask):
        B, n, _ = hidden_states.shape
        q, k, v = (self.heads(f(hidden_states)) for f in (self.query, self.key, self.value))
        if self.kind == "table":  # a position table (B, 1, n, d) equal for every sequence, as RoPE's cos
            table = torch.arange(n, dtype=q.dtype)[:, None].expand(n, D // H).cos()[None, None].expand(B, 1, n, D // H)
            q = q * table
        scores = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        if self.kind == "t5_zero_bias":  # T5 without relative attention bias
            scores += torch.zeros((1, H, n, n), dtype=scores.dtype)
        elif self.kind == "alibi":  # per-head slopes times the distances: (1, H, n, n), different per head
            distance = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().to(scores.dtype)
            scores = scores - self.slopes * distance
        elif self.kind == "expanded_padding":  # a bool (B, 1, 1, n) padding mask expanded to (B, H, n, n)
            scores = scores.masked_fill(~mask[:, None, None, :].expand(B, H, n, n), float("-inf"))
        elif self.kind == "bool_per_head":  # head 0 sees everything, head 1 is causal
            causal = torch.ones(n, n, dtype=torch.bool).triu(1)
            per_head = torch.stack([torch.zeros_like(causal), causal])[None]
            scores = scores.masked_fill(per_head, torch.finfo(scores.dtype).min)
        elif self.kind == "keep_per_head":  # a 0/1 (1, H, n, n) mask filled with 0 after the softmax
            keep = torch.stack([torch.ones(n, n, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()])
            probs = torch.softmax(scores, dim=-1).masked_fill(~keep[None], 0.0)
            return self.merge(probs @ v)
        if self.kind == "sdpa_float_per_head":
            bias = -self.slopes * (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().to(q.dtype)
            return self.merge(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias))
        return self.merge(torch.softmax(scores, dim=-1) @ v)

    def merge(self, context):
        context = context.transpose(1, 2)
        return context.reshape(*context.shape[:2], D)


KINDS = ["table", "t5_zero_bias", "alibi", "expanded_padding", "bool_per_head", "keep_per_head", "sdpa_float_per_head"]
PER_HEAD = {"alibi", "bool_per_head", "keep_per_head", "sdpa_float_per_head"}  # a constant C split into the heads


def _model(kind: str) -> HeadsAttention:
    torch.manual_seed(0)
    return HeadsAttention(kind).double()


def _want(model, x, mask, cotangent):
    leaves = [x.clone().requires_grad_(), *model.parameters()]
    out = model(leaves[0], mask)
    return out.detach(), torch.autograd.grad(out, leaves, cotangent)


@pytest.mark.parametrize("kind", KINDS)
def test_a_constant_with_batch_and_head_axes_traces_and_drops_in(kind):
    model = _model(kind)
    example = (torch.randn(2, 5, D, dtype=torch.float64), _keep([5, 4], 5))
    spec = sa.from_torch(model, *example)
    heads = [c for c in spec.constants if c.shape[1] == H * c.shape[0]]
    assert bool(heads) == (kind in PER_HEAD), spec.constants
    closed = ClosedForm(model, example)
    for seed, (batch, n, lengths) in enumerate([(2, 5, [3, 5]), (3, 7, [7, 2, 5])]):
        g = torch.Generator().manual_seed(seed + 1)
        x, mask = torch.randn(batch, n, D, dtype=torch.float64, generator=g), _keep(lengths, n)
        cotangent = torch.randn(batch, n, D, dtype=torch.float64, generator=g)
        want_out, want = _want(model, x, mask, cotangent)
        leaves = [x.clone().requires_grad_(), *model.parameters()]
        out = closed(leaves[0], mask)
        close(out.detach(), want_out, f"{kind}: output at {batch} × {n}")
        for name, a, b in zip(spec.input_names, torch.autograd.grad(out, leaves, cotangent), want):
            close(a, b, f"{kind}: ∂f/∂{name} at {batch} × {n}")


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_the_generated_module_takes_a_per_head_constant_with_its_heads_side_by_side(backend):
    """A per-head constant (1, H, n, m) is the spec's n × (H·m) matrix, head h in columns h·m … (h+1)·m − 1."""
    model = _model("alibi")
    x = torch.randn(2, 6, D, dtype=torch.float64)
    spec = sa.from_torch(model, x, _keep([6, 6], 6))
    (c,) = spec.constants
    module = load(spec, backend)
    distance = (torch.arange(6)[None, :] - torch.arange(6)[:, None]).abs().double()
    per_head = model.slopes * distance  # (1, H, n, n) as the model makes it (and subtracts it)
    laid_out = per_head[0].transpose(0, 1).reshape(6, H * 6)
    params = [p.detach() for p in model.parameters()]
    if backend == "numpy":
        out = module.forward(x.numpy(), *(p.numpy() for p in params), laid_out.numpy())[0]
    else:
        out = module.forward(x, *params, laid_out).detach()
    close(out, model(x, _keep([6, 6], 6)).detach(), f"output with {c.name} laid out n × (H·m)")


def _matches(model, closed, x, mask, what: str) -> None:
    """The drop-in and torch autograd of the original agree: output and every gradient (zero for a parameter the
    forward does not read)."""
    cotangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    results = []
    for call in (closed, model):
        leaves = [x.clone().requires_grad_(), *model.parameters()]
        out = call(leaves[0], mask)
        grads = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
        results.append((out.detach(), [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]))
    (out, grads), (want_out, want) = results
    close(out, want_out, f"{what}: output")
    for k, (a, b) in enumerate(zip(grads, want)):
        close(a, b, f"{what}: gradient {k}")


class Both(HeadsAttention):
    """A bool mask varying along the batch and the heads: head 0 sees each sequence's tokens, head 1 every key."""

    def forward(self, hidden_states, mask):
        q, k = self.heads(self.query(hidden_states)), self.heads(self.key(hidden_states))
        keep = mask[:, None, None, :] | torch.tensor([False, True])[None, :, None, None]
        return self.merge(torch.softmax((q @ k.mT).masked_fill(~keep, -math.inf), -1) @ q)


class KeptBoth(HeadsAttention):
    """The same mask filling the probabilities with 0 (a kept mask K per head and sequence)."""

    def forward(self, hidden_states, mask):
        q, k, v = (self.heads(f(hidden_states)) for f in (self.query, self.key, self.value))
        keep = mask[:, None, None, :] | torch.tensor([False, True])[None, :, None, None]
        return self.merge(torch.softmax(q @ k.mT, -1).masked_fill(~keep, 0.0) @ v)


@pytest.mark.parametrize("make", [Both, KeptBoth], ids=["additive", "kept"])
def test_a_constant_varying_along_the_batch_and_the_heads_is_per_head_and_per_sequence(make):
    """Read at positions, [C_ij] split into the heads (issue 56): generated code takes it with the batch axes."""
    torch.manual_seed(0)
    model = make("").double()
    closed = ClosedForm(model, (torch.randn(2, 5, D, dtype=torch.float64), _keep([5, 4], 5)))
    (c,) = closed.spec.constants
    assert c.shape[1] == H * c.shape[0]
    for seed, (batch, n, lengths) in enumerate([(2, 5, [3, 5]), (3, 7, [7, 2, 5])]):
        x = torch.randn(batch, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        _matches(model, closed, x, _keep(lengths, n), f"batch {batch}, n = {n}")


def test_a_table_that_varies_along_the_batch_is_per_sequence_and_the_drop_in_checks_it_again():
    """A position table equal for every sequence is one constant, which the drop-in checks it still is; one that
    differs per sequence is a constant per sequence."""
    model = _model("table")
    example = (torch.randn(2, 5, D, dtype=torch.float64), _keep([5, 4], 5))
    closed = ClosedForm(model, example)

    class Shifted(HeadsAttention):
        def forward(self, hidden_states, mask):
            q = self.heads(self.query(hidden_states))
            table = torch.arange(10, dtype=q.dtype).view(2, 1, 5, 1).expand(2, 1, 5, D // H)
            return self.merge(torch.softmax((q * table) @ q.mT, -1) @ q)

    torch.manual_seed(0)
    shifted = Shifted("").double()
    _matches(shifted, ClosedForm(shifted, example), torch.randn(2, 5, D, dtype=torch.float64), _keep([3, 5], 5), "")
    assert closed(*example).shape == (2, 5, D)
