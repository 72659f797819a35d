"""Nested reads at positions (CONTRACT.md, "Positions"): a table read at an index that is itself read from an integer
constant, Swin's relative-position bias T[idx[i, j], h] (idx the N × N relative_position_index buffer).

T̄[k, h] = Σ_{(i, j): idx[i, j] = k} (G_h)ᵢⱼ: the scatter of the score cotangent at the indices the constant gives; the
constant gets no gradient. Its values are no size's, so the generated code checks them where they are given (a
ValueError naming the constant and the value), never reading outside the table. Cases: Swin's per-head table at its
own index (meshgrid, as Swin builds it), and a causal read b[idx[j, i], 0] of one table at a random index (the
constant read transposed). The NumPy, torch and JAX modules (standard, and the memory-efficient NumPy and torch ones
at block sizes that do not divide n) match torch autograd of an independent forward (the table indexed by torch),
float64, output and every gradient; the gradient is the same bits on every run; the derivation prints the nested read
and verifies; exact evaluation reads and scatters entry by entry; the Triton kernels gather the index, then the table
(its range checked before any launch); ``from_torch`` reads
Swin's window attention, written as Swin writes it, into the nested read and drops in.
"""

from __future__ import annotations

import copy
import functools
import math
import types
from dataclasses import dataclass

import numpy as np
import pytest
import sympy as sp
from rendered import load

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.derive.forward_mode import ForwardDerivation
from symattn.errors import SymattnError
from symattn.lang.graph import postorder
from symattn.lang.positions import Entries
from symattn.lang.positions import scatter as table_scatter
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, d, t = dim("n"), dim("d"), dim("t")
HEADS, D_K, WINDOW = 2, 3, 2


def swin_index(window: int) -> torch.Tensor:
    """Swin's relative_position_index for a window × window window: (N, N), N = window², values in [0, (2w − 1)²)."""
    coords = torch.flatten(torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")), 1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return relative[..., 0] * (2 * window - 1) + relative[..., 1]


@dataclass(frozen=True)
class Case:
    heads: bool
    sizes: tuple[int, int]  # (n, t) the modules run at
    index: object  # () → the integer index, n × n


CASES = {
    "swin": Case(True, (WINDOW**2, (2 * WINDOW - 1) ** 2), lambda: swin_index(WINDOW)),
    "causal": Case(False, (5, 7), lambda: torch.randint(0, 7, (5, 5), generator=torch.Generator().manual_seed(3))),
}


@functools.cache
def nested_spec(kind: str) -> sa.Spec:
    """softmax(Q Kᵀ/√d + [T[idx[i, j], h]]) V per head (Swin), or softmax(Q Kᵀ/√d + [b[idx[j, i], 0] where j ≤ i, else
    −∞]) V."""
    case, idx = CASES[kind], sp.MatrixSymbol("idx", n, n)
    width = HEADS * d if case.heads else d
    q, k, v = (sp.MatrixSymbol(x, n, width) for x in "QKV")
    if case.heads:
        table = sp.MatrixSymbol("T", t, HEADS)
        bias = sa.entries(n, n, lambda i, j, h: table[idx[i, j], h], heads=HEADS)
        qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
        output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + bias) @ vh, HEADS)
    else:
        table = sp.MatrixSymbol("b", t, 1)
        bias = sa.entries(n, n, lambda i, j: sp.Piecewise((table[idx[j, i], 0], j <= i), (-sp.oo, True))).expr
        output = sa.softmax(q * k.T / sp.sqrt(d) + bias) * v
    name = str(table.name)
    inputs = (q, k, v, table)
    return sa.Spec(
        f"nested_{kind}", "a table read at a constant index", inputs, output, constants=(idx,), parameters=(name,)
    )


def _heads(x):
    return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)


def reference(kind: str, q, k, v, table, idx):
    """The independent forward: the table indexed by torch at the integer index (Swin's view and permute per head)."""
    index = idx.long()
    if CASES[kind].heads:
        n_ = q.shape[-2]
        bias = table[index.view(-1)].view(n_, n_, HEADS).permute(2, 0, 1)
        scores = _heads(q) @ _heads(k).mT / math.sqrt(D_K) + bias
        return (torch.softmax(scores, dim=-1) @ _heads(v)).transpose(-3, -2).reshape(q.shape)
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(q.shape[-2])[None, :]
    bias = torch.where(j <= i, table[index.mT, 0], -math.inf)
    return torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


def _inputs(kind: str, seed: int = 0):
    """Q, K, V (a batch of 2), the learned table, and the index as a float tensor of the inputs' dtype."""
    case, g = CASES[kind], torch.Generator().manual_seed(seed)
    rows, entries = case.sizes
    width = HEADS * D_K if case.heads else 3
    tensors = [torch.randn(2, rows, width, generator=g, dtype=torch.float64) for _ in range(3)]
    table = torch.randn(entries, HEADS if case.heads else 1, generator=g, dtype=torch.float64)
    return [*tensors, table, case.index().to(torch.float64)]


def _wanted(kind, inputs):
    """The reference's output, a cotangent, and the gradients of Q, K, V and the table."""
    leaves = [x.clone().requires_grad_() for x in inputs[:4]]
    out = reference(kind, *leaves, inputs[4])
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return out.detach(), cotangent, torch.autograd.grad(out, leaves, cotangent)


def _names(kind):
    return [str(x) for x in nested_spec(kind).inputs]


@functools.cache
def _module(kind: str, backend: str, variant: str) -> types.ModuleType:
    if variant == "standard":
        return load(nested_spec(kind), backend)
    module = types.ModuleType(f"nested_{kind}_{backend}_{variant}")
    source = codegen.render(nested_spec(kind), backend, variant, second_order=False)
    exec(compile(source, module.__name__, "exec"), module.__dict__)
    return module


def _run(kind: str, backend: str, variant: str, inputs, cotangent, **options):
    """(output, gradients of Q, K, V and the table) of the generated module, as NumPy arrays."""
    module = _module(kind, backend, variant)
    if backend == "torch":
        leaves = [x.clone().requires_grad_() for x in inputs[:4]]
        out = module.forward(*leaves, inputs[4], **options)
        return out.detach().numpy(), [g.numpy() for g in torch.autograd.grad(out, leaves, cotangent)]
    if backend == "numpy":
        out, saved = module.forward(*(x.numpy() for x in inputs), **options)
        grads = module.backward(saved, cotangent.numpy())
        return out, [grads[name] for name in _names(kind)]
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    forward = jax.jit(lambda *x: module.forward(*x, inputs[4].numpy()))
    out, pullback = jax.vjp(forward, *(x.numpy() for x in inputs[:4]))
    return np.asarray(out), [np.asarray(g) for g in pullback(cotangent.numpy())]


RUNS = [("torch", "standard", {}), ("numpy", "standard", {}), ("jax", "standard", {})]
RUNS += [(b, "memeff", {"block_size": s}) for b in ("torch", "numpy") for s in (2, 3)]


@pytest.mark.parametrize(
    ("backend", "variant", "options"), RUNS, ids=[f"{b}-{v}{o.get('block_size', '')}" for b, v, o in RUNS]
)
@pytest.mark.parametrize("kind", list(CASES))
def test_the_generated_modules_match_autograd(kind, backend, variant, options):
    inputs = _inputs(kind, seed=len(backend) + len(variant))
    want, cotangent, grads = _wanted(kind, inputs)
    out, got = _run(kind, backend, variant, inputs, cotangent, **options)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    for name, g, w in zip(_names(kind), got, grads):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
    assert np.abs(grads[3].numpy()).max() > 0  # the table's gradient is tested, not all zeros


@pytest.mark.parametrize(("backend", "variant"), [("torch", "standard"), ("numpy", "memeff"), ("jax", "standard")])
def test_the_tables_gradient_is_the_same_bits_on_every_run(backend, variant):
    inputs = _inputs("swin", seed=5)
    _, cotangent, _ = _wanted("swin", inputs)
    options = {"block_size": 3} if variant == "memeff" else {}
    first, second = (_run("swin", backend, variant, inputs, cotangent, **options)[1][3] for _ in range(2))
    assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("kind", list(CASES))
def test_the_derivation_verifies_and_prints_the_nested_read(kind):
    derivation = sa.derive(nested_spec(kind))
    assert derivation.verify().ok
    text, latex = derivation.text(), derivation.latex()
    assert ("T[idx[i, " if kind == "swin" else "b[idx[j, i], 0]") in text
    assert "Σ_{(i, j): (idx[" in text  # the table's cotangent: the scatter at the constant's indices
    assert r"}_{{\mathrm{idx}}_{" in latex and r"\sum_{(i, j):\, (" in latex  # T_{idx_{i, j}, h}
    forward = ForwardDerivation(nested_spec(kind))  # d[T[idx[i, j], h]] = [dT[idx[i, j], h]]: the index held
    assert all(check.ok for check in forward.verify()) and f"d{nested_spec(kind).inputs[3]}[idx[" in forward.text()


BAD = {"past the end": (1, 2, 99.0), "negative": (0, 3, -1.0), "not an integer": (2, 1, 1.5)}


@pytest.mark.parametrize("backend", ["torch", "numpy", "jax", "torch-memeff"])
@pytest.mark.parametrize("bad", list(BAD))
def test_an_index_outside_the_table_is_refused_in_one_line(backend, bad):
    inputs = _inputs("swin")
    row, col, value = BAD[bad]
    inputs[4][row, col] = value
    backend, _, variant = backend.partition("-")
    module = _module("swin", backend, variant or "standard")
    arrays = inputs if backend == "torch" else [x.numpy() for x in inputs]
    if backend == "jax":
        pytest.importorskip("jax").config.update("jax_enable_x64", True)
    with pytest.raises(ValueError, match=rf"^idx gives T the row index {value!r}: .* integer in \[0, 8\]") as err:
        module.forward(*arrays, **({"block_size": 3} if variant else {}))
    assert "\n" not in str(err.value)


def test_under_jit_an_index_outside_the_table_reads_nan_not_another_entry():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    inputs = [x.numpy() for x in _inputs("swin")]
    inputs[4][1, 2] = 99.0  # (jax.numpy would clamp it to the last entry)
    out = np.asarray(jax.jit(_module("swin", "jax", "standard").forward)(*inputs))
    assert np.isnan(out[:, 1]).all() and not np.isnan(np.delete(out, 1, axis=1)).any()


def test_an_input_read_inside_an_index_is_refused_in_one_line():
    spec = nested_spec("swin")
    q, k, v, table = spec.inputs
    (idx,) = spec.constants
    other = sa.Spec("trained_index", "s", (q, k, v, table, idx), spec.output, parameters=("T", "idx"))
    for attempt in (lambda: sa.derive(other), lambda: codegen.render(other, "torch", second_order=False)):
        with pytest.raises(SymattnError, match=r"idx is read inside a table read's index.*list it in constants") as e:
            attempt()
        assert "\n" not in str(e.value)


def test_a_read_nested_twice_is_refused_in_one_line():
    table, idx = sp.MatrixSymbol("T", t, 1), sp.MatrixSymbol("idx", n, n)
    with pytest.raises(SymattnError, match=r"whose index reads a table again; .* one level deep") as err:
        sa.entries(n, n, lambda i, j: table[idx[idx[i, j], j], 0])
    assert "\n" not in str(err.value)
    with pytest.raises(SymattnError, match=r"idx\[i \+ 1, j\]'s row index i \+ 1 runs over"):  # the inner read: checked
        sa.entries(n, n, lambda i, j: table[idx[i + 1, j], 0])


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_triton_kernels_gather_the_index_then_the_table(kind, tmp_path):
    """Under Triton's interpreter (float32): output, every gradient (the table's summed by the kernels' per-program
    histograms at the index's values) and the JVP against torch autograd of the independent forward; an index outside
    the table is the same one-line ValueError, raised before any launch."""
    pytest.importorskip("triton")
    import triton_rendered

    module = triton_rendered.triton_module(nested_spec(kind), tmp_path)
    inputs = _inputs(kind)
    want, cotangent, wanted = _wanted(kind, inputs)
    leaves = [x.float().requires_grad_() for x in inputs[:4]]
    out = module.forward(*leaves, inputs[4].float())
    got = torch.autograd.grad(out, leaves, cotangent.float())
    for a, b in zip([out, *got], [want, *wanted]):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(5)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs[:4]]
    value, tangent = module.jvp(
        *(x.float() for x in inputs[:4]), dict(zip(_names(kind), (t.float() for t in tangents))), idx=inputs[4].float()
    )
    expected = torch.func.jvp(lambda *x: reference(kind, *x, inputs[4]), tuple(inputs[:4]), tuple(tangents))
    for a, b in zip((value, tangent), expected):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
    bad = inputs[4].float().clone()
    bad[1, 2] = 99.0
    with pytest.raises(ValueError, match=r"^idx gives [Tb] the row index 99.0: .* integer in \[0, ") as err:
        module.forward(*(x.float() for x in inputs[:4]), bad)
    assert "\n" not in str(err.value)


def test_the_triton_kernels_refuse_an_expression_of_an_index_in_one_line():
    """T[idx[i, j] + 1, h]: its range is no entry's of idx, and a kernel's gather cannot check it."""
    spec = nested_spec("swin")
    table, (idx,) = spec.inputs[3], spec.constants
    bias = sa.entries(n, n, lambda i, j, h: table[sp.Min(idx[i, j] + 1, t - 1), h], heads=HEADS)
    q, k, v = (sa.split_heads(x, HEADS) for x in spec.inputs[:3])
    output = sa.merge_heads(sa.softmax(q @ k.T + bias) @ v, HEADS)
    shifted = sa.Spec("shifted", "s", spec.inputs, output, constants=(idx,), parameters=("T",))
    with pytest.raises(SymattnError, match=r"read T at an entry of a constant, not at Min\(") as err:
        codegen.render(shifted, "triton", second_order=False)
    assert "\n" not in str(err.value)


def test_exact_evaluation_reads_and_scatters_at_the_constants_indices():
    table, idx = sp.MatrixSymbol("T", t, 1), sp.MatrixSymbol("idx", n, n)
    read = sa.entries(n, n, lambda i, j: table[idx[i, j], 0] / 2).expr
    index = swin_index(WINDOW).tolist()
    values = [sp.Rational(k + 1, 3) for k in range(9)]
    args = (np.array([[v] for v in values], dtype=object), np.array(index, dtype=object))
    run = functools.partial(sa.lambdify, [table, idx], backend="exact", dims={n: 4, t: 9})
    got = run(read)(*args)
    assert np.asarray(got).tolist() == [[values[index[i][j]] / 2 for j in range(4)] for i in range(4)]

    weights = sp.MatrixSymbol("W", n, n)
    (entry,) = read.reads
    scatter = sa.lambdify([weights, idx], table_scatter(weights, entry), backend="exact", dims={n: 4, t: 9})
    w = np.array([[sp.Rational(4 * i + j, 7) for j in range(4)] for i in range(4)], dtype=object)
    want = [[sum((w[i, j] for i in range(4) for j in range(4) if index[i][j] == k), sp.S.Zero)] for k in range(9)]
    assert np.asarray(scatter(w, args[1])).tolist() == want
    args[1][0, 0] = sp.Integer(9)
    with pytest.raises(ValueError, match=r"^idx gives T the row index 9: .* \[0, 8\]"):
        run(read)(*args)


def _window_attention(square: bool, seed: int = 0):
    """Swin's window attention (``torch_corpus.modules.WindowAttention``): window 2 × 2 (N = 4), 12 channels, 2 heads,
    float64, its table drawn (Swin starts it at zeros); square: its table read at the N × N index as it is (no
    view(-1) and view back), table[index].permute(2, 0, 1) added to the scores."""
    from torch_corpus.modules import WindowAttention

    class Square(WindowAttention):
        def forward(self, x):
            b, n, c = x.shape
            qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
            scores = (qkv[0] * self.scale) @ qkv[1].transpose(-2, -1)
            scores = scores + self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)
            return self.proj((scores.softmax(-1) @ qkv[2]).transpose(1, 2).reshape(b, n, c))

    torch.manual_seed(seed)
    module = (Square if square else WindowAttention)(12, (WINDOW, WINDOW), HEADS).double()
    with torch.no_grad():
        module.relative_position_bias_table.normal_()
    return module


@pytest.mark.parametrize("square", [False, True], ids=["as_swin_writes_it", "square_index"])
def test_from_torch_reads_swins_window_attention_as_the_nested_read_and_drops_in(square):
    """relative_position_bias_table[relative_position_index.view(-1)].view(N, N, −1).permute(2, 0, 1), unsqueezed and
    added to the scores: the table read per head at the buffer's entries, T[idx[0, N·i + j], h]; the buffer a spec
    constant named as the code names it (its flat row), no n × n float constant. The drop-in matches the module's
    own autograd at other batch sizes: output, the input's gradient and every parameter's, the table's included."""
    module = _window_attention(square)
    reference = copy.deepcopy(module)
    example = torch.randn(2, WINDOW**2, 12, dtype=torch.float64)
    closed = sa.trace.drop_in(module, example)
    (index,) = closed.spec.constants
    assert str(index.name) == "relative_position_index" and (index.shape[0] == 1) != square  # flat: a 1 × N² row
    reads = [r for x in postorder(closed.spec.output) if isinstance(x, Entries) for r in x.reads]
    assert [str(r.parent.name) for r in reads] == ["relative_position_bias_table"]
    assert ("relative_position_index[i, " if square else "relative_position_index[0, ") in str(reads[0].indices[0])
    assert sa.derive(closed.spec).verify().ok
    for batch in (3, 5):
        x = torch.randn(batch, WINDOW**2, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))
        leaves, copies = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = module(leaves), reference(copies)
        cotangent = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        got.backward(cotangent)
        want.backward(cotangent)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(leaves.grad, copies.grad, rtol=1e-10, atol=1e-12)
        for (name, p), q in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
            p.grad = q.grad = None
    with torch.no_grad():
        module.relative_position_index[1, 2] = 9  # one past the table's last row
    with pytest.raises(
        ValueError, match=r"^relative_position_index gives relative_position_bias_table the row index 9"
    ):
        module(torch.randn(2, WINDOW**2, 12, dtype=torch.float64))


@pytest.mark.parametrize(("backend", "dtype", "rows"), [("torch", "bfloat16", 300), ("numpy", "float16", 3000)])
def test_an_index_constant_too_narrow_for_its_table_is_refused_in_one_line(backend, dtype, rows):
    """bfloat16 holds integers exactly only up to 256 (float16: 2048): a table of more rows could be read at a
    rounded index, a row that is no error; refused instead, naming the constant's dtype."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 3, generator=g) for _ in range(3))
    inputs = [q, k, v, torch.randn(rows, 1, generator=g), torch.randint(0, rows, (5, 5), generator=g).float()]
    if backend == "torch":
        arrays = [x.to(getattr(torch, dtype)) for x in inputs]
    else:
        arrays = [x.numpy().astype(dtype) for x in inputs]
    with pytest.raises(
        ValueError, match=rf"^idx is (torch\.)?{dtype}, whose integers are exact only up to \d+, and b has"
    ) as e:
        _module("causal", backend, "standard").forward(*arrays)
    assert "\n" not in str(e.value)
