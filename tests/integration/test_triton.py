"""The Triton modules under Triton's interpreter (TRITON_INTERPRET=1, CPU float32 tensors), at sizes with partial
blocks (n = 37, m = 45, d = 24, 2 × 2 batch·heads): forward and every gradient against torch autograd of an
independent eager forward in float64, with and without causal, and against the generated torch module."""

from __future__ import annotations

import importlib.util
import math
import runpy
from pathlib import Path

import pytest
from sm90 import DTYPES, H100_SHARED, HEAD_DIMS, compile_kernels
from triton_rendered import (
    DV,
    REFERENCES,
    D,
    M,
    N,
    attend,
    compare,
    features_spec,
    gallery,
    interpreted,
    random_inputs,
    torch,
    triton_module,
)

import symattn as sa
from symattn.codegen.generate import render
from symattn.errors import SymattnError


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("triton_modules")


def _check(module, reference, inputs: dict, causal: bool, what: str, generator, *constants) -> tuple:
    """Forward and every input's gradient of the module (the constants after the inputs) against autograd of the
    float64 reference; (output, gradients, cotangent)."""
    out = module.forward(*inputs.values(), *constants, causal=causal)
    cotangent = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, list(inputs.values()), cotangent)
    double = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
    want = reference(double, causal)
    want_grads = torch.autograd.grad(want, list(double.values()), cotangent.double())
    compare(out, want, f"{what} forward")
    for name, got, expected in zip(inputs, grads, want_grads):
        compare(got, expected, f"{what} d{name}", rtol=5e-5)
    return out, grads, cotangent


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_gallery_core_matches_autograd(name, causal, folder):
    generator = torch.Generator().manual_seed(7)
    spec = sa.spec(name) if name in sa.specs() else gallery(name)
    inputs = random_inputs(spec, generator)
    _check(triton_module(spec, folder), REFERENCES[name], inputs, causal, f"{name} causal={causal}", generator)


def _attention_reference(mask):
    def reference(x, causal):
        a = x["Q"] @ x["K"].mT / math.sqrt(D)
        if mask is not None:
            a = a + (
                torch.zeros(mask.shape, dtype=a.dtype).masked_fill(mask, -math.inf)
                if mask.dtype == torch.bool
                else mask
            )
        return attend(a, x["V"], causal)

    return reference


@pytest.mark.parametrize(
    "mask, causal",
    [(None, False), (None, True), ("float", False), ("bool", True)],
    ids=["plain", "causal", "float-mask", "bool-mask-causal"],
)
def test_attention_matches_autograd_and_the_torch_module(mask, causal, folder):
    from symattn.generated import attention_torch

    generator = torch.Generator().manual_seed(3)
    shapes = {"Q": (2, 2, N, D), "K": (2, 2, M, D), "V": (2, 2, M, DV)}
    inputs = {name: torch.randn(shape, generator=generator).requires_grad_() for name, shape in shapes.items()}
    if mask == "float":
        m = torch.randn((N, M), generator=generator)
    elif mask == "bool":
        m = torch.rand((2, 1, N, M), generator=generator) < 0.3
    else:
        m = None
    module = triton_module("attention", folder)
    out, grads, cotangent = _check(module, _attention_reference(m), inputs, causal, "attention", generator, m)
    theirs = attention_torch.forward(*inputs.values(), m, causal=causal)
    their_grads = torch.autograd.grad(theirs, list(inputs.values()), cotangent)
    assert (out - theirs).abs().max().item() < 1e-5
    assert all((a - b).abs().max().item() < 1e-4 for a, b in zip(grads, their_grads))


LAUNCHES = {  # each kernel's BLOCK_M × BLOCK_N, as a GPU's LAUNCH table and shared-memory rule may choose
    "tall": dict.fromkeys(("forward", "backward_keys", "backward_queries", "jvp"), (32, 16)),
    # and wide; the backward's parts launched apart, each its own blocks
    "mixed": {"forward": (16, 32), "backward_keys": (16, 32), "backward_queries": (32, 16), "jvp": (32, 32)},
}


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_blocks_of_any_heights_per_kernel_give_the_same_result(launch, folder, monkeypatch):
    """BLOCK_M ≠ BLOCK_N, and each kernel its own: causal output, every gradient and the JVP of grouped-query mha,
    and of a trainable scalar's core (its sums one per query block), against the modules at 16 × 16."""
    blocks = LAUNCHES[launch]

    def chosen(x, width, kernel):
        return dict(zip(("BLOCK_M", "BLOCK_N"), blocks[kernel]))

    _same_when_patched(folder, monkeypatch, ["mha", gallery("temperature")], "_launch", chosen, f"{launch} blocks")


def test_a_grid_with_more_batch_heads_than_its_axis_holds_swaps_its_axes(folder, monkeypatch):
    """Past GRID_Y batch·heads (65535 on CUDA; 1 here) each kernel's grid has its axes swapped (WIDE): the same
    causal output, gradients and JVP for grouped-query mha, a trainable scalar's core and a log-softmax map."""
    specs = ["mha", gallery("temperature"), gallery("pointer")]
    _same_when_patched(folder, monkeypatch, specs, "GRID_Y", 1, "swapped axes")


def _same_when_patched(folder, monkeypatch, specs: list, name: str, value, label: str) -> None:
    """Each spec's Triton module, causal: output, gradients and JVP with the module's name set to value (its launches
    planned again, some plan changed by it), against the same without."""
    generator = torch.Generator().manual_seed(31)
    shapes = {"Q": (2, N, 32), "K": (2, M, 32), "V": (2, M, 32), "W_Q": (32, 32), "W_K": (32, 16), "W_V": (32, 16)}
    mha = {k: (torch.randn(shape, generator=generator) / 3).requires_grad_() for k, shape in shapes.items()}
    mha["W_O"] = (torch.randn((32, 32), generator=generator) / 3).requires_grad_()
    for spec in specs:
        module = triton_module(spec, folder)
        inputs = mha if spec == "mha" else random_inputs(spec, generator)
        options = {"num_heads": 4, "num_kv_heads": 2, "causal": True} if spec == "mha" else {"causal": True}
        tangents = {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items()}
        want = _stepped(module, inputs, tangents, options)
        before = dict(module._PLANS)
        with monkeypatch.context() as patched:
            patched.setattr(module, name, value)
            patched.setattr(module, "_PLANS", {})  # the launches planned again under the patch (a plan kept: no test)
            got = _stepped(module, inputs, tangents, options)
            made = module._PLANS
        changed = [key for key, plan in before.items() if key in made and _settings(made[key]) != _settings(plan)]
        assert changed, f"{spec}: {name} changed nothing"
        for value_got, expected in zip(got, want):
            compare(value_got, expected.double(), f"{module.SPEC} at {label}", rtol=5e-5)


def _settings(plan):
    """A launch plan with each of its launches as its settings (grid and constexprs), to compare."""
    if isinstance(plan, tuple):
        return tuple(_settings(part) for part in plan)
    return getattr(plan, "settings", plan)


@pytest.mark.parametrize("size", [2, 4], ids=["16-bit", "float32"])
def test_a_gpu_launch_is_the_tables_setting_shrunk_to_fit_shared_memory(size, folder):
    """On a GPU (a CUDA tensor's is_cuda and element size are all _launch reads): LAUNCH's blocks, warps and stages;
    the blocks halved, down to 16, until one held block and num_stages streamed ones of padded rows, COPIES of each
    (the JVP's tangents), fit SHARED (the backward's key part streams query blocks, its query part key blocks)."""
    from types import SimpleNamespace

    module = triton_module("attention", folder)
    cuda = SimpleNamespace(is_cuda=True, element_size=lambda: size)
    for kernel, (block_m, block_n, warps, stages) in module.LAUNCH.items():
        for width in (40, 128, 256, 512):
            got = module._launch(cuda, width, kernel)
            blocks = [got["BLOCK_M"], got["BLOCK_N"]]
            streamed = module.STREAMED[kernel]
            row = module._width(width) * size * module.COPIES[kernel]
            assert (got["num_warps"], got["num_stages"]) == (warps, stages)
            assert all(b in (16, 32, 64, 128, 256) for b in blocks) and blocks[0] <= block_m and blocks[1] <= block_n
            needed = (blocks[1 - streamed] + stages * blocks[streamed]) * row
            assert needed <= module.SHARED or max(blocks) == 16, (kernel, width, got)
            if (block_m + block_n) * (1 + stages) * row <= module.SHARED:  # room for the table's blocks: kept
                assert blocks == [block_m, block_n], (kernel, width, got)
    assert module._launch(torch.zeros(1), 128, "forward") == {"BLOCK_M": 16, "BLOCK_N": 16}  # the interpreter's


def test_numeric_scalar_arguments_are_filled_once_and_a_trainable_scalar_every_call(folder):
    """The kernels' scalar arguments: numbers (1/√d, a scale) filled into a device tensor once per values and device,
    the same tensor on the next call (no fill launched per call), the cache kept small; a trainable scalar's tensor
    read every call (never a stale value); none: one entry 0."""
    module = triton_module("attention", folder)
    like = torch.zeros(2)
    first = module._scalar_tensor((0.5, 2), like)
    assert first is module._scalar_tensor((0.5, 2), like) and first.tolist() == [0.5, 2.0]
    assert first.dtype == torch.float32 and module._scalar_tensor((), like).tolist() == [0.0]
    tau = torch.tensor(1.5)
    assert module._scalar_tensor((tau, 0.5), like).tolist() == [1.5, 0.5]
    tau.fill_(3.0)
    assert module._scalar_tensor((tau, 0.5), like).tolist() == [3.0, 0.5]
    for i in range(100):
        assert module._scalar_tensor((i / 7,), like).item() == pytest.approx(i / 7)
    assert len(module._NUMBERS) <= 64


def _stepped(module, inputs: dict, tangents: dict, options: dict) -> list:
    """The module's output, every input's gradient (a cotangent of ones) and its JVP along tangents."""
    out = module.forward(*inputs.values(), **options)
    grads = torch.autograd.grad(out, list(inputs.values()), torch.ones_like(out))
    return [out, *grads, *module.jvp(*(x.detach() for x in inputs.values()), tangents, **options)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_float16_is_as_close_as_torchs_own_float16_attention(causal, folder):
    """float16 Q, K, V (float32 statistics and accumulators in the kernels): the error against float64 at most
    that of torch's eager float16 attention (its softmax in float32), forward and gradients."""
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(2, 2, size, D, generator=generator).half().requires_grad_() for size in (N, M, M)]
    module = triton_module("attention", folder)
    hidden = torch.ones(N, M, dtype=torch.bool).triu(1) if causal else torch.zeros(N, M, dtype=torch.bool)

    def eager(q, k, v):
        a = (q @ k.mT / math.sqrt(D)).masked_fill(hidden, -math.inf)
        return torch.softmax(a.float(), -1).to(v.dtype) @ v

    out = module.forward(*inputs, causal=causal)
    cotangent = torch.randn(out.shape, generator=generator).half()
    double = [x.detach().double().requires_grad_() for x in inputs]
    want = eager(*double)
    want_grads = torch.autograd.grad(want, double, cotangent.double())
    theirs = eager(*inputs)
    for got, mine, ref in zip(
        (out, *torch.autograd.grad(out, inputs, cotangent)),
        (theirs, *torch.autograd.grad(theirs, inputs, cotangent)),
        (want, *want_grads),
    ):
        assert got.dtype == torch.float16
        assert (got.double() - ref).abs().max() <= 1.5 * (mine.double() - ref).abs().max() + 1e-4


@pytest.mark.parametrize("name", ["softplus", "differential", "pointer", "sigmoid"])
def test_float16_cores_of_every_kind_are_as_close_as_eager_float16(name, folder):
    """float16 inputs of a row-sum normaliser, two cores, a log-softmax map and no normaliser (float32 statistics and
    accumulators in the kernels): the error of the output and every gradient against float64 at most 1.5× that of
    the same eager forward run in float16."""
    generator = torch.Generator().manual_seed(13)
    inputs = {k: x.detach().half().requires_grad_() for k, x in random_inputs(gallery(name), generator).items()}
    reference = REFERENCES[name]
    out = triton_module(gallery(name), folder).forward(*inputs.values(), causal=True)
    finite = out.isfinite()  # (pointer: −inf where causal hides a key, in every run)
    cotangent = torch.where(finite, torch.randn(out.shape, generator=generator), 0.0).half()
    double = {k: x.detach().double().requires_grad_() for k, x in inputs.items()}
    want = reference(double, True)
    theirs = reference(inputs, True)
    got = (out, *torch.autograd.grad(out, list(inputs.values()), cotangent))
    mine = (theirs, *torch.autograd.grad(theirs, list(inputs.values()), cotangent))
    wanted = (want, *torch.autograd.grad(want, list(double.values()), cotangent.double()))
    for what, a, b, ref in zip(["output", *inputs], got, mine, wanted):
        ours, eager = (torch.where(ref.isfinite(), x.double() - ref, 0.0).abs().max() for x in (a, b))
        assert a.dtype == torch.float16 and ours <= 1.5 * eager + 1e-4, (name, what, ours, eager)


def test_mha_in_float16_is_as_accurate_as_sdpa(folder):
    """mha in float16 against the same projections around SDPA (benchmarks/precision.py's case): D = rowsum(dO ⊙
    (O + R)) reads O before its rounding (R, O's rounding, kept by the forward kernel), so the worst gradient (W_Q's,
    b_Q's) is below SDPA's, whose fused kernel reads the rounded O (measured 0.44–0.48×; from the rounded O
    0.91–1.13×)."""
    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "precision.py"))
    module = triton_module("mha", folder)
    for causal in (False, True):
        found = bench["mha_case"](module, (2, 64, 128, 4), causal, torch.float16)
        assert found["ours"] <= 1.0 * found["sdpa"], (causal, found)


def test_a_row_with_every_key_masked_gives_zeros_not_nan(folder):
    module = triton_module("attention", folder)
    q, k, v = (torch.randn(1, size, D).requires_grad_() for size in (N, M, M))
    mask = torch.zeros(N, M, dtype=torch.bool)
    mask[5] = True
    out = module.forward(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out[0, 5], torch.zeros(D)) and torch.equal(q.grad[0, 5], torch.zeros(D))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_the_bias_gradient_is_the_same_bits_on_every_run(folder):
    spec = gallery("bias")
    module = triton_module(spec, folder)
    inputs = random_inputs(spec, torch.Generator().manual_seed(11))
    runs = [torch.autograd.grad(module.forward(*inputs.values(), causal=True).sum(), inputs["B"])[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_shapes_that_disagree_are_a_value_error_naming_them(folder):
    module = triton_module("attention", folder)
    with pytest.raises(ValueError, match=r"K has shape \(45, 23\)"):
        module.forward(torch.randn(N, D), torch.randn(M, D - 1), torch.randn(M, DV))


@pytest.mark.parametrize("name", ["linear"])
def test_a_spec_without_a_core_is_refused_in_one_line(name):
    with pytest.raises(SymattnError, match="no n × m core the Triton kernels cover") as err:
        render(gallery(name), "triton")
    assert "\n" not in str(err.value)


def test_each_records_triton_call_computes_its_function(tmp_path):
    """Each entrywise record's Triton call (its example's parameters), in a one-tile kernel, against torch's call of
    the same record (the integers of the linspace hold 0, ReLU′s and LeakyReLU′s kink, exactly)."""
    import sympy as sp

    import symattn.lang.functions as functions

    for record in functions.FUNCTIONS.values():
        if functions.TRITON not in record.calls or not issubclass(record, functions.Elementwise):
            continue
        node = record.example(sp.MatrixSymbol("x", 1, 61))
        call = node.call(functions.TRITON)
        body = call.format("x") if "{" in call else f"{call}(x)"
        source = (
            "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef kernel(X, Y, n, B: tl.constexpr):\n"
            f"    i = tl.arange(0, B)\n    x = tl.load(X + i, mask=i < n, other=1.0)\n"
            f"    tl.store(Y + i, {body}, mask=i < n)\n"
        )
        x = torch.linspace(-30, 30, 61) if record.function != "log" else torch.linspace(0.01, 30, 61)
        y = torch.empty_like(x)
        kernel = _kernel_from(source, tmp_path / f"record_{record.function}.py")
        kernel[(1,)](x, y, x.numel(), B=64)
        torch_call = node.call(functions.TORCH)
        want = eval(torch_call.format("x") if "{" in torch_call else f"{torch_call}(x)", {"torch": torch, "x": x})
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-6), record.function


def _kernel_from(source: str, path: Path):
    """The kernel of source, written to path and loaded under the interpreter."""
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    with interpreted():
        spec.loader.exec_module(module)
    return module.kernel


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_kind_of_step_at_once_matches_autograd(causal, folder):
    generator = torch.Generator().manual_seed(13)
    shapes = {"Q": (2, 2, N, D), "K": (2, 2, M, D), "V": (2, 2, M, DV), "B": (2, 2, N, M)}
    inputs = {name: torch.randn(shape, generator=generator).requires_grad_() for name, shape in shapes.items()}
    inputs["tau"] = torch.tensor(1.5, requires_grad=True)
    mask = (torch.rand((N, M), generator=generator) < 0.2) & ~torch.eye(N, M, dtype=torch.bool)  # a key per row
    module = triton_module(features_spec(), folder)

    def reference(x, c):
        a = x["tau"] * torch.tanh(x["Q"] @ x["K"].mT / math.sqrt(D)) + x["B"]
        return attend(a.masked_fill(mask, -math.inf), x["V"], c)

    _check(module, reference, inputs, causal, "features", generator, mask)


# every kind of step at once; a division by the row sums and no normaliser; two cores (their kernels numbered); a
# log-softmax map (O n × m, no V); a per-head causal table read at positions; a per-call block map (causal ∧
# documents). Each kernel compiled at head dimension 64 in 16-bit (NAME:fp32 also in float32), in full (PTX, cubin)
# but for CUT's (their template's branches through TTGIR and the allocation: the PTX and cubin of the same template
# are features')
GPU_KERNELS = {
    "features": ["_forward_kernel:fp32", "_delta_kernel", "_backward_kernel", "_jvp_kernel"],
    "softplus": ["_forward_kernel", "_delta_kernel", "_backward_kernel", "_jvp_kernel"],
    "sigmoid": ["_forward_kernel", "_backward_kernel", "_jvp_kernel"],
    "differential": ["_forward_kernel1", "_delta_kernel1", "_backward_kernel2"],
    "pointer": ["_forward_kernel:fp32", "_backward_kernel", "_jvp_kernel"],
    "tables": ["_forward_kernel", "_delta_kernel", "_backward_kernel", "_jvp_kernel"],
    "maps": ["_forward_kernel", "_backward_kernel", "_jvp_kernel"],
}
CUT = ("softplus", "sigmoid", "differential", "maps")
SWEPT = ("features", "pointer", "tables")  # a module per kernel template (a core's, a map's, a table's): every kernel
# of each at every dtype and head dimension (cut at shared memory's allocation: sm90.py)
PARTS = ("keys", "queries", "atomic")  # each backward kernel's launches apart (sm90.py), cut at the allocation


def _gpu_spec(name: str) -> sa.Spec:
    from test_positions_block_maps import _spec as mapped
    from test_positions_tables import table_spec

    made = {
        "features": features_spec,
        "tables": lambda: table_spec("heads_causal"),
        "maps": lambda: mapped("causal-documents"),
    }
    return made[name]() if name in made else gallery(name)


@pytest.mark.slow  # one subprocess: 13 kernels compiled in full, 132 cut at the allocation
def test_every_kernel_compiles_for_an_h100_and_fits_its_shared_memory(tmp_path):
    """Each kernel of GPU_KERNELS compiled for sm_90 at its launch there (the module's _launch), its batch·head index
    int64, no TF32; each kernel of SWEPT at every dtype and head dimension 64, 128, 256: the shared memory its launch
    asks for at most an H100's (227 KiB). The table printed (pytest -s; benchmarks/GPU.md)."""
    jobs = []
    for name, kernels in GPU_KERNELS.items():
        path = tmp_path / f"{name}_triton.py"
        path.write_text(render(_gpu_spec(name), "triton"), encoding="utf-8")
        names = [k.split(":")[0] for k in kernels]
        parted = [f"{k}@{part}" for k in names if k.startswith("_backward_kernel") for part in PARTS]
        whole = [(k, "fp16") for k in names] + [(k[:-5], "fp32") for k in kernels if k.endswith(":fp32")]
        jobs += [(path, kernel, dtype, 64, name not in CUT) for kernel, dtype in whole]
        if name in SWEPT:  # (the settings compiled in full not again)
            every = [(k, dtype, head) for k in names + parted for dtype in DTYPES for head in HEAD_DIMS]
            jobs += [(path, k, dtype, head, False) for k, dtype, head in every if head != 64 or (k, dtype) not in whole]
        else:
            jobs += [(path, k, "fp16", 64, False) for k in parted]
    rows = compile_kernels(jobs, tmp_path)
    assert [(r["module"], r["kernel"], r["dtype"], r["head"]) for r in rows] == [
        (p.stem, k, dtype, head) for p, k, dtype, head, _ in jobs
    ]
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    full = [r for r, job in zip(rows, jobs) if job[-1]]
    assert all(r["index"] == "int64" and r["tf32"] is False for r in full)
    checked = [r for r in full if r["cut"] is not None]  # the compile cut at the allocation counts as the full one
    assert [r for r in full if r["module"][: -len("_triton")] in SWEPT] == checked
    assert all(r["cut"] == r["shared"] for r in checked)
    over = [r for r in rows if r["shared"] > H100_SHARED]
    assert not over, f"past an H100's {H100_SHARED} bytes of shared memory: {over}"


def test_under_autocast_the_kernels_run_in_its_dtype_as_close_as_torchs_attention(folder):
    """torch.autocast (CPU, float16, as the interpreter runs it): float32 Q, K, V cast as autocast casts a product's
    operands; the output float16 and its error against float64 at most that of torch's attention under the same
    autocast; the gradients float32 (the inputs' dtype)."""
    generator = torch.Generator().manual_seed(43)
    inputs = [torch.randn(2, size, D, generator=generator).requires_grad_() for size in (N, M, M)]
    module = triton_module("attention", folder)
    with torch.autocast("cpu", dtype=torch.float16):
        out = module.forward(*inputs, causal=True)
        theirs = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in inputs), is_causal=True)
    assert out.dtype == torch.float16
    assert (out.double() - want).abs().max() <= 1.5 * (theirs.double() - want).abs().max() + 1e-4
    grads = torch.autograd.grad(out.float().sum(), inputs)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_a_trainable_scalars_gradient_is_as_accurate_as_eager_float32(folder):
    """dτ at τ = 2 (raw scores up to ~10²): summed from g ⊙ (∂A/∂τ − rowsum(P ⊙ ∂A/∂τ)), so the rounding of
    D = rowsum(dO ⊙ O) times the large ∂A/∂τ cancels; its error against float64 no larger than eager float32's."""
    spec = gallery("temperature")
    module, reference = triton_module(spec, folder), REFERENCES["temperature"]
    ours, eager = [], []
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        inputs = random_inputs(spec, generator)
        with torch.no_grad():
            inputs["tau"].fill_(2.0)
        out = module.forward(*inputs.values())
        cotangent = torch.randn(out.shape, generator=generator)
        got = torch.autograd.grad(out, [inputs["tau"]], cotangent)[0].item()
        double = {k: v.detach().double().requires_grad_() for k, v in inputs.items()}
        want = torch.autograd.grad(reference(double, False), [double["tau"]], cotangent.double())[0].item()
        single = {k: v.detach().requires_grad_() for k, v in inputs.items()}
        torch_float32 = torch.autograd.grad(reference(single, False), [single["tau"]], cotangent)[0].item()
        ours.append(abs(got - want) / max(abs(want), 1.0))
        eager.append(abs(torch_float32 - want) / max(abs(want), 1.0))
    assert max(ours) <= max(eager), f"dτ errors {max(ours):.1e}, eager float32's {max(eager):.1e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_float_mask_that_requires_grad_gets_its_gradient_the_same_bits_on_every_run(causal, folder):
    """attn_mask (n × m, broadcast over 2 × 2 batch·heads, with a key_padding_mask added) requiring grad: dM written
    tile by tile and summed over the broadcast axes, against autograd of the float64 forward; bitwise the same twice."""
    module = triton_module("attention", folder)
    generator = torch.Generator().manual_seed(12)
    shapes = {"Q": (2, 2, N, D), "K": (2, 2, M, D), "V": (2, 2, M, DV), "attn_mask": (N, M)}
    inputs = {name: torch.randn(shape, generator=generator).requires_grad_() for name, shape in shapes.items()}
    padding = torch.rand((2, 1, M), generator=generator) < 0.2
    padding[..., 0] = False  # causal row 0 sees key 0 only: kept, so that no row is all masked (NaN in the reference)
    q, k, v, mask = inputs.values()
    out = module.forward(q, k, v, attn_mask=mask, key_padding_mask=padding, causal=causal)
    cotangent = torch.randn(out.shape, generator=generator)
    runs = [torch.autograd.grad(out, mask, cotangent, retain_graph=True)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (N, M)
    double = {name: x.detach().double().requires_grad_() for name, x in inputs.items()}
    hidden = torch.zeros(padding.shape, dtype=torch.float64).masked_fill(padding, -math.inf)
    want = _attention_reference(double["attn_mask"] + hidden.unsqueeze(-2))(double, causal)
    compare(out, want, "masked forward")
    compare(runs[0], torch.autograd.grad(want, double["attn_mask"], cotangent.double())[0], "dM", rtol=5e-5)


def test_a_launch_plan_is_made_once_per_shape_option_and_gradient_asked_for(folder):
    """Calls of one module alternating two query lengths, causal or not, and a float attn_mask with or without its
    gradient asked for: each against autograd of the float64 reference (the mask's gradient too); then the same calls
    again read their plans (no new one made) and give the same bits. One batch of two heads (the plans are per
    shape; the 2 × 2 batch·heads of the mask's broadcast gradient: test_a_float_mask_that_requires_grad_…)."""
    module = triton_module("attention", folder)
    module._PLANS.clear()
    generator = torch.Generator().manual_seed(11)
    calls = [(n, causal, learned) for n in (N, 20) for causal in (False, True) for learned in (False, True)]
    operands = {}
    for n, causal, learned in calls:
        shapes = {"Q": (1, 2, n, D), "K": (1, 2, M, D), "V": (1, 2, M, DV)}
        inputs = {name: torch.randn(shape, generator=generator).requires_grad_() for name, shape in shapes.items()}
        mask = torch.randn((n, M), generator=generator).requires_grad_(learned)
        operands[n, causal, learned] = (inputs, mask, torch.randn(1, 2, n, DV, generator=generator))
    first = {}
    for n, causal, learned in calls:
        inputs, mask, cotangent = operands[n, causal, learned]
        leaves = [*inputs.values(), mask] if learned else list(inputs.values())
        out = module.forward(*inputs.values(), attn_mask=mask, causal=causal)
        grads = torch.autograd.grad(out, leaves, cotangent)
        double = [x.detach().double().requires_grad_() for x in leaves]
        mask64 = double[-1] if learned else mask.detach().double()
        want = _attention_reference(mask64)(dict(zip(inputs, double)), causal)
        want_grads = torch.autograd.grad(want, double, cotangent.double())
        compare(out, want, f"n={n} causal={causal} forward")
        for got, expected, name in zip(grads, want_grads, ["Q", "K", "V", "M"]):
            compare(got, expected, f"n={n} causal={causal} d{name}", rtol=5e-5)
        first[n, causal, learned] = [out, *grads]
    made = len(module._PLANS)
    assert made == 2 * 2 * (1 + 2)  # per length and causal: one forward plan, a backward plan per mask gradient
    for n, causal, learned in calls:
        inputs, mask, cotangent = operands[n, causal, learned]
        leaves = [*inputs.values(), mask] if learned else list(inputs.values())
        out = module.forward(*inputs.values(), attn_mask=mask, causal=causal)
        again = [out, *torch.autograd.grad(out, leaves, cotangent)]
        assert all(torch.equal(a, b) for a, b in zip(again, first[n, causal, learned]))
    assert len(module._PLANS) == made
