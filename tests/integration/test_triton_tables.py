"""Tables read at positions in the Triton kernels (issue 52), under Triton's interpreter (CPU float32, n and m not
multiples of the 16 × 16 tile).

Each tile gathers the table at its positions' index (``tl.load(TAB_b + r · stride, mask=inside)``), in the forward,
both parts of the backward, the fused JVP (the tangent table gathered at the same index) and the eager core a second
derivative differentiates. The table's gradient b̄[k] = Σ_{(i, j): index(i, j) = k} (G ⊙ ∂A/∂b[r, c])ᵢⱼ is a
histogram per program of the backward's query part (one-hot over the table's slots, summed over the tile), written
to its own row, and the rows summed by the host in a fixed order: no atomics, the same bits on every run.

The cases are test_positions_tables.py's: a learned relative bias b[|i − j|, 0], a causal window clamped
b[min(|i − j|, w), 0], T5's buckets, a per-head table T[|i − j|, h] (alone and under a causal mask), row and column
tables b1[i, 0] + b2[j, 0] with n ≠ m, and document ids per sequence (a constant with a batch axis) beside a
relative bias. Output and every gradient (the table's included) match torch autograd of an independent float64
forward (the tables indexed by torch), causal and not, and so do a learned table per sequence, per-sequence gradients
under torch.func.vmap and torch.compile; the JVP matches torch.func.jvp of it; the double backward (the eager core)
autograd's; no tensor of n × m entries is made; a table larger than the histogram takes, and a table in a
log-softmax map, are refused in one line. The kernels compile for sm_90 and fit an H100's shared memory:
test_triton.py's test_every_kernel_compiles_for_an_h100_and_fits_its_shared_memory.
"""

from __future__ import annotations

import math

import pytest
import sympy as sp
import test_positions_tables as small  # its cases at its own sizes (n = 6, m = 7)
from test_positions_tables import CASES, D_K, table_spec
from triton_rendered import compare, torch, triton_module  # (skips without torch, triton or the interpreter)

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs import dim

n, m = dim("n"), dim("m")
N, M, D = 37, 45, 8  # the sizes run (keys M where the case is cross attention, n ≠ m)
KINDS = ["relative", "window", "t5", "heads", "heads_causal", "row_column", "documents"]


def _heads(x, heads: int):
    return x.view(*x.shape[:-1], heads, D_K).transpose(-3, -2)


def reference(kind: str, q, k, v, *tables, causal: bool = False):
    """softmax(Q Kᵀ/√d + [f(i, j)]) V in float64, the tables indexed by torch (per head: the heads split first);
    causal: query i sees keys j ≤ i. A row with no key to see gives 0."""
    case = CASES[kind]
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    bias = case.reference(i, j, dict(zip(case.tables, tables)))
    heads = q.shape[-1] // D_K if case.heads else None
    if heads:
        q, k, v = (_heads(x, heads) for x in (q, k, v))
    a = q @ k.mT / math.sqrt(q.shape[-1]) + bias
    if causal:
        a = a.masked_fill(j > i, -math.inf)
    seen = a.amax(-1, keepdim=True) > -math.inf
    out = (torch.softmax(torch.where(seen, a, 0.0), -1) * seen) @ v
    return out.transpose(-3, -2).flatten(-2) if heads else out


def _inputs(kind: str, seed: int = 0) -> list:
    """Q, K, V (a batch of 2), the learned tables (no batch axis), then the constants (document ids per sequence)."""
    case, g = CASES[kind], torch.Generator().manual_seed(seed)
    keys, width = (M if case.cross else N), (2 * D_K if case.heads else D)
    tensors = [torch.randn(2, r, width, generator=g, dtype=torch.float64) for r in (N, keys, keys)]
    for name, shape in case.tables.items():
        rows, cols = (int(sp.sympify(s).subs({n: N, m: M})) for s in shape)
        if name in case.constants:  # sorted ids: documents of random lengths, each sequence its own
            ids = torch.randint(0, 5, (2, rows, cols), generator=g).sort(dim=-2).values
            tensors.append(ids.to(torch.float64))
        else:
            tensors.append(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return tensors


def _learned(kind: str) -> int:
    return len(table_spec(kind).inputs)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_tables")


def _gradients(function, inputs, learned, cotangent, **options):
    leaves = [x.detach().clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
    out = function(*leaves, **options)
    return out.detach(), torch.autograd.grad(out, leaves[:learned], cotangent)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_every_gradient_match_autograd_of_the_independent_forward(kind, causal, folder):
    inputs, learned = _inputs(kind, seed=1), _learned(kind)
    module = triton_module(table_spec(kind), folder)
    leaves = [x.clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
    want = reference(kind, *leaves, causal=causal)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    wanted = torch.autograd.grad(want, leaves[:learned], cotangent)
    out, grads = _gradients(
        lambda *x: module.forward(*x, causal=causal), [x.float() for x in inputs], learned, cotangent.float()
    )
    compare(out, want.detach(), f"{kind} forward", rtol=1e-4)
    for name, got, expected in zip(table_spec(kind).input_names, grads, wanted):
        assert got.shape == expected.shape and got.dtype == torch.float32
        compare(got, expected, f"{kind} d{name}", rtol=1e-4)


@pytest.mark.parametrize(("kind", "causal"), [("relative", True), ("t5", False), ("heads_causal", False)])
def test_jvp_matches_torch_func_jvp_of_the_independent_forward(kind, causal, folder):
    """The tangent of the table read at the same index as the table (the JVP kernel's gather of ḃ)."""
    inputs, learned = _inputs(kind, seed=3), _learned(kind)
    g = torch.Generator().manual_seed(4)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs[:learned]]
    module = triton_module(table_spec(kind), folder)
    names = table_spec(kind).input_names
    out, tangent = module.jvp(
        *(x.float() for x in inputs), {k: t.float() for k, t in zip(names, tangents)}, causal=causal
    )
    want, want_tangent = torch.func.jvp(
        lambda *x: reference(kind, *x, causal=causal), tuple(inputs[:learned]), tuple(tangents)
    )
    compare(out, want, f"{kind} jvp output", rtol=1e-4)
    compare(tangent, want_tangent, f"{kind} jvp tangent", rtol=1e-4)
    only_table = module.jvp(*(x.float() for x in inputs), {names[-1]: tangents[-1].float()}, causal=causal)[1]
    zero = [torch.zeros_like(t) for t in tangents[:-1]]
    want_table = torch.func.jvp(
        lambda *x: reference(kind, *x, causal=causal), tuple(inputs[:learned]), (*zero, tangents[-1])
    )[1]
    compare(only_table, want_table, f"{kind} jvp along the table alone", rtol=1e-4)


@pytest.mark.parametrize("kind", ["relative", "heads"])
def test_double_backward_through_the_eager_core_matches_autograd(kind, folder):
    """create_graph: the eager core (the table indexed by torch) differentiated twice, the table's second derivative
    included (a Hessian-vector product of ‖O‖²)."""
    inputs, learned = _inputs(kind, seed=5), _learned(kind)
    direction = [torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64) for x in inputs]
    module = triton_module(table_spec(kind), folder)

    def hvp(function, tensors):
        leaves = [x.clone().requires_grad_() for x in tensors]
        first = torch.autograd.grad(function(*leaves).square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((f * t).sum() for f, t in zip(first, direction)), leaves)

    got = hvp(module.forward, [x.float() for x in inputs[:learned]])
    want = hvp(lambda *x: reference(kind, *x), inputs[:learned])
    for name, a, b in zip(table_spec(kind).input_names, got, want):
        compare(a, b, f"{kind} hvp {name}", rtol=1e-4)


@pytest.mark.parametrize("kind", ["relative", "heads_causal"])
def test_the_tables_gradient_is_the_same_bits_on_every_run(kind, folder):
    inputs, learned = _inputs(kind, seed=7), _learned(kind)
    module = triton_module(table_spec(kind), folder)
    cotangent = torch.randn(2, N, inputs[0].shape[-1], generator=torch.Generator().manual_seed(8))
    runs = [_gradients(module.forward, [x.float() for x in inputs], learned, cotangent)[1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert runs[0][-1].abs().sum() > 0  # (a gradient that is there)


def test_a_table_larger_than_the_histogram_takes_is_refused_in_one_line(folder):
    """257 entries (> 256 slots): read at any size (the forward, under no_grad or not), its gradient refused in one
    line by the backward, before any launch."""
    module = triton_module(table_spec("relative"), folder)
    q, k, v = (torch.randn(1, 257, 4, requires_grad=True) for _ in range(3))
    table = torch.randn(257, 1, requires_grad=True)
    want = reference("relative", *(x.detach().double() for x in (q, k, v, table)))
    with torch.no_grad():
        compare(module.forward(q, k, v, table), want, "a 257-entry table read under no_grad", rtol=1e-4)
    out = module.forward(q, k, v, table)
    with pytest.raises(ValueError, match=r"the table b read at positions has 257 entries.*at most 256") as caught:
        torch.autograd.grad(out.sum(), [q, table])
    assert "\n" not in str(caught.value)


def test_a_table_in_a_log_softmax_map_is_refused_in_one_line():
    q, k, b = sa.matrix("Q", n, 4), sa.matrix("K", n, 4), sp.MatrixSymbol("b", n, 1)
    logits = q * k.T + sa.entries(n, n, lambda i, j: b[sp.Abs(i - j), 0])
    spec = sa.Spec("map_table", "a pointer map with a table", (q.expr, k.expr, b), sa.log_softmax(logits).expr)
    with pytest.raises(SymattnError, match=r"a table read at positions \(b\) in a log-softmax map") as caught:
        codegen.render(spec, "triton")
    assert "\n" not in str(caught.value)


def test_the_tables_are_gathered_and_no_n_by_m_tensor_is_made(folder):
    """Row and column tables b1[i, 0] + b2[j, 0] (n = 37 ≠ m = 45): the kernels gather them (and their tangents) and
    add no atomics, and no torch op of forward, backward or jvp makes a tensor with both n and m among its axes (the
    gradients' partial histograms are (batch·heads, row blocks, slots))."""
    from torch.utils._python_dispatch import TorchDispatchMode

    module = triton_module(table_spec("row_column"), folder)
    source = codegen.render(table_spec("row_column"), "triton")
    assert all(f"tl.load(TAB_{t} + " in source for t in ("b1", "b2", "b1_dot", "b2_dot"))
    assert "tl.atomic_" not in source and "_histogram(" in source
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(
                tuple(x.shape) for x in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(x)
            )
            return out

    inputs = [x.float() for x in _inputs("row_column", seed=9)]
    with Shapes():
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = module.forward(*leaves, causal=True)
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        module.jvp(*inputs, {"b2": torch.ones_like(inputs[-1])})
    assert shapes and not [s for s in shapes if N in s and M in s]


def test_a_learned_table_per_sequence_gets_its_gradient_per_sequence(folder):
    """b[i − j + n − 1, 0] with b (2, 2n − 1, 1), one table per sequence (test_positions_tables.py's sizes, n = 6):
    each batch·head gathers its own, and its gradient keeps the batch axis (the partial histograms summed over the row
    blocks only)."""
    inputs = small._inputs("offset", seed=3)
    want, cotangent, wanted = small._wanted("offset", inputs)
    module = triton_module(table_spec("offset"), folder)
    out, grads = _gradients(module.forward, [x.float() for x in inputs], len(inputs), cotangent.float())
    compare(out, want, "offset forward", rtol=1e-4)
    for name, got, expected in zip(table_spec("offset").input_names, grads, wanted):
        assert got.shape == expected.shape
        compare(got, expected, f"offset d{name}", rtol=1e-4)


@pytest.mark.parametrize("how", ["vmap", "compile"])
def test_per_sequence_gradients_under_vmap_and_torch_compile(how, folder):
    """torch.func.vmap of torch.func.grad (one sequence at a time: the backward op's vmap rule, the tables' views
    merged with the batch·heads), and torch.compile(fullgraph=True) of forward and backward (the ops' fake shapes),
    against autograd of the independent forward (per head, test_positions_tables.py's sizes)."""
    module = triton_module(table_spec("heads"), folder)
    q, k, v, table = small._inputs("heads", seed=10)
    if how == "vmap":

        def per_sequence(function, dtype):  # ∂/∂T of one sequence's loss, one sequence at a time under vmap
            loss = lambda b, *x: function(*x, b).square().sum()  # noqa: E731
            arguments = (x.to(dtype) for x in (table, q, k, v))
            return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0, 0))(*arguments)

        want = per_sequence(lambda *x: small.reference("heads", *x), torch.float64)
        compare(per_sequence(module.forward, torch.float32), want, "vmap of grad: dT per sequence", rtol=1e-4)
        return
    compiled = torch.compile(module.forward, fullgraph=True, backend="aot_eager")
    inputs = [q, k, v, table]
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    got = _gradients(compiled, [x.float() for x in inputs], 4, cotangent.float())
    want = _gradients(lambda *x: small.reference("heads", *x), inputs, 4, cotangent)
    compare(got[0], want[0], "compiled forward", rtol=1e-4)
    for name, a, b in zip("QKVT", got[1], want[1]):
        compare(a, b, f"compiled d{name}", rtol=1e-4)
