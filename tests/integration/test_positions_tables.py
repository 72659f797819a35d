"""Tables read at positions (CONTRACT.md, "Positions"): sa.entries formulas that read an input or a constant.

b̄[k, l] = Σ_{(i, j): (r, c)(i, j) = (k, l)} (G ⊙ [∂f/∂b[r, c]])ᵢⱼ: each table entry collects the score cotangent
where it is read. Each case below reads tables a different way: a learned relative bias b[|i − j|, 0], the same with
an offset b[i − j + n − 1, 0], row and column tables b1[i, 0] + b2[j, 0] (n ≠ m), a causal clamped window
b[min(|i − j|, w), 0], T5's log-spaced buckets, a per-head table T[|i − j|, h] (also under a causal mask), and
document masking on a per-token constant with batch axes. The generated NumPy, torch and JAX modules match torch
autograd of an independent forward (the tables indexed with torch), the torch module's JVP matches torch.func.jvp,
the gradient is the same bits on every run, exact evaluation reads and scatters entry by entry, the derivation prints
the scatter and verifies, and a read that may leave its table, or a non-integer index, is refused in one line.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import sympy as sp
from rendered import load

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.lang.positions import I, J, read_bounds
from symattn.lang.positions import scatter as table_scatter
from symattn.specs import dim

torch = pytest.importorskip("torch")

n, m, d = dim("n"), dim("m"), dim("d")
WINDOW, BUCKETS, HEADS, D_K = 3, 8, 2, 2
N, M, WIDTH = 6, 7, 3  # the sizes the modules run at (n = m = N for self-attention)


def _bucket(i, j):
    """T5's bidirectional bucket of i − j: half the buckets per direction, exact below 2, then log-spaced."""
    distance, half, exact = sp.Abs(i - j), BUCKETS // 2, 2
    spaced = sp.floor(sp.log(sp.Max(distance, exact) / exact) / sp.log(4) * 3)  # no distance lands on a bucket's edge
    large = exact + sp.Min(spaced, half - exact - 1)
    return sp.Piecewise((half, j > i), (0, True)) + sp.Piecewise(
        (sp.Min(distance, exact - 1), distance < exact), (large, True)
    )


def _torch_bucket(i, j):
    distance, half, exact = (i - j).abs(), BUCKETS // 2, 2
    spaced = torch.floor(torch.log(distance.clamp(min=exact) / exact) / math.log(4) * 3)
    large = exact + spaced.clamp(max=half - exact - 1)
    return (torch.where(j > i, half, 0) + torch.where(distance < exact, distance, large)).long()


def _grid(rows, cols):
    return torch.arange(rows)[:, None], torch.arange(cols)[None, :]


@dataclass(frozen=True)
class Case:
    """A spec reading tables: its positional matrix (of the tables), the tables' shapes, and a torch reference."""

    tables: dict[str, tuple]  # name → (rows, cols) as dimension expressions
    formula: Callable  # (i, j, tables) → the entry
    reference: Callable  # (i, j, tables as tensors) → the positional term, (…, rows, cols)
    cross: bool = False  # n ≠ m
    constants: tuple[str, ...] = ()
    heads: bool = False
    per_sequence: tuple[str, ...] = ()  # learned tables with the batch axes of Q (a size 2n − 1 has no constructor)


CASES = {
    "relative": Case({"b": (n, 1)}, lambda i, j, t: t["b"][sp.Abs(i - j), 0], lambda i, j, t: t["b"][(i - j).abs(), 0]),
    "offset": Case(
        {"b": (2 * n - 1, 1)},
        lambda i, j, t: t["b"][i - j + n - 1, 0],
        lambda i, j, t: t["b"][..., i - j + N - 1, 0],
        per_sequence=("b",),
    ),
    "row_column": Case(
        {"b1": (n, 1), "b2": (m, 1)},
        lambda i, j, t: t["b1"][i, 0] + t["b2"][j, 0],
        lambda i, j, t: t["b1"][i, 0] + t["b2"][j, 0],
        cross=True,
    ),
    "window": Case(  # causal, the table clamped at distance WINDOW: ∂f/∂b = [j ≤ i], not 1
        {"b": (WINDOW + 1, 1)},
        lambda i, j, t: sp.Piecewise((t["b"][sp.Min(sp.Abs(i - j), WINDOW), 0], j <= i), (-sp.oo, True)),
        lambda i, j, t: torch.where(j <= i, t["b"][(i - j).abs().clamp(max=WINDOW), 0], -math.inf),
    ),
    "t5": Case(
        {"b": (BUCKETS, 1)}, lambda i, j, t: t["b"][_bucket(i, j), 0], lambda i, j, t: t["b"][_torch_bucket(i, j), 0]
    ),
    "heads": Case(
        {"T": (n, HEADS)},
        lambda i, j, h, t: t["T"][sp.Abs(i - j), h],
        lambda i, j, t: t["T"][(i - j).abs()].movedim(-1, 0),
        heads=True,
    ),
    "heads_causal": Case(  # per head and causal: ∂f/∂T = [j ≤ i] per head, the memory-efficient blocks' keys 0 … r₁ − 1
        {"T": (n, HEADS)},
        lambda i, j, h, t: sp.Piecewise((t["T"][sp.Abs(i - j), h], j <= i), (-sp.oo, True)),
        lambda i, j, t: torch.where(j <= i, t["T"][(i - j).abs()].movedim(-1, 0), -math.inf),
        heads=True,
    ),
    "documents": Case(  # doc: per-token ids, a constant with a batch axis; with a learned relative bias
        {"b": (n, 1), "doc": (n, 1)},
        lambda i, j, t: (
            t["b"][sp.Abs(i - j), 0] + sp.Piecewise((0, sp.Eq(t["doc"][i, 0], t["doc"][j, 0])), (-sp.oo, True))
        ),
        lambda i, j, t: (
            t["b"][(i - j).abs(), 0]
            + torch.where(t["doc"][..., :, 0, None] == t["doc"][..., None, :, 0], 0.0, -math.inf)
        ),
        constants=("doc",),
    ),
}


def table_spec(kind: str) -> sa.Spec:
    case = CASES[kind]
    keys = m if case.cross else n
    width = HEADS * d if case.heads else d
    q, k, v = sp.MatrixSymbol("Q", n, width), sp.MatrixSymbol("K", keys, width), sp.MatrixSymbol("V", keys, width)
    tables = {name: sp.MatrixSymbol(name, *shape) for name, shape in case.tables.items()}
    if case.heads:
        bias = sa.entries(n, keys, lambda i, j, h: case.formula(i, j, h, tables), heads=HEADS)
        qh, kh, vh = (sa.split_heads(x, HEADS) for x in (q, k, v))
        output = sa.merge_heads(sa.softmax(qh @ kh.T / sp.sqrt(d) + bias) @ vh, HEADS)
    else:
        bias = sa.entries(n, keys, lambda i, j: case.formula(i, j, tables)).expr
        output = sa.softmax(q * k.T / sp.sqrt(d) + bias) * v
    inputs = (q, k, v, *(t for name, t in tables.items() if name not in case.constants))
    constants = tuple(tables[c] for c in case.constants)
    learned = tuple(name for name in tables if name not in (*case.constants, *case.per_sequence))  # no batch axes
    return sa.Spec(
        name=f"tables_{kind}",
        summary="tables read at positions",
        inputs=inputs,
        output=output,
        constants=constants,
        parameters=learned,
    )


def _heads(x):
    return x.view(*x.shape[:-1], HEADS, D_K).transpose(-3, -2)


def reference(kind: str, q, k, v, *tables):
    """softmax(Q Kᵀ/√d + [f(i, j)]) V with the tables indexed by torch (per head: the heads split first)."""
    case = CASES[kind]
    i, j = _grid(q.shape[-2], k.shape[-2])
    bias = case.reference(i, j, dict(zip(case.tables, tables)))
    if case.heads:
        scores = _heads(q) @ _heads(k).mT / math.sqrt(D_K) + bias
        return (torch.softmax(scores, dim=-1) @ _heads(v)).transpose(-3, -2).reshape(q.shape)
    return torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]) + bias, dim=-1) @ v


def _inputs(kind: str, seed: int = 0):
    """Q, K, V (a batch of 2), the learned tables (no batch axis) and the constants (document ids, per sequence)."""
    case, g = CASES[kind], torch.Generator().manual_seed(seed)
    keys = M if case.cross else N
    width = HEADS * D_K if case.heads else WIDTH
    tensors = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (N, keys, keys)]
    sizes = {n: N, m: M}
    for name, shape in case.tables.items():
        rows, cols = (int(sp.sympify(s).subs(sizes)) for s in shape)
        if name in case.constants:
            tensors.append(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]], dtype=torch.float64)[..., None])
        elif name in case.per_sequence:
            tensors.append(torch.randn(2, rows, cols, generator=g, dtype=torch.float64))
        else:
            tensors.append(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return tensors


def _wanted(kind, inputs):
    """The reference's output, a cotangent, and the gradients of Q, K, V and the learned tables."""
    learned = len(inputs) - len(CASES[kind].constants)
    leaves = [x.clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
    out = reference(kind, *leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return out.detach(), cotangent, torch.autograd.grad(out, leaves[:learned], cotangent)


def _names(kind):
    return [str(x) for x in table_spec(kind).inputs]


KINDS = list(CASES)


@pytest.mark.parametrize("kind", KINDS)
def test_the_derivation_verifies_and_prints_the_scatter(kind):
    derivation = sa.derive(table_spec(kind))
    assert derivation.verify().ok
    text, latex = derivation.text(), derivation.latex()
    assert "Σ_{(i, j): (" in text and ") = (k, l)}" in text
    assert r"\sum_{(i, j):\, (" in latex and r"\right]_{k l}" in latex
    assert "a table entry collects the cotangent where it is read" in text.replace("each table entry", "a table entry")


@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_module_matches_autograd(kind):
    module = load(table_spec(kind), "torch")
    inputs = _inputs(kind)
    want, cotangent, grads = _wanted(kind, inputs)
    learned = len(grads)
    leaves = [x.clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
    got = module.forward(*leaves)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(_names(kind), torch.autograd.grad(got, leaves[:learned], cotangent), grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_the_numpy_module_matches_autograd(kind):
    module = load(table_spec(kind), "numpy")
    inputs = _inputs(kind, seed=1)
    want, cotangent, grads = _wanted(kind, inputs)
    out, saved = module.forward(*(x.numpy() for x in inputs))
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = module.backward(saved, cotangent.numpy())
    for name, w in zip(_names(kind), grads):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_the_jax_module_matches_autograd_under_jit(kind):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    module = load(table_spec(kind), "jax")
    inputs = _inputs(kind, seed=2)
    want, cotangent, grads = _wanted(kind, inputs)
    arrays = [x.numpy() for x in inputs]
    np.testing.assert_allclose(np.asarray(jax.jit(module.forward)(*arrays)), want.numpy(), rtol=1e-10, atol=1e-12)
    _, pullback = jax.vjp(module.forward, *arrays)
    for name, g, w in zip(_names(kind), pullback(cotangent.numpy()), grads):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


# a spec with fixed constants (the document ids) has no generated jvp yet (emit.forward_mode), tables or not
@pytest.mark.parametrize("kind", [k for k in KINDS if not CASES[k].constants])
def test_forward_mode_and_double_backward_match_torch(kind):
    spec = table_spec(kind)
    module = types.ModuleType(spec.name)  # rendered with its second closed form and its JVP
    exec(compile(codegen.render(spec, "torch"), spec.name, "exec"), module.__dict__)
    inputs = _inputs(kind, seed=3)
    learned = len(spec.inputs)
    g = torch.Generator().manual_seed(4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs[:learned]]
    out, tangent = module.jvp(*inputs, dict(zip(_names(kind), tangents)))
    constants = inputs[learned:]
    want_out, want_tangent = torch.func.jvp(
        lambda *x: reference(kind, *x, *constants), tuple(inputs[:learned]), tuple(tangents)
    )
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tangent, want_tangent, rtol=1e-10, atol=1e-12)

    def hvp(function):  # double backward: the second closed form differentiates the scatter and the read
        leaves = [x.clone().requires_grad_() for x in inputs[:learned]]
        first = torch.autograd.grad(function(*leaves, *constants).square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((f * t).sum() for f, t in zip(first, tangents)), leaves)

    for got, want in zip(hvp(module.forward), hvp(lambda *x: reference(kind, *x))):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", ["torch", "numpy", "jax"])
@pytest.mark.parametrize("kind", ["relative", "t5", "heads"])
def test_the_gradient_is_the_same_bits_on_every_run(kind, backend):
    inputs = _inputs(kind, seed=5)
    cotangent = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    if backend == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)
    module = load(table_spec(kind), backend)

    def gradient():
        if backend == "torch":
            leaves = [x.clone().requires_grad_() for x in inputs]
            return [g.numpy() for g in torch.autograd.grad(module.forward(*leaves), leaves, cotangent)]
        if backend == "numpy":
            _, saved = module.forward(*(x.numpy() for x in inputs))
            return list(module.backward(saved, cotangent.numpy()).values())
        _, pullback = jax.vjp(module.forward, *(x.numpy() for x in inputs))
        return [np.asarray(g) for g in pullback(cotangent.numpy())]

    first, second = gradient(), gradient()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, second))


def test_exact_evaluation_reads_and_scatters_entry_by_entry():
    b = sp.MatrixSymbol("b", n, 1)
    read = sa.entries(n, n, lambda i, j: b[sp.Min(sp.Abs(i - j), 2), 0] / 2).expr
    values = [sp.Rational(k + 1, 3) for k in range(4)]
    got = sa.lambdify([b], read, backend="exact", dims={n: 4})(np.array([[v] for v in values], dtype=object))
    assert np.asarray(got).tolist() == [[values[min(abs(i - j), 2)] / 2 for j in range(4)] for i in range(4)]

    weights = sp.MatrixSymbol("W", n, n)
    scatter = table_scatter(weights, b[sp.Min(sp.Abs(I - J), 2), 0])  # b̄ of the read, from W = G ⊙ [∂f/∂b]
    w = np.array([[sp.Rational(i * 4 + j, 7) for j in range(4)] for i in range(4)], dtype=object)
    got = sa.lambdify([weights], scatter, backend="exact", dims={n: 4})(w)
    want = [
        [sum((w[i, j] for i in range(4) for j in range(4) if min(abs(i - j), 2) == k), sp.S.Zero)] for k in range(4)
    ]
    assert np.asarray(got).tolist() == want


def test_the_scatter_is_the_transpose_of_the_read_exactly():
    # tr(Wᵀ [db[r, c]]) = tr(scatter(W)ᵀ db): the identity the reverse step prints, in rationals, per head's layout
    table, weights = sp.MatrixSymbol("T", n, HEADS), sp.MatrixSymbol("W", n, HEADS * n)
    read = sa.entries(n, n, lambda i, j, h: table[sp.Abs(i - j), h], heads=HEADS).expr.arg  # rows × H·cols
    (entry,) = read.reads
    left = sa.sum(sp.HadamardProduct(weights, read))
    right = sa.sum(sp.HadamardProduct(table_scatter(weights, entry), table))
    rng = np.random.default_rng(0)
    w = np.array([[sp.Rational(int(x), 7) for x in row] for row in rng.integers(-9, 9, (3, 3 * HEADS))], dtype=object)
    t = np.array([[sp.Rational(int(x), 5) for x in row] for row in rng.integers(-9, 9, (3, HEADS))], dtype=object)
    values = [sa.lambdify([weights, table], side, backend="exact", dims={n: 3})(w, t) for side in (left, right)]
    assert values[0] == values[1] and isinstance(values[0], sp.Rational)


def test_a_table_read_is_an_operand_and_no_n_by_m_argument():
    spec = table_spec("relative")
    assert [str(s) for s in spec.inputs] == ["Q", "K", "V", "b"]
    source = codegen.render(spec, "torch", second_order=False)
    assert "table_read(b, torch.abs(" in source and "table_scatter(" in source
    # off CPU a sorted segment sum: CUDA's index_add_ and scatter_add_ sum atomically, in no fixed order
    assert "torch.segment_reduce(" in source and "scatter_add_" not in source


B = sp.MatrixSymbol("b", n, 1)


@pytest.mark.parametrize(
    ("rows", "cols", "formula", "message"),
    [
        (n, n, lambda i, j: B[i - j, 0], r"b\[i - j, 0\]'s row index i - j runs over \[1 - n, n - 1\]"),
        (n, m, lambda i, j: B[sp.Abs(i - j), 0], r"not shown to stay in \[0, n - 1\]"),
        (n, n, lambda i, j: B[(i + j) / 2, 0], r"index i/2 \+ j/2 is not an integer"),
        (n, n, lambda i, j: B[B[B[i, 0], 0], 0], "whose index reads a table again; an index reads a constant"),
        (n, n, lambda i, j: sp.MatrixSymbol("T", n, 2)[i, sp.Min(j, 2)], r"column index Min\(2, j\) runs over \[0, "),
    ],
    ids=["negative", "undecided", "not an integer", "read twice nested", "column out"],
)
def test_a_read_that_may_leave_its_table_is_refused_in_one_line(rows, cols, formula, message):
    with pytest.raises(SymattnError, match=message) as err:
        sa.entries(rows, cols, formula)
    assert "\n" not in str(err.value)


def test_a_per_head_read_is_checked_head_by_head():
    table = sp.MatrixSymbol("T", n, HEADS)
    sa.entries(n, n, lambda i, j, h: table[sp.Abs(i - j), h], heads=HEADS)  # h < HEADS: inside T
    with pytest.raises(SymattnError, match=r"column index h \+ 1 runs over \[1, 2\]"):
        sa.entries(n, n, lambda i, j, h: table[sp.Abs(i - j), h + 1], heads=HEADS)


def test_sympys_function_matrix_reading_a_table_gives_the_same_code():
    i, j = sp.symbols("i j", integer=True)
    spec = table_spec("relative")
    q, k, v, b = spec.inputs
    spelled = sp.FunctionMatrix(n, n, sp.Lambda((i, j), b[sp.Abs(i - j), 0]))
    other = sa.Spec(
        name=spec.name,
        summary=spec.summary,
        inputs=spec.inputs,
        output=sa.softmax(q * k.T / sp.sqrt(d) + spelled) * v,
        parameters=("b",),
    )
    assert codegen.render(other, "torch") == codegen.render(spec, "torch")


def test_a_table_the_spec_does_not_declare_is_refused_in_one_line():
    spec = table_spec("relative")
    q, k, v, _ = spec.inputs
    with pytest.raises(SymattnError) as err:
        sa.Spec(name="undeclared", summary="s", inputs=(q, k, v), output=spec.output)
    assert "b" in str(err.value) and "\n" not in str(err.value)


def test_the_numpy_module_keeps_float32_with_a_table():
    module = load(table_spec("t5"), "numpy")
    inputs = _inputs("t5", seed=8)
    out, saved = module.forward(*(x.float().numpy() for x in inputs))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference("t5", *inputs).numpy(), rtol=1e-5, atol=1e-6)
    grads = module.backward(saved, np.ones_like(out))
    assert grads["b"].dtype == np.float32 and grads["b"].shape == (BUCKETS, 1)


SCATTERS = {  # (W's shape, (r, c) of the grids, the table's shape)
    "relative": ((N, N), lambda i, j: ((i - j).abs(), 0), (N, 1)),
    "window": ((N, M), lambda i, j: (torch.clamp((i - j).abs(), max=WINDOW), 0), (WINDOW + 1, 1)),
    "heads": ((N, HEADS * N), lambda i, j: ((i - j + N * torch.floor(j / N)).abs(), torch.floor(j / N)), (N, HEADS)),
}


@pytest.mark.parametrize("kind", list(SCATTERS))
def test_the_torch_scatter_sums_alike_by_sorting_and_in_sequence(kind):
    # b̄[k, l] = Σ_{(i, j): (r, c) = (k, l)} Wᵢⱼ: the sorted segment sum (what runs off CPU) and CPU's sequential sum
    from symattn.codegen.backends.torch.positions_runtime import table_scatter as scatter

    shape, index, (rows, cols) = SCATTERS[kind]
    w = torch.randn(2, *shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    by_sorting, in_sequence = (scatter(w, index, rows, cols, by_sorting=flag) for flag in (True, False))
    assert torch.equal(by_sorting, in_sequence)
    i, j = (torch.arange(size, dtype=torch.float64) for size in shape)
    r, c = (torch.as_tensor(x).long().expand(shape) for x in index(i[:, None], j[None, :]))
    want = torch.zeros(2, rows, cols, dtype=torch.float64)
    for a in range(shape[0]):
        for b in range(shape[1]):
            want[:, r[a, b], c[a, b]] += w[:, a, b]
    torch.testing.assert_close(by_sorting, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["relative", "heads"])
def test_torch_func_vmap_of_grad_through_the_scatter(kind):
    module = load(table_spec(kind), "torch")
    q, k, v, table = _inputs(kind, seed=10)

    def per_sequence(function):  # ∂/∂b of one sequence's loss, one sequence at a time under vmap
        loss = lambda b, *x: function(*x, b).square().sum()  # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(table, q, k, v)

    want = per_sequence(lambda *x: reference(kind, *x))
    torch.testing.assert_close(per_sequence(module.forward), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("index", "bounds"),
    [
        (sp.Abs(I - J), (0, n - 1)),
        (I - J + n - 1, (0, 2 * n - 2)),
        (sp.Min(sp.Abs(I - J), 3), (0, sp.Min(3, n - 1))),
        (sp.floor(sp.log(1 + sp.Abs(I - J))), (0, sp.floor(sp.log(n)))),
        (sp.Piecewise((4, J > I), (0, True)) + sp.Min(I, 3), (0, 4 + sp.Min(3, n - 1))),
        (I * J, (0, (n - 1) ** 2)),
    ],
    ids=["abs", "offset", "clamped", "log", "piecewise", "product"],
)
def test_read_bounds_of_an_index(index, bounds):
    # interval bounds over 0 ≤ i, j ≤ n − 1, node by node (BOUND_RULES)
    got = read_bounds(index, {I: (sp.S.Zero, n - 1), J: (sp.S.Zero, n - 1)})
    assert got is not None and all(sp.simplify(g - w) == 0 for g, w in zip(got, bounds))


def _t5_bucket(clamped: bool) -> sp.Expr:
    """T5's bidirectional bucket of i − j as its code computes it: exact below 8, then logarithmic, capped at 15
    (clamped) or not; the log's branch is taken only where |i − j| ≥ 8, and truncated toward zero."""
    distance = sp.Abs(I - J)
    x = sp.log(distance / 8) / sp.log(16) * 8
    large = 8 + sp.Piecewise((sp.floor(x), x >= 0), (sp.ceiling(x), True))
    large = sp.Min(large, 15) if clamped else large
    return 16 * sp.Piecewise((1, I - J < 0), (0, True)) + sp.Piecewise((distance, distance < 8), (large, True))


def test_a_piecewise_index_is_bounded_under_each_branchs_condition():
    """The logarithmic branch is bounded where |i − j| ≥ 8 (its log ≥ 0): T5's bucket stays in [0, 31] at every
    length; without its cap at 15 it may leave a 32-entry table, and is refused."""
    n, m = dim("n"), dim("m")
    b = sp.MatrixSymbol("b", 32, 1)
    low, high = read_bounds(_t5_bucket(True), {I: (0, n - 1), J: (0, m - 1)})
    assert low == 0 and all(high.subs({n: size, m: size}) <= 31 for size in (9, 100, 10**6))
    sa.entries(n, m, lambda i, j: b[_t5_bucket(True).xreplace({I: i, J: j}), 0])
    with pytest.raises(SymattnError, match="not shown to stay in"):
        sa.entries(n, m, lambda i, j: b[_t5_bucket(False).xreplace({I: i, J: j}), 0])


def _document_heads(per_head: bool) -> sa.Spec:
    """Multi-head self-attention with a document mask read from ids doc (n × 1, one per sequence): per head
    (``heads=H``), or one matrix of positions beside the per-head scores."""
    x, doc = sa.matrix("x", n, d), sp.MatrixSymbol("doc", n, 1)
    weights = [sa.matrix(f"W_{p}", d, d) for p in "qkv"]
    q, k, v = (sa.split_heads(x @ w, HEADS) for w in weights)
    same = lambda i, j, *h: sp.Piecewise((0, sp.Eq(doc[i, 0], doc[j, 0])), (-sp.oo, True))  # noqa: E731
    mask = sa.entries(n, n, same, heads=HEADS) if per_head else sa.entries(n, n, same)
    out = sa.merge_heads(sa.softmax(q @ k.T + mask) @ v, HEADS)
    inputs = (x.expr, *(w.expr for w in weights))
    return sa.Spec("document_heads", "documents per head", inputs, out.expr, constants=(doc,))


def test_a_per_sequence_read_beside_the_heads_is_per_head_or_refused():
    """Ids of each sequence read beside per-head scores: written per head, right at batch sizes equal to the head
    count and not; one matrix of positions for every head, refused in one line (generated code would line the
    sequences' axis up with the heads')."""
    module = load(_document_heads(True), "torch")
    for batch in (HEADS, HEADS + 1):
        generator = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, N, 2 * D_K, dtype=torch.float64, generator=generator)
        weights = [torch.randn(2 * D_K, 2 * D_K, dtype=torch.float64, generator=generator) for _ in range(3)]
        docs = torch.tensor([0, 0, 1, 1, 1, 2] * batch, dtype=torch.float64).view(batch, N, 1)
        docs[0] = torch.tensor([[0], [1], [1], [1], [2], [2]])
        q, k, v = ((x @ w).unflatten(-1, (HEADS, D_K)).transpose(1, 2) for w in weights)
        mask = torch.where(docs == docs.mT, 0.0, -math.inf)[:, None]
        want = (torch.softmax(q @ k.mT + mask, dim=-1) @ v).transpose(1, 2).flatten(-2)
        assert torch.allclose(module.forward(x, *weights, docs), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(SymattnError, match=r"reads a constant per sequence beside per-head values.*heads=H") as caught:
        codegen.render(_document_heads(False), "torch", second_order=False)
    assert "\n" not in str(caught.value)
