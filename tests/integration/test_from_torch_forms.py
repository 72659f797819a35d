"""Hand-written softmax read as the softmax: a row max subtracted as a shift (s − max), then exp and a division by
the row sums, the flash form (exp(s − m) V) / rowsum, the log-sum-exp subtracted, or softmax / log_softmax of the
shifted scores: exact by shift invariance, so the drop-in matches autograd at a new length (float64), and stays
finite where exp of the unshifted scores would overflow. A row max read any other way is refused in one line."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import symattn as sa  # noqa: E402
from symattn.errors import SymattnError  # noqa: E402
from symattn.lang.graph import postorder  # noqa: E402
from symattn.lang.rowwise import LogSoftmax, RowSoftmax  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))


def divided(q, k, v):
    s = _scores(q, k)
    e = (s - s.max(-1, keepdim=True).values).exp()
    return (e / e.sum(-1, keepdim=True)) @ v


def flash(q, k, v):
    s = _scores(q, k)
    m = torch.amax(s, dim=-1, keepdim=True).detach()
    e = torch.exp(s - m)
    return (e @ v) / e.sum(dim=-1, keepdim=True)


def log_sum_exp(q, k, v):
    s = _scores(q, k)
    z = s - s.max(dim=-1, keepdim=True)[0]
    return (z - torch.log(torch.exp(z).sum(-1, keepdim=True))) @ v


def shifted_softmax(q, k, v):
    s = _scores(q, k)
    return torch.softmax(s - s.max(-1, keepdim=True).values, dim=-1) @ v


def masked(q, k, v):
    n, m = q.size(-2), k.size(-2)
    s = _scores(q, k).masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True) @ v


def max_under_no_grad(q, k, v):
    s = _scores(q, k)
    with torch.no_grad():
        m = s.max(-1, keepdim=True).values  # the shift cancels: stopped or not
    e = torch.exp(s - m)
    return (e @ v) / e.sum(dim=-1, keepdim=True)


def scaled_values(q, k, v):
    s = _scores(q, k)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ (0.3 * v)) / e.sum(-1, keepdim=True)


FORMS = [divided, flash, log_sum_exp, shifted_softmax, masked, max_under_no_grad, scaled_values]


def _qkv(rows, width, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, r, width, generator=g, dtype=torch.float64) * scale for r in rows]


def _matches_autograd(function, width: int) -> None:
    """The drop-in of function traced at n = 5, m = 6 against autograd of function at n = 7, m = 9 (float64)."""
    closed = ClosedForm(function, _qkv((5, 6, 6), 4, 0))
    inputs = [x.requires_grad_() for x in _qkv((7, 9, 9), width, 1)]
    want = function(*inputs)
    cotangent = torch.randn_like(want)
    got = closed(*inputs)
    assert (got - want).abs().max() < 1e-12
    for a, b in zip(torch.autograd.grad(got, inputs, cotangent), torch.autograd.grad(want, inputs, cotangent)):
        assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.__name__)
def test_a_hand_written_softmax_is_the_softmax_at_every_length(form):
    spec = sa.from_torch(form, *_qkv((5, 6, 6), 4, 0))
    nodes = {type(node) for node in postorder(spec.output)}
    assert nodes & {RowSoftmax, LogSoftmax}, spec.output
    _matches_autograd(form, width=3)


def test_the_generated_softmax_stays_finite_where_exp_of_the_scores_overflows():
    closed = ClosedForm(flash, _qkv((5, 6, 6), 4, 0))
    inputs = [x.requires_grad_() for x in _qkv((7, 9, 9), 3, 1, scale=40.0)]  # scores of order 10³: exp overflows
    got = closed(*inputs)
    assert torch.isfinite(got).all() and (got - flash(*inputs)).abs().max() < 1e-9


def returned(q, k, v):
    s = _scores(q, k)
    return s - s.max(-1, keepdim=True).values


def multiplied(q, k, v):
    s = _scores(q, k)
    return (s - s.max(-1, keepdim=True).values) @ v


def argmax(q, k, v):
    s = _scores(q, k)
    top = s.max(-1, keepdim=True)
    return torch.softmax(s - top.values, -1) @ v + top.indices


def unnormalised(q, k, v):
    s = _scores(q, k)
    return torch.exp(s - s.max(-1, keepdim=True).values) @ v


def dropped_dim(q, k, v):
    s = _scores(q, k)
    return torch.softmax(s - s.max(-1).values[..., None], -1) @ v


@pytest.mark.parametrize(
    "form, words",
    [
        (returned, "the output of returned holds a row max"),
        (multiplied, "cannot trace matmul: a row max is read as a softmax's shift only"),
        (argmax, "cannot trace add: a row max is read as a softmax's shift only"),
        (unnormalised, "the output of unnormalised holds a row max"),
        (dropped_dim, "cannot trace max: max over dim=-1 (keepdim=False)"),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_a_row_max_read_another_way_is_refused_in_one_line(form, words):
    with pytest.raises(SymattnError) as caught:
        sa.from_torch(form, *_qkv((5, 6, 6), 4, 0))
    message = str(caught.value)
    assert words in message and "\n" not in message, message


def gated(q, k, v):
    """Attention gated by SiLU of the queries, its scores through ReLU first: F.silu and F.relu as the language's."""
    s = torch.nn.functional.relu(_scores(q, k))
    return (s / k.size(-2)) @ v * torch.nn.functional.silu(q)


def test_silu_and_relu_are_read_as_the_languages_functions():
    from symattn.lang.functions import Relu, Silu

    spec = sa.from_torch(gated, *_qkv((5, 6, 6), 4, 0))
    assert {Relu, Silu} <= {type(node) for node in postorder(spec.output)}
    _matches_autograd(gated, width=4)
