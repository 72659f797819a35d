"""big_matmul, placed_rows and row_softmax compiled: the custom ops symattn::big_matmul (the eager huge-page
product), symattn::placed_rows (P's blocks joined into huge pages) and symattn::row_softmax_ (softmax written over
the scores) in torch.compile's graphs, from 4 MiB on, registered lazily, once per process, by whichever generated
module is compiled first."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from functorch.compile import make_boxed_func  # noqa: E402 (after the skip: it needs torch)
from symattn.generated import attention_torch, attention_torch_memeff, mha_torch  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

GENERATED = Path(attention_torch.__file__).parent


def _recording_backend(graphs: list):
    """aot_autograd's graphs (forward, then backward) appended to graphs as code, run as they are."""

    def record(gm, _inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def _step(function, leaves):
    """The output and the gradients of ⟨G, output⟩, G a fixed ramp."""
    out = function(*leaves)
    weighted = out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out.detach(), torch.autograd.grad(weighted.sum(), leaves)


def _qkv(heads=2, n=512, d=4):
    """Queries, keys and values (float64) whose scores reach the 4 MiB from which a compiled big_matmul calls the
    op: 2 heads of 512 × 512 (4 MiB), 8 heads for the last block of 128 causal rows."""
    torch.manual_seed(0)
    return [torch.randn(1, heads, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def _mha():
    """4 heads, 512 tokens: scores of 8 MiB (float64), causal blocks of 2 MiB."""
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(16, num_heads=4, dtype=torch.float64)
    x = torch.randn(1, 512, 16, dtype=torch.float64, requires_grad=True)
    return module, [x, *module.parameters()]


def _cases() -> dict:
    """name → (a function of the leaves, the leaves, whether its products reach 4 MiB: the ops in its graphs)."""
    module, leaves = _mha()
    return {
        "attention": (attention_torch.forward, _qkv(), True),
        "attention causal": (lambda q, k, v: attention_torch.forward(q, k, v, causal=True), _qkv(heads=8), True),
        "attention memeff causal": (
            lambda q, k, v: attention_torch_memeff.forward(q, k, v, causal=True, block_size=256),
            _qkv(heads=4),
            True,
        ),
        "attention memeff causal, small blocks": (
            lambda q, k, v: attention_torch_memeff.forward(q, k, v, causal=True),
            _qkv(heads=4),
            False,
        ),
        "mha": (lambda x, *_: module(x, x, x), leaves, True),
        "mha causal": (lambda x, *_: module(x, x, x, causal=True), leaves, False),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
def test_compiled_graphs_call_the_op_and_match_eager(name):
    # the scores Q Kᵀ in the forward graph, dP = dO Vᵀ in the backward's, and the forward's softmax over the
    # scores, from 4 MiB on (below, inductor's own buffers); fullgraph=True: no break around them
    function, leaves, op = _cases()[name]
    graphs: list[str] = []
    torch._dynamo.reset()
    compiled = torch.compile(function, backend=_recording_backend(graphs), fullgraph=True)
    want, got = _step(function, leaves), _step(compiled, leaves)
    assert len(graphs) == 2 and [("torch.ops.symattn.big_matmul.default" in code) for code in graphs] == [op, op]
    assert ("torch.ops.symattn.row_softmax_.default" in graphs[0]) == op
    # causal: P's blocks joined into huge pages by the second op (P of 4 MiB or more: 16 MiB, mha's 8 MiB), in the
    # forward graph
    assert ("torch.ops.symattn.placed_rows.default" in graphs[0]) == (name in ("attention causal", "mha causal"))
    assert (got[0] - want[0]).abs().max() < 1e-9
    for a, b in zip(got[1], want[1], strict=True):
        assert (a - b).abs().max() < 1e-9


@pytest.mark.slow
@pytest.mark.skipif(
    not any(shutil.which(name) for name in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend (inductor) compiles C++: no C++ compiler on PATH",
)
def test_inductor_calls_the_op_and_matches_eager():
    # inductor calls the ops as extern kernels: the scores' buffer is the product's own, softmax written over it
    # (the mutation put back in place: no buffer of inductor's own the scores' size, as in eager code)
    from torch._inductor.utils import run_and_get_code

    leaves = _qkv()
    torch._dynamo.reset()
    compiled = torch.compile(attention_torch.forward, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(_step, compiled, leaves)
    want = _step(attention_torch.forward, leaves)
    assert len(codes) == 2 and all("torch.ops.symattn.big_matmul.default(" in code for code in codes)
    assert "torch.ops.symattn.row_softmax_.default(buf" in codes[0]
    assert "empty_strided_cpu((1, 2, 512, 512)" not in codes[0]
    assert (got[0] - want[0]).abs().max() < 1e-9
    for a, b in zip(got[1], want[1], strict=True):
        assert (a - b).abs().max() < 1e-9


def test_the_op_is_a_matmul_with_its_gradients():
    # d(a b) = da b + a db: the op's fake (shape, dtype), autograd and schema checked by torch's opcheck
    assert attention_torch._compiled_ops()
    a = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.equal(torch.ops.symattn.big_matmul(a, b), a @ b)
    torch.library.opcheck(torch.ops.symattn.big_matmul.default, (a, b))
    assert torch.autograd.gradcheck(torch.ops.symattn.big_matmul, (a, b))


def test_placed_rows_joins_blocks_with_their_gradients():
    # P's blocks of rows (…, b_i, k_i) at their first keys, zero on the others: the op against pad + cat, its fake,
    # autograd and schema checked by torch's opcheck, its gradient (each block's rows and keys) by gradcheck
    assert attention_torch._compiled_ops()
    parts = [torch.randn(2, b, k, dtype=torch.float64, requires_grad=True) for b, k in ((3, 2), (2, 4), (1, 5))]
    starts, m = [0, 1, 2], 7
    want = torch.cat([torch.nn.functional.pad(p, (s, m - s - p.shape[-1])) for p, s in zip(parts, starts)], dim=-2)
    assert torch.equal(torch.ops.symattn.placed_rows(parts, starts, m), want)
    torch.library.opcheck(torch.ops.symattn.placed_rows.default, (parts, starts, m))
    assert torch.autograd.gradcheck(lambda *p: torch.ops.symattn.placed_rows(list(p), starts, m), tuple(parts))


def test_row_softmax_in_place_is_softmax():
    # softmax along the last axis written over its argument: the op's fake and schema (it mutates a) checked by
    # torch's opcheck; no autograd (called only on tensors that require no grad)
    assert attention_torch._compiled_ops()
    a = torch.randn(2, 5, 7, dtype=torch.float64)
    want = torch.softmax(a, dim=-1)
    assert torch.ops.symattn.row_softmax_(a) is None and torch.equal(a, want)
    torch.library.opcheck(torch.ops.symattn.row_softmax_.default, (a,), test_utils=("test_schema", "test_faketensor"))


def test_two_generated_modules_share_one_registration():
    # the generated file executed again as a second module (its own copy of the helpers) compiles: the op is
    # registered once, by whichever module is compiled first, and found by the others
    source = (GENERATED / "attention_torch.py").read_text(encoding="utf-8")
    twins = []
    for name in ("_symattn_twin_1", "_symattn_twin_2"):
        twin = types.ModuleType(name)
        sys.modules[name] = twin  # dynamo reads a function's globals through its module
        exec(compile(source, name, "exec"), twin.__dict__)
        twins.append(twin)
    try:
        leaves = _qkv()
        want = _step(attention_torch.forward, leaves)
        for twin in twins:
            assert twin._compiled_ops()
            torch._dynamo.reset()
            got = _step(torch.compile(twin.forward, backend="aot_eager", fullgraph=True), leaves)
            assert (got[0] - want[0]).abs().max() < 1e-9
    finally:
        for twin in twins:
            del sys.modules[twin.__name__]


def test_transforms_inside_a_compiled_function_take_the_plain_product():
    # the op has no vmap or functorch-grad rule: under torch.func, compiled or not, big_matmul is a @ b
    q, k, v = (x.detach() for x in _qkv(heads=4))  # 2 MiB per sample: the op, were it not for the transforms

    def per_sample(q, k, v):
        return torch.func.grad(lambda *t: attention_torch.forward(*t).sin().sum())(q, k, v)

    function = torch.func.vmap(per_sample)
    graphs: list[str] = []
    torch._dynamo.reset()
    got = torch.compile(function, backend=_recording_backend(graphs), fullgraph=True)(q, k, v)
    assert graphs and not any("symattn.big_matmul" in code for code in graphs)
    assert (got - function(q, k, v)).abs().max() < 1e-9


def test_importing_and_running_eager_registers_nothing():
    # lazy: importing generated modules and running them eagerly neither imports dynamo nor registers the op
    script = (
        "import sys, torch\n"
        "from symattn.generated import attention_torch, mha_torch\n"
        "q = torch.randn(1, 2, 8, 4, requires_grad=True)\n"
        "attention_torch.forward(q, q, q).sum().backward()\n"
        "print('torch._dynamo' in sys.modules, hasattr(torch.ops.symattn, 'placed_rows'))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["False", "False"]
