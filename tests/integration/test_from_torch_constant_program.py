"""The drop-in computes the original at every call, whatever the code does with its constants: a mask written in
place (``allowed[b, :, :p] = True``) is rebuilt with its writes (was: the writes dropped, output 185 % off at the
example itself); a Python value read off a buffer or a bool argument (``prefix.tolist()``, ``lengths[b].item()``)
is a guard, and new values trace again (was: the example's prefix lengths kept, silently); a trace whose spec
differs at new sizes (0.5 read as 1/√n at n = 4) gets code of its own (was: 1/√n at n = 16, 30 % off)."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from symattn.trace import drop_in  # noqa: E402
from symattn.trace.constants import Program, Ref  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402


class _Attention(torch.nn.Module):
    """Single-head attention whose scores are masked by ``allowed(x)`` (True where a key is seen)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d, dtype=torch.float64) for _ in range(3))
        self.register_buffer("prefix", torch.tensor([1, 3]))

    def scores(self, x):
        return self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])

    def forward(self, x):
        s = self.scores(x).masked_fill(~self.allowed(x), float("-inf"))
        return s.softmax(-1) @ self.v(x)


class _PrefixWritten(_Attention):
    """Prefix-LM: causal, and each sequence sees its own prefix, written into the mask one sequence at a time."""

    def allowed(self, x):
        b, n, _ = x.shape
        allowed = torch.ones(n, n, dtype=torch.bool).tril().repeat(b, 1, 1)
        for i, p in enumerate(self.prefix.tolist()):
            allowed[i, :, :p] = True
        return allowed


class _PrefixIterated(_Attention):
    """The same, the buffer iterated as tensors and the mask written by fill_ on a view."""

    def allowed(self, x):
        n = x.shape[1]
        allowed = torch.ones(x.shape[0], n, n, dtype=torch.bool).tril()
        for i, p in enumerate(self.prefix):
            allowed[i, :, : int(p)].fill_(True)
        return allowed


class _PrefixBroadcast(_Attention):
    """The same, by broadcasting (no Python value read)."""

    def allowed(self, x):
        i = torch.arange(x.shape[1])
        return (i[None, :] <= i[:, None]) | (i[None, None, :] < self.prefix[:, None, None])


class _Windowed(_Attention):
    """A window read off a 0-d buffer by .item() and used as Python ints in the mask's construction."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.tensor(2))

    def allowed(self, x):
        n, w = x.shape[1], self.window.item()
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for row in range(n):
            allowed[row, max(0, row - w) : row + 1] = True
        return allowed


class _Halved(_Attention):
    """Scores × 0.5, a literal: at n = 4 it equals 1/√n."""

    def forward(self, x):
        s = (self.q(x) @ self.k(x).transpose(-1, -2)) * 0.5
        return s.softmax(-1) @ self.v(x)


def _agrees(module, reference, x, tol=1e-12):
    x = x.clone().requires_grad_()
    y = x.detach().clone().requires_grad_()
    got, want = module(x), reference(y)
    cotangent = torch.randn_like(want)
    got.backward(cotangent)
    want.backward(cotangent)
    assert (got - want).abs().max() < tol
    assert (x.grad - y.grad).abs().max() < tol
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max() < tol, name


def _x(n, seed=0):
    return torch.randn(2, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cls", [_PrefixWritten, _PrefixIterated, _PrefixBroadcast, _Windowed])
def test_a_mask_built_any_way_is_the_originals_at_every_call(cls):
    torch.manual_seed(0)
    module = cls()
    reference = copy.deepcopy(module)
    drop_in(module, _x(5))
    for n in (5, 9):
        _agrees(module, reference, _x(n, seed=n))


@pytest.mark.parametrize("cls", [_PrefixWritten, _PrefixIterated, _PrefixBroadcast])
def test_new_buffer_values_are_read_at_the_next_call(cls):
    torch.manual_seed(0)
    module = cls()
    reference = copy.deepcopy(module)
    closed = drop_in(module, _x(5))
    for prefix in ([4, 0], [2, 2], [1, 3]):
        for m in (module, reference):
            m.prefix.copy_(torch.tensor(prefix))
        _agrees(module, reference, _x(5, seed=sum(prefix)))
    traces = next(held for key, held in closed.traced.items() if key[1:] == ((2, 5, 8),))  # (key: mode, shapes)
    assert 1 <= len(traces) <= 3  # one per prefix read as Python values, none when read by broadcasting
    assert len(closed.codes) == 1  # the same function each time: the first generated code serves them all


def test_a_window_read_by_item_traces_again_when_it_changes():
    torch.manual_seed(0)
    module = _Windowed()
    reference = copy.deepcopy(module)
    drop_in(module, _x(6))
    for w in (0, 3, 2):
        for m in (module, reference):
            m.window.fill_(w)
        _agrees(module, reference, _x(6, seed=w))


def _lengths_mask(q, k, v, lengths):
    """Keys past each sequence's length masked, the lengths read as Python ints (a bool-free integer argument)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    keep = torch.zeros(s.shape, dtype=torch.bool)
    for b, length in enumerate(lengths.tolist()):
        keep[b, :, :length] = True
    return torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1) @ v


def test_an_integer_argument_read_as_python_values_is_read_at_every_call():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 4, dtype=torch.float64, generator=g) for _ in range(3))
    closed = ClosedForm(_lengths_mask, (q, k, v, torch.tensor([5, 2])))
    for lengths in ([3, 4], [1, 5], [5, 2]):
        lengths = torch.tensor(lengths)
        assert (closed(q, k, v, lengths) - _lengths_mask(q, k, v, lengths)).abs().max() < 1e-12


def test_a_literal_read_as_a_size_at_the_example_is_right_at_every_size():
    torch.manual_seed(0)
    module = _Halved()
    reference = copy.deepcopy(module)
    closed = drop_in(module, _x(4))  # 0.5 = 1/√4: read as 1/√n here, as 1/2 at n = 16
    for n in (4, 16, 9):
        _agrees(module, reference, _x(n, seed=n))
    assert len(closed.codes) == 2  # the trace at n = 4 and the one at n = 16 are different functions


def test_the_program_replays_writes_without_changing_what_it_holds():
    program = Program()
    base = torch.zeros(3, dtype=torch.bool)  # a tensor the program meets first as an operand: held as a literal
    program.record(torch.Tensor.__setitem__, (base, 1, True), {}, None, "__setitem__")
    first = program.replay((), {}, [id(base)])[0]
    second = program.replay((), {}, [id(base)])[0]
    assert first.tolist() == second.tolist() == [False, True, False]
    assert program.literals[0].tolist() == [False, False, False]


def test_a_guard_holds_for_equal_values_only():
    program = Program()
    lengths = torch.tensor([2, 3])
    program.leaf(lengths, Ref("arg", 0))
    program.guard(torch.Tensor.tolist, (lengths,), {}, [2, 3])
    assert program.holds((torch.tensor([2, 3]),), {})
    assert not program.holds((torch.tensor([3, 2]),), {})


def test_a_mask_passed_through_star_args_is_replayed_from_the_calls_own():
    """forward(self, x, *rest) with the mask in rest: the constant program numbers the forward's parameters (rest
    a tuple), so each call's mask is read from that call's rest (it was read as rest[0][0], the first sequence's
    rows of the new mask: a wrong output without a word)."""

    class StarArgs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(4, 4, dtype=torch.float64)

        def forward(self, x, *rest):
            scores = self.q(x) @ x.mT / 2
            return scores.masked_fill(~rest[0], float("-inf")).softmax(-1) @ x

    def masks(seed):
        keep = torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(seed)) > 0.4
        keep[..., 0] = True
        return keep

    torch.manual_seed(0)
    module = StarArgs()
    reference = copy.deepcopy(module)
    drop_in(module, torch.randn(2, 5, 4, dtype=torch.float64), masks(0))
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    leaves, copies = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = module(leaves, masks(1)), reference(copies, masks(1))
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves.grad, copies.grad, rtol=1e-10, atol=1e-12)
