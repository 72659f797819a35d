"""Hand-written softmax read as the softmax: a row max subtracted as a shift (s − max), then exp and a division by
the row sums, the flash form (exp(s − m) V) / rowsum, the log-sum-exp subtracted, or softmax / log_softmax of the
shifted scores: exact by shift invariance, so the drop-in matches autograd at a new length (float64), and stays
finite where exp of the unshifted scores would overflow. A row max read any other way is refused in one line."""

from __future__ import annotations

import math

import pytest
import sympy as sp

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


_LEAKY = torch.nn.LeakyReLU(0.2)


def clamped(q, k, v):
    return torch.softmax(torch.clamp(_scores(q, k), -1, 1), -1) @ v


def clamped_method(q, k, v):
    """Tensor.clamp(min=…) and clamp_max of the scores, torch.clip of a product: one-sided and two-sided bounds."""
    s = _scores(q, k)
    return (s.clamp(min=-0.5) + torch.clamp_max(s, 0.25) + torch.clip(s, -0.3, 0.7)) @ v / k.size(-2)


def clamped_min(q, k, v):
    return torch.clamp_min(_scores(q, k), 0.0) @ v / k.size(-2)


def hardtanh(q, k, v):
    s = _scores(q, k)
    return (torch.nn.functional.hardtanh(s) + torch.nn.functional.hardtanh(s, -0.5, 0.5)) @ v / k.size(-2)


def leaky(q, k, v):
    s = _scores(q, k)
    return (torch.nn.functional.leaky_relu(s) + _LEAKY(s)) @ v / k.size(-2)


def relu_squared(q, k, v):
    return torch.nn.functional.relu(_scores(q, k)) ** 2 @ v / k.size(-2)


@pytest.mark.parametrize(
    "form, records",
    [
        (clamped, {"Clamp"}),
        (clamped_method, {"Clamp"}),
        (clamped_min, {"Clamp"}),
        (hardtanh, {"Hardtanh"}),
        (leaky, {"LeakyRelu"}),
        (relu_squared, {"Relu", "HadamardPower"}),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_clamp_hardtanh_leaky_relu_and_relu_squared_are_the_languages(form, records):
    """Each read as the language's records (number bounds, slopes kept), and the drop-in traced at one length
    matches autograd at another (float64)."""
    spec = sa.from_torch(form, *_qkv((5, 6, 6), 4, 0))
    assert records <= {type(node).__name__ for node in postorder(spec.output)}, spec.output
    _matches_autograd(form, width=4)


def test_the_bounds_and_slopes_are_read_as_written():
    from symattn.lang.piecewise import Clamp, Hardtanh, LeakyRelu

    def parameters(form) -> set:
        spec = sa.from_torch(form, *_qkv((5, 6, 6), 4, 0))
        found = postorder(spec.output)
        return {(type(n).__name__, n.args[1:]) for n in found if isinstance(n, Clamp | LeakyRelu)}

    half, tenth = sp.Rational(1, 2), sp.Rational(1, 10)
    assert parameters(clamped_method) == {
        ("Clamp", (-half, sp.oo)),
        ("Clamp", (-sp.oo, half / 2)),
        ("Clamp", (-3 * tenth, 7 * tenth)),
    }
    assert parameters(hardtanh) == {("Hardtanh", (-1, 1)), ("Hardtanh", (-half, half))}
    assert parameters(leaky) == {("LeakyRelu", (sp.Rational(1, 100),)), ("LeakyRelu", (2 * tenth,))}
    assert Hardtanh in {type(n) for n in postorder(sa.from_torch(hardtanh, *_qkv((5, 6, 6), 4, 0)).output)}


def tensor_bound(q, k, v):
    return torch.clamp(_scores(q, k), min=torch.tensor(-1.0, dtype=q.dtype)) @ v


def tensor_max(q, k, v):
    return torch.nn.functional.hardtanh(_scores(q, k), -1.0, 1.0) @ v + torch.clamp(q, max=q.detach())


@pytest.mark.parametrize("form", [tensor_bound, tensor_max], ids=lambda f: f.__name__)
def test_a_tensor_bound_is_refused_in_one_line(form):
    with pytest.raises(SymattnError) as caught:
        sa.from_torch(form, *_qkv((5, 6, 6), 4, 0))
    message = str(caught.value)
    assert "only number bounds and slopes are read" in message and "\n" not in message, message
