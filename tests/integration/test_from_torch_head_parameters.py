"""from_torch reads a parameter with a heads axis per head (forms.head_parameters): a gate, a temperature or a
sigmoid gate per head lined up with the heads by any view (view, reshape, [None, :, None, None], [:, None, None],
unsqueeze, [torch.arange(H)]) is sa.entries(n, m, lambda i, j, h: g[0, h], heads=H); a per-head table (H, N, N) or
(1, H, N, N) cut to the length (table[:, :n, :m], table[..., :n, :n]) or read whole is split_heads(T, H), T its
first n rows and m columns laid out n × (H·m). Traced at one length, the drop-in matches torch autograd of the
original module at another (float64): the output, the inputs' gradients and the parameter's own (zero beyond the
length); beyond the table it fails in one line; routed to the Triton kernels (TRITON_INTERPRET=1, float32) it gives
the torch ops' values."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import symattn as sa  # noqa: E402
from symattn.errors import SymattnError  # noqa: E402
from symattn.lang.graph import postorder  # noqa: E402
from symattn.lang.positions import Entries  # noqa: E402
from symattn.trace.dropin import ClosedForm, drop_in  # noqa: E402

H, D, N_TABLE = 2, 3, 8

# per-head values of the scores s (B, H, n, m) and the module's parameters: each form as its code writes it
FORMS = {
    "view": lambda p, s, n, m: s + p.gate.view(1, H, 1, 1),
    "none_index": lambda p, s, n, m: s + p.gate[None, :, None, None],
    "reshape": lambda p, s, n, m: s * p.gate.reshape(H, 1, 1),
    "arange_index": lambda p, s, n, m: s * p.gate[torch.arange(H)][:, None, None],
    "unsqueeze": lambda p, s, n, m: s + p.gate.unsqueeze(-1).unsqueeze(-1),
    "temperature": lambda p, s, n, m: s * p.gate.view(1, H, 1, 1).exp(),
    "sigmoid_gate": lambda p, s, n, m: s * torch.sigmoid(p.gate[:, None, None]),
    "gate_as_heads_array": lambda p, s, n, m: s * p.gate_3d,
    "table": lambda p, s, n, m: s + p.table[:, :n, :m],
    "table_square": lambda p, s, n, m: s + p.table[:, :n, :n],
    "table_4d": lambda p, s, n, m: s + p.table_4d[..., :n, :n],
}
TABLES = {"table": "table", "table_square": "table", "table_4d": "table_4d"}


class Gated(torch.nn.Module):
    """Multi-head attention over (B, n, H·d) with a per-head parameter read by one form of FORMS."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.gate = torch.nn.Parameter(torch.randn(H, dtype=torch.float64))
        self.gate_3d = torch.nn.Parameter(torch.rand(H, 1, 1, dtype=torch.float64) + 0.5)
        self.table = torch.nn.Parameter(torch.randn(H, N_TABLE, N_TABLE, dtype=torch.float64))
        self.table_4d = torch.nn.Parameter(torch.randn(1, H, N_TABLE, N_TABLE, dtype=torch.float64))

    def forward(self, q, k, v):
        B, n, _ = q.shape
        m = k.shape[1]
        q, k, v = (x.view(B, x.shape[1], H, D).transpose(1, 2) for x in (q, k, v))
        s = FORMS[self.form](self, q @ k.transpose(-1, -2), n, m)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, H * D)


class HeadsGiven(Gated):
    """The same over arguments given split into heads, (B, H, n, d) (/tmp/gate.py's), returning (B, H, n, d), or
    (merged) its heads merged by the code, (B, n, H·d)."""

    def __init__(self, form: str, merged: bool = False) -> None:
        super().__init__(form)
        self.merged = merged

    def forward(self, q, k, v):
        s = FORMS[self.form](self, q @ k.transpose(-1, -2), q.shape[-2], k.shape[-2])
        out = torch.softmax(s, -1) @ v
        return out.transpose(1, 2).flatten(-2) if self.merged else out


def _qkv(batch: int, n: int, m: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, length, H * D, generator=g, dtype=torch.float64) for length in (n, m, m))


@pytest.fixture(scope="module", params=sorted(FORMS))
def dropped(request):
    """(form, the original module, its drop-in copy, the copy's ClosedForm), traced at n = m = 5."""
    torch.manual_seed(0)
    original = Gated(request.param)
    module = copy.deepcopy(original)
    closed = drop_in(module, *_qkv(2, 5, 5, 0), second_order=False)
    return request.param, original, module, closed


def test_a_per_head_parameter_is_read_per_head_with_no_dense_constant(dropped):
    form, _, _, closed = dropped
    spec = closed.spec
    assert spec.constants == ()  # no n × m constant: the parameter is an input, read per head
    if form in TABLES:
        table = next(s for s in spec.inputs if str(s.name) == TABLES[form])
        n, cols = table.shape
        assert str(n) == "n" and cols == H * n  # its first n rows and n columns per head, laid out n × (H·n)
    else:
        reads = [e for e in postorder(spec.output) if isinstance(e, Entries)]
        assert reads and all(str(r.shape[0]) == "n" for r in reads)  # at the scores' length, every head's read
        gate = "gate_3d" if form == "gate_as_heads_array" else "gate"
        assert {str(t.name) for r in reads for t in r.tables} == {gate}


def test_the_drop_in_matches_torch_autograd_at_another_length(dropped):
    form, original, module, _ = dropped
    square = form in ("table_square", "table_4d")
    args = tuple(x.requires_grad_() for x in _qkv(3, 7, 7 if square else 6, 1))
    leaves = tuple(x.detach().requires_grad_() for x in args)
    out, want = module(*args), original(*leaves)
    cotangent = torch.randn_like(want)
    names = [n for n, _ in original.named_parameters()]
    got = torch.autograd.grad(out, [*args, *module.parameters()], cotangent, allow_unused=True)
    ref = torch.autograd.grad(want, [*leaves, *original.parameters()], cotangent, allow_unused=True)
    assert (out - want).abs().max() <= 1e-12
    for name, a, b in zip(["q", "k", "v", *names], got, ref):
        if b is None:  # a parameter the form does not read: no gradient either way
            assert a is None or not a.any(), name
            continue
        assert (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1.0), name
    if form in TABLES:  # the rows and columns beyond the length: zero, as autograd of the cut gives them
        grad = dict(zip(names, got[3:]))[TABLES[form]]
        cols = 7 if square else 6
        assert grad[..., 7:, :].abs().max() == 0 and grad[..., :, cols:].abs().max() == 0
        assert grad[..., :7, :cols].abs().min() > 0


@pytest.mark.parametrize("form", ["view", "arange_index", "temperature", "table", "table_4d", "merged_view"])
def test_arguments_given_split_into_heads_are_read_as_heads(form):
    """(B, H, n, d) arguments meeting a parameter read per head: traced again with them split_heads(X, H) of X,
    n × (H·d), which the drop-in hands the generated code ((B, n, H·d)), the output split back (B, H, n, d) where
    the code returns it per head."""
    torch.manual_seed(0)
    merged = form.startswith("merged_")
    original = HeadsGiven(form.removeprefix("merged_"), merged)
    module = copy.deepcopy(original)

    def split(x):
        return x.view(*x.shape[:2], H, D).transpose(1, 2)

    closed = drop_in(module, *(split(x) for x in _qkv(2, 5, 5, 0)), second_order=False)
    q = closed.spec.inputs[0]
    assert str(q.shape[0]) == "n" and (q.shape[1] / H).is_Symbol and closed.spec.constants == ()  # n × (H·d_q)
    args = tuple(split(x).requires_grad_() for x in _qkv(3, 7, 7, 1))
    leaves = tuple(x.detach().requires_grad_() for x in args)
    out, want = module(*args), original(*leaves)
    assert out.shape == want.shape == ((3, 7, H * D) if merged else (3, H, 7, D))
    assert (out - want).abs().max() <= 1e-12
    cotangent = torch.randn_like(want)
    got = torch.autograd.grad(out, [*args, *module.parameters()], cotangent, allow_unused=True)
    ref = torch.autograd.grad(want, [*leaves, *original.parameters()], cotangent, allow_unused=True)
    for a, b in zip(got, ref):
        if b is not None:
            assert (a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1.0)


def test_a_per_head_table_read_whole_is_the_table_at_its_own_lengths():
    """(1, H, N, N) added as it is to scores of N × N: split_heads(T, H), T of n × (H·m); drop-in and autograd agree."""

    class Whole(Gated):
        def forward(self, q, k, v):
            B, n, _ = q.shape
            q, k, v = (x.view(B, n, H, D).transpose(1, 2) for x in (q, k, v))
            s = q @ k.transpose(-1, -2) + self.table_4d
            return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, H * D)

    torch.manual_seed(0)
    original = Whole("table_4d")
    module = copy.deepcopy(original)
    closed = drop_in(module, *_qkv(2, N_TABLE, N_TABLE, 0), second_order=False)
    table = next(s for s in closed.spec.inputs if str(s.name) == "table_4d")
    assert closed.spec.constants == () and tuple(map(str, table.shape)) == ("n", f"{H}*m")
    args = tuple(x.requires_grad_() for x in _qkv(3, N_TABLE, N_TABLE, 1))
    leaves = tuple(x.detach().requires_grad_() for x in args)
    out, want = module(*args), original(*leaves)
    got = torch.autograd.grad(out.sum(), [*args, module.table_4d])
    ref = torch.autograd.grad(want.sum(), [*leaves, original.table_4d])
    assert (out - want).abs().max() <= 1e-12
    assert all((a - b).abs().max() <= 1e-12 * max(b.abs().max(), 1.0) for a, b in zip(got, ref))


@pytest.mark.parametrize("form", sorted(TABLES))
def test_the_drop_in_beyond_the_table_fails_in_one_line(form):
    torch.manual_seed(0)
    module = Gated(form)
    drop_in(module, *_qkv(2, 5, 5, 0), second_order=False)
    with pytest.raises(SymattnError, match=r"^drop_in: the original forward fails at these arguments") as err:
        module(*_qkv(2, N_TABLE + 2, N_TABLE + 2, 1))
    assert "\n" not in str(err.value)


def test_a_table_cut_to_a_number_no_size_is_refused_in_one_line():
    class Fixed(Gated):
        def forward(self, q, k, v):
            q, k, v = (x.view(2, 5, H, D).transpose(1, 2) for x in (q, k, v))  # no size read off a tensor
            s = q @ k.transpose(-1, -2) + self.table[:, :5, :5]
            return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(2, 5, H * D)

    with pytest.raises(SymattnError, match=r"cut to 5 rows or columns of 8: read are cuts to lengths the code read"):
        sa.from_torch(Fixed("table"), *_qkv(2, 5, 5, 0))


@pytest.mark.parametrize(
    "read",
    [
        lambda p, n: p.table[:, 1 : n + 1, :n],  # shifted: not the table's first n rows
        lambda p, n: p.table[:, :n, :n][torch.tensor([1, 0])],  # the heads permuted
        lambda p, n: p.gate[torch.tensor([1, 0])][:, None, None],
        lambda p, n: p.table[:, : 2 * n : 2, :n],  # every second row
    ],
    ids=["shifted", "heads_permuted", "gate_permuted", "strided"],
)
def test_a_read_out_of_order_is_refused_even_where_its_values_match(read):
    """Parameters initialised to zeros: every cut reads the same values at the example, so only the index's own form
    tells the table's first rows from others; one out of order is refused (as any indexing of a traced tensor)."""

    class Zeros(Gated):
        def forward(self, q, k, v):
            B, n, _ = q.shape
            q, k, v = (x.view(B, n, H, D).transpose(1, 2) for x in (q, k, v))
            s = q @ k.transpose(-1, -2) + read(self, n)
            return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, n, H * D)

    module = Zeros("table")
    with torch.no_grad():
        module.table.zero_()
        module.gate.zero_()
    with pytest.raises(SymattnError, match=r"cannot trace __getitem__"):
        sa.from_torch(module, *_qkv(2, 3, 3, 0))


def test_a_learned_per_key_bias_of_leading_ones_drops_in():
    """A parameter (1, 1, 1, m) added to the scores (B, n, m): the spec's 1 × m row, which the drop-in passes as its
    matrix (a view: its gradient reaches the parameter)."""

    class KeyBias(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = torch.nn.Parameter(torch.randn(1, 1, 1, 5, dtype=torch.float64))

        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) + self.t, -1) @ v

    torch.manual_seed(0)
    original = KeyBias()
    module = copy.deepcopy(original)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    drop_in(module, q, k, v, second_order=False)
    q2, k2, v2 = (torch.randn(3, 4, 5, 3, generator=g, dtype=torch.float64) for _ in range(3))
    out, want = module(q2, k2, v2), original(q2, k2, v2)
    cotangent = torch.randn_like(want)
    (got,) = torch.autograd.grad(out, [module.t], cotangent)
    (ref,) = torch.autograd.grad(want, [original.t], cotangent)
    assert (out - want).abs().max() <= 1e-12
    assert got.shape == (1, 1, 1, 5) and (got - ref).abs().max() <= 1e-12


@pytest.mark.parametrize("form", ["view", "temperature", "table", "table_4d", "heads_given_table"])
def test_the_drop_in_routed_to_the_triton_kernels_gives_the_torch_ops_values(form, monkeypatch):
    from triton_rendered import interpreted  # noqa: F401  (skips without triton or the interpreter)

    torch.manual_seed(0)
    given = form.startswith("heads_given_")
    module = HeadsGiven(form.removeprefix("heads_given_")) if given else Gated(form)
    lay = (lambda x: x.view(*x.shape[:2], H, D).transpose(1, 2)) if given else (lambda x: x)
    closed = ClosedForm(module, tuple(map(lay, _qkv(2, 5, 5, 0))), second_order=False)
    args = tuple(map(lay, _qkv(2, 6, 6, 1)))

    def step(dtype) -> list:
        module.to(dtype)
        given = tuple(x.to(dtype).requires_grad_() for x in args)
        out = closed(*given)
        return [out, *torch.autograd.grad(out, [*given, *module.parameters()], torch.ones_like(out), allow_unused=True)]

    want = step(torch.float64)  # the torch ops
    generated = closed.code(closed._traced_at(args).spec)
    monkeypatch.setattr(generated, "_kernel_device", lambda x: True)
    kernels = generated._kernels_module()
    assert kernels is not None, form
    calls, forward = [], kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    got = step(torch.float32)
    assert calls == [1]
    for a, b in zip(got, want):
        a, b = (torch.zeros(()) if x is None else x.double() for x in (a, b))
        assert (a - b).abs().max() <= 1e-4 * max(b.abs().max(), 1.0), form
