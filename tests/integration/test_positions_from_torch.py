"""from_torch reads a mask or bias the code builds from positions (torch.arange, ones(…).tril()) as the language's
matrix of positions (sa.entries): the spec has no constant for it, the generated code computes its entries from
the positions, and the drop-in matches torch autograd of the original at another length (float64). A tensor made
of anything else (a buffer, a literal table) stays a constant."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import symattn as sa  # noqa: E402
from symattn.lang.graph import postorder  # noqa: E402
from symattn.lang.positions import Entries  # noqa: E402
from symattn.trace import drop_in  # noqa: E402

D = 8


def _relative(s, i, j, n):
    return s + 0.1 * (i - j)


def _decay(s, i, j, n):
    return s * torch.exp(-(i - j).abs() / 4.0)


def _causal(s, i, j, n):
    return s.masked_fill(j > i, float("-inf"))


def _window(s, i, j, n):
    return s.masked_fill(~((j <= i) & (i - j < 3)), float("-inf"))


def _tril(s, i, j, n):
    return s.masked_fill(torch.ones(n, n, dtype=torch.bool).tril() == 0, float("-inf"))


def _alibi(s, i, j, n):
    return s - 0.5 * (i - j).abs()


def _clamped(s, i, j, n):
    return s + torch.clamp(j - i, min=-2, max=2).long() / 2


def _where(s, i, j, n):
    return s + torch.where(j <= i, torch.zeros(n, n, dtype=s.dtype), torch.full((n, n), float("-inf"), dtype=s.dtype))


def _buckets(s, i, j, n):  # T5-style: exact distances below 2, then log-spaced buckets, clamped
    distance = (i - j).abs().long()
    large = 2 + (torch.log(distance.float().clamp(min=1) / 2) / math.log(4) * 2).long()
    bucket = torch.where(distance < 2, distance, torch.clamp(large, max=3))
    return s - bucket.to(s.dtype) / 2


def _strided(s, i, j, n):  # integer division: blocks of 2 positions see each other's block and earlier ones
    return s.masked_fill(j.long() // 2 > i.long() // 2, float("-inf"))


def _reversed(s, i, j, n):
    return s + (n - 1 - j).expand(n, n) / n  # a size read off a traced tensor: the length at every call


FORMS = {
    f.__name__[1:]: f
    for f in (_relative, _decay, _causal, _window, _tril, _alibi, _clamped, _where, _buckets, _strided, _reversed)
}


class Attention(torch.nn.Module):
    def __init__(self, form, buffer=False):
        super().__init__()
        self.form = form
        self.q, self.k, self.v = (torch.nn.Linear(D, D, dtype=torch.float64) for _ in range(3))
        if buffer:
            self.register_buffer("table", torch.randn(7, 7, dtype=torch.float64))

    def forward(self, x):
        n = x.shape[1]
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        if hasattr(self, "table"):
            scores = scores + self.table[:n, :n]
        i, j = (torch.arange(n, dtype=x.dtype)[index] for index in ((slice(None), None), (None, slice(None))))
        return FORMS[self.form](scores, i, j, n).softmax(-1) @ self.v(x)


def _x(n, seed):
    return torch.randn(2, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _agrees(module, reference, x):
    x = x.clone().requires_grad_()
    y = x.detach().clone().requires_grad_()
    got, want = module(x), reference(y)
    cotangent = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got.backward(cotangent)
    want.backward(cotangent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_mask_or_bias_of_positions_is_read_as_entries_and_the_drop_in_is_right_at_every_length(form):
    torch.manual_seed(0)
    module = Attention(form)
    reference = copy.deepcopy(module)
    closed = drop_in(module, _x(5, 0))
    assert not closed.spec.constants
    assert any(isinstance(x, Entries) for x in postorder(closed.spec.output))
    for n in (5, 7):
        _agrees(module, reference, _x(n, n))


def test_a_bias_rounded_to_float32_in_a_float64_run_stays_a_constant():
    """0.1 (i − j) in float32 (int positions times a float: torch's default dtype) differs from the formula at
    float64: read as positions, the drop-in would compute another bias than the code's. It stays a constant."""

    def rounded(q, k, v):
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return ((q @ k.mT) + (0.1 * (i - j)).to(torch.float32)).softmax(-1) @ v

    spec = sa.from_torch(rounded, *(_x(5, s) for s in range(3)))
    assert [str(c.name) for c in spec.constants] == ["C"]


def test_a_table_held_as_a_buffer_stays_a_constant():
    torch.manual_seed(0)
    module = Attention("causal", buffer=True)
    reference = copy.deepcopy(module)
    closed = drop_in(module, _x(5, 0))
    assert [str(c.name) for c in closed.spec.constants] == ["C"]  # the buffer's rows and columns: data
    _agrees(module, reference, _x(6, 1))


def test_the_derivation_of_a_traced_window_prints_its_formula():
    def windowed(q, k, v):
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        s = (q @ k.mT / math.sqrt(q.shape[-1])).masked_fill((j > i) | (i - j >= 4), float("-inf"))
        return s.softmax(-1) @ v

    spec = sa.from_torch(windowed, *(_x(6, s)[..., :4] for s in range(3)))
    derivation = sa.derive(spec)
    assert derivation.verify().ok
    assert "ᵢⱼ" in derivation.text()
