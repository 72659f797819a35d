"""The Triton modules' runtime helpers, run as ordinary code on CPU tensors, and their copies in the generated modules
(each the runtime's source, only the ones a module calls)."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import symattn.codegen.backends  # noqa: F401 (the backends' package first: it imports the Triton backend)
from symattn.codegen.backends.triton.runtime import RUNTIMES, TRITON_RUNTIME, called_helpers
from symattn.numeric.printers import runtime_functions

torch = pytest.importorskip("torch")
from torch.autograd import forward_ad  # noqa: E402

from symattn.codegen.backends.triton import runtime_autograd, runtime_launch, runtime_module  # noqa: E402 (needs torch)

GENERATED = Path(__file__).resolve().parents[3] / "generated"


def test_every_helper_runs_from_its_copied_source_with_only_torch():
    names = {
        "AXES": {},
        "TANGENT_OF": (),
        "SPEC": "spec",
        "LAUNCH": {},
        "SHARED": 0,
        "STREAMED": {},
        "COPIES": {},
        "GRID_Y": 1,
    }
    namespace: dict = {"torch": torch, "forward_ad": forward_ad, "_NUMBERS": {}, **names}
    for name, helper in TRITON_RUNTIME.items():
        exec(helper, namespace)
        assert callable(namespace[name]), name


def test_the_runtime_modules_define_distinct_documented_helpers():
    seen: dict[str, str] = {}
    for module in RUNTIMES:
        for name, source in runtime_functions(module).items():
            assert name not in seen, f"{name} in {seen.get(name)} and {module}"
            seen[name] = module
            assert ast.get_docstring(ast.parse(source).body[0]), f"{module}.{name} has no docstring"
    assert seen.keys() == TRITON_RUNTIME.keys()


# --- launches


@pytest.mark.parametrize("size, width", [(0, 16), (1, 16), (16, 16), (17, 32), (64, 64), (100, 128), (257, 512)])
def test_a_tile_is_a_power_of_two_of_at_least_16(size, width):
    assert runtime_launch._width(size) == width


def test_cdiv_is_the_ceiling_of_the_quotient():
    assert all(runtime_launch._cdiv(a, b) == math.ceil(a / b) for a in range(60) for b in range(1, 9))


def test_a_grid_swaps_its_axes_past_grid_y(monkeypatch):
    assert runtime_launch._grid(3, 10) == ((3, 10), False)
    monkeypatch.setattr(runtime_launch, "GRID_Y", 9)  # 10 batch·heads: more than the axis holds
    assert runtime_launch._grid(3, 10) == ((10, 3), True)
    assert runtime_launch._grid(3, 9) == ((3, 9), False)


def test_a_cpu_tensor_launches_blocks_of_16_for_the_interpreter():
    x = torch.zeros(2, 8, 64)
    for kernel in ("forward", "backward_keys", "backward_queries", "jvp"):
        assert runtime_launch._launch(x, 4096, kernel) == {"BLOCK_M": 16, "BLOCK_N": 16}


@pytest.fixture
def gpu_table(monkeypatch):
    """A GPU's launch table (as the generated modules have it), and a stand-in for a CUDA tensor of 4-byte entries
    (is_cuda and element_size are all _launch reads)."""
    backward = {"backward_keys": (32, 128, 4, 5), "backward_queries": (128, 32, 8, 5)}
    monkeypatch.setattr(runtime_launch, "LAUNCH", {"forward": (64, 64, 4, 3), **backward, "jvp": (64, 64, 4, 3)})
    streamed = {"forward": 1, "backward_keys": 0, "backward_queries": 1, "jvp": 1}
    monkeypatch.setattr(runtime_launch, "STREAMED", streamed)
    monkeypatch.setattr(runtime_launch, "COPIES", {"forward": 1, "backward_keys": 1, "backward_queries": 1, "jvp": 2})
    monkeypatch.setattr(runtime_launch, "SHARED", 160 * 1024)
    return SimpleNamespace(is_cuda=True, element_size=lambda: 4)


def test_a_gpu_launch_keeps_the_table_where_its_blocks_fit(gpu_table):
    # (64 + 3 · 64) rows of 64 float32 entries: 64 KiB <= 160 KiB
    got = runtime_launch._launch(gpu_table, 64, "forward")
    assert got == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def test_a_gpu_launch_halves_the_streamed_block_of_a_wide_row(gpu_table):
    # rows of 256 float32 entries (1 KiB): (64 + 3 · 64) KiB > 160 KiB, (64 + 3 · 32) KiB fits
    assert runtime_launch._launch(gpu_table, 256, "forward")["BLOCK_N"] == 32
    assert runtime_launch._launch(gpu_table, 256, "forward")["BLOCK_M"] == 64
    # the backward's key part holds 128 keys and streams 32 query rows at 5 stages: (128 + 5 · 32) KiB, the larger
    # block halved (64 + 160, 32 + 160 KiB), then of a tie the streamed one: (32 + 5 · 16) KiB fits; its query part
    # the same, transposed
    got = runtime_launch._launch(gpu_table, 256, "backward_keys")
    assert (got["BLOCK_M"], got["BLOCK_N"], got["num_warps"], got["num_stages"]) == (16, 32, 4, 5)
    got = runtime_launch._launch(gpu_table, 256, "backward_queries")
    assert (got["BLOCK_M"], got["BLOCK_N"], got["num_warps"], got["num_stages"]) == (32, 16, 8, 5)
    # the JVP's blocks each beside its tangent (two copies): rows of 128 float32 entries as the forward's of 256
    assert runtime_launch._launch(gpu_table, 128, "jvp")["BLOCK_N"] == 32
    assert runtime_launch._launch(gpu_table, 128, "forward")["BLOCK_N"] == 64
    # too wide for any: down to 16 × 16
    got = runtime_launch._launch(gpu_table, 1 << 14, "backward_keys")
    assert (got["BLOCK_M"], got["BLOCK_N"]) == (16, 16)


def test_the_backwards_parts_launch_apart_where_their_settings_differ(gpu_table):
    # rows of 64 float32 entries (the table's blocks fit); 100 keys, 300 query rows, 6 batch·heads
    (keys, at_keys), (queries, at_queries) = runtime_launch._backward_parts(gpu_table, 64, 100, 300, 6, False)
    assert keys == (1, 6) and queries == (3, 6)  # ⌈100 / 128⌉ key blocks; ⌈300 / 128⌉ query blocks
    assert at_keys == {
        "WIDE": False,
        "KEYS": True,
        "QUERIES": False,
        "ATOMIC": False,
        "BLOCK_M": 32,
        "BLOCK_N": 128,
    } | {
        "num_warps": 4,
        "num_stages": 5,
    }
    assert at_queries["num_warps"] == 8
    assert {k: at_queries[k] for k in ("KEYS", "QUERIES", "BLOCK_M", "BLOCK_N")} == {
        "KEYS": False,
        "QUERIES": True,
        "BLOCK_M": 128,
        "BLOCK_N": 32,
    }
    # deterministic=False: the key part alone, adding dQ atomically
    ((grid, atomic),) = runtime_launch._backward_parts(gpu_table, 64, 100, 300, 6, True)
    assert grid == (1, 6) and (atomic["KEYS"], atomic["QUERIES"], atomic["ATOMIC"]) == (True, False, True)
    # the same settings (the interpreter's): one launch of both parts, the key blocks' programs first
    x = torch.zeros(2, 8, 64)
    ((grid, both),) = runtime_launch._backward_parts(x, 64, 100, 300, 6, False)
    assert grid == (7 + 19, 6) and (both["KEYS"], both["QUERIES"], both["ATOMIC"]) == (True, True, False)


def test_the_batch_is_the_broadcast_of_the_leading_axes():
    assert runtime_launch._batch((2, 3, 4, 5), (2, 3, 6, 5)) == (2, 3)
    assert tuple(runtime_launch._batch((2, 1, 4, 5), (3, 6, 5))) == (2, 3)
    with pytest.raises(ValueError, match=r"batch axes do not broadcast: \(2, 4, 5\), \(3, 6, 5\)"):
        runtime_launch._batch((2, 4, 5), (3, 6, 5))


def test_grouped_keys_share_the_query_heads():
    Q, K = torch.zeros(2, 4, 5, 8), torch.zeros(2, 2, 6, 8)
    assert runtime_launch._batches(Q, K, K, [None], True) == ((2, 4), (2, 2))
    with pytest.raises(ValueError, match="3 key/value heads"):
        runtime_launch._batches(Q, torch.zeros(2, 3, 6, 8), torch.zeros(2, 3, 6, 8), [], True)


def test_operands_are_flattened_and_tiles_viewed_with_their_strides():
    x = torch.arange(12.0).reshape(3, 4)
    flat = runtime_launch._flat(x, (2, 5), 3, 4)
    assert flat.shape == (10, 3, 4) and torch.equal(flat[7], x)
    mask = torch.zeros(3, 4)
    tile = runtime_launch._tile(mask, (2, 5), 3, 4)
    assert tile.shape == (2, 5, 3, 4) and tile.stride()[:2] == (0, 0)  # a view: no copy of the broadcast mask
    assert runtime_launch._tile_arguments([tile, None], x) == [tile, 0, 0, 4, 1, x, 0, 0, 0, 0]
    assert runtime_launch._inner((2, 5)) == 5 and runtime_launch._inner(()) == 1
    transposed = torch.zeros(4, 3).mT
    assert runtime_launch._rows(transposed).stride(-1) == 1 and runtime_launch._rows(x) is x


def test_numbers_are_filled_once_per_device_and_tensors_each_call(monkeypatch):
    monkeypatch.setattr(runtime_launch, "_NUMBERS", {})
    like = torch.zeros(1)
    first = runtime_launch._scalar_tensor((0.5, 2), like)
    assert first.dtype == torch.float32 and first.tolist() == [0.5, 2.0]
    assert runtime_launch._scalar_tensor((0.5, 2), like) is first  # cached
    tau = torch.tensor(3.0, dtype=torch.float64)
    assert runtime_launch._scalar_tensor((tau, 1), like).tolist() == [3.0, 1.0]
    assert len(runtime_launch._NUMBERS) == 1  # a tensor's value is never cached
    assert runtime_launch._scalar_tensor((), like).tolist() == [0.0]


def test_a_tile_gradient_is_summed_to_its_input():
    grad = torch.ones(6, 3, 4)  # (batch·heads, n, m)
    like = torch.zeros(1, 3, 3, 4, dtype=torch.float64)
    got = runtime_launch._tile_gradient(grad, True, (2, 3), like)
    assert got.shape == like.shape and got.dtype == torch.float64 and bool((got == 2).all())
    assert runtime_launch._tile_gradient(grad, False, (2, 3), like) is None
    assert runtime_launch._tile_gradient(grad, True, (2, 3), None) is None


def test_a_flat_gradient_is_a_view_of_its_inputs_shape_summed_only_where_broadcast():
    flat = torch.arange(72.0).reshape(6, 3, 4)  # (batch·heads, rows, columns)
    got = runtime_launch._gradient(flat, (2, 3), torch.zeros(2, 3, 3, 4))
    assert got.shape == (2, 3, 3, 4) and got.data_ptr() == flat.data_ptr() and torch.equal(got.reshape(6, 3, 4), flat)
    summed = runtime_launch._gradient(flat, (2, 3), torch.zeros(1, 3, 3, 4))  # the input broadcast over the batch
    assert torch.equal(summed, flat.reshape(2, 3, 3, 4).sum(0, keepdim=True))


def test_only_the_gradients_wanted_are_made_and_placed_among_the_others():
    a, b, absent = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    assert runtime_launch._made([a, b], [False, True, False, True], absent) == [absent, a, absent, b]
    assert runtime_launch._made([], [False], None) == [None] and runtime_launch._made([], [], None) == []


def test_a_plan_is_made_on_its_keys_first_call_and_read_after(monkeypatch):
    monkeypatch.setattr(runtime_launch, "_PLANS", {})
    made = []

    def make(key):
        return lambda: made.append(key) or f"plan {key}"

    assert [runtime_launch._planned(key, make(key)) for key in (1, 2, 1, 1, 2)] == [
        "plan 1",
        "plan 2",
        *["plan 1"] * 2,
        "plan 2",
    ]
    assert made == [1, 2]
    for key in range(3, 300):  # keys that change call by call: the dictionary stays small
        runtime_launch._planned(key, make(key))
    assert len(runtime_launch._PLANS) <= 256 and runtime_launch._planned(299, make(-1)) == "plan 299"


class _Compiled:
    """A stand-in for Triton's compiled kernel: its launcher records what it was called with."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """A stand-in for a JIT kernel: kernel[grid](*args, **constexprs) records the launch and returns what it compiled
    (None: the interpreter's launches return nothing)."""

    arg_names = ["X", "n", "m", "WIDE", "BLOCK"]

    def __init__(self, compiled):
        self.compiled, self.launches = compiled, []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.launches.append((grid, args, constexprs))
            return self.compiled

        return launch


def test_a_plan_launches_the_compiled_kernel_directly_after_the_jit(monkeypatch):
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    constexprs = {"WIDE": False, "BLOCK": 16, "num_warps": 4}  # num_warps: an option of the compile, not an argument
    launch = runtime_launch._launcher(kernel, (3, 2), constexprs, torch.device("cpu"))
    x = torch.zeros(2)
    launch(x, 5, 7)
    assert kernel.launches == [((3, 2), (x, 5, 7), constexprs)] and compiled.calls == []  # the first: the JIT's
    launch(x, 6, 8)
    launch(x, 6, 9)
    assert len(kernel.launches) == 1  # then the compiled kernel's launcher, its arguments in the kernel's order
    assert compiled.calls == [
        (3, 2, 1, 0, "function", "metadata", None, None, None, x, 6, n, False, 16) for n in (8, 9)
    ]


def test_a_launch_stays_with_the_jit_without_a_compiled_kernel_or_with_a_launch_hook(monkeypatch):
    kernel = _Kernel(None)  # the interpreter: nothing compiled
    launch = runtime_launch._launcher(kernel, (1,), {"WIDE": False, "BLOCK": 16}, torch.device("cpu"))
    for _ in range(3):
        launch(torch.zeros(1), 1, 1)
    assert len(kernel.launches) == 3
    compiled = _Compiled()
    kernel = _Kernel(compiled)  # a parameter given neither as an argument nor as a constexpr: the JIT binds it
    launch = runtime_launch._launcher(kernel, (1,), {"WIDE": False}, torch.device("cpu"))
    for _ in range(2):
        launch(torch.zeros(1), 1, 1)
    assert len(kernel.launches) == 2 and compiled.calls == []
    hook = SimpleNamespace(calls=[])  # Triton's launch-hook chain, empty
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(
        triton, "knobs", SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=hook)), raising=False
    )
    kernel = _Kernel(compiled)
    launch = runtime_launch._launcher(kernel, (1,), {"WIDE": False, "BLOCK": 16}, torch.device("cpu"))
    launch(torch.zeros(1), 1, 1)
    launch(torch.zeros(1), 1, 1)
    hook.calls.append(print)  # a profiler's hook added: the JIT launches again (it gives the hook the metadata)
    launch(torch.zeros(1), 1, 1)
    assert len(kernel.launches) == 2 and len(compiled.calls) == 1


def test_a_direct_launch_is_on_the_current_devices_stream_and_only_on_the_device_it_compiled_for(monkeypatch):
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 100 + index, raising=False)
    compiled = _Compiled()
    kernel = _Kernel(compiled)
    launch = runtime_launch._launcher(kernel, (2,), {"WIDE": True, "BLOCK": 32}, torch.device("cuda", 0))
    for device in (0, 0, 1, 0):
        current[0] = device
        launch(None, 1, 2)
    assert compiled.calls == [(2, 1, 1, 100, "function", "metadata", None, None, None, None, 1, 2, True, 32)] * 2
    assert len(kernel.launches) == 2  # the first, and the one while device 1 was current: the JIT's


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: torch.zeros(2, 3, 5, 4), (6, 20, 4)),  # contiguous: B·H of n·d entries apart
        (lambda: torch.zeros(3, 5, 4), (3, 20, 4)),  # flat
        (lambda: torch.zeros(5, 4), (1, 0, 4)),  # no batch axes
        (lambda: torch.zeros(2, 1, 5, 4), (2, 20, 4)),  # a size-1 axis: any stride
        (lambda: torch.zeros(2, 5, 3, 4).transpose(1, 2), None),  # heads split off the columns: no one stride
        (lambda: torch.zeros(2, 3, 4, 5).mT, None),  # columns not contiguous
        (lambda: torch.zeros(1, 5, 4).expand(6, 5, 4), (6, 0, 4)),  # broadcast along the batch: stride 0
        (lambda: torch.zeros(2, 3, 9, 4)[:, :, 2:7], (6, 36, 4)),  # a block of rows of each
    ],
)
def test_a_tensors_batch_axes_are_read_as_one_where_their_strides_allow(make, expected):
    x = make()
    assert runtime_launch._geometry(x) == expected
    if expected is not None:  # the same entries as the flattened tensor's (what the kernels read)
        count, step, row = expected
        flat = x.reshape(count, *x.shape[-2:])
        assert (count == 1 or flat.stride(0) == step) and flat.stride(1) == row


def test_an_eager_launch_takes_an_operand_whole_unless_it_is_broadcast():
    x = torch.zeros(2, 3, 5, 4)
    assert runtime_launch._whole(x, (2, 3), 5, 4) is x
    broadcast = runtime_launch._whole(torch.zeros(1, 3, 5, 4), (2, 3), 5, 4)
    assert broadcast.shape == (6, 5, 4)
    assert runtime_launch._eager(x) and not runtime_launch._eager(x.to("meta"))
    made = torch.zeros(2, 3, 5, 4)
    assert runtime_launch._gradient(made, (2, 3), x) is made  # made in the input's shape: as it is
    assert runtime_launch._gradient(torch.ones(6, 5, 4), (2, 3), torch.zeros(1, 3, 5, 4)).shape == (1, 3, 5, 4)


def test_a_layout_holds_what_the_jit_specialises_on():
    x = torch.zeros(4, 8)
    assert runtime_launch._layout(x, None) == ((x.shape, (8, 1), True), None)
    assert runtime_launch._layout(x.mT)[0][1] == (1, 8)
    assert not runtime_launch._layout(x.view(-1)[1:])[0][2]  # 4 bytes past an aligned address


def test_the_16_bit_outputs_keep_their_rounding():
    assert runtime_launch._residual(torch.zeros(1, dtype=torch.bfloat16))
    assert not runtime_launch._residual(torch.zeros(1))


# --- autograd and torch.func


def test_vmaps_axis_is_merged_into_the_batch_heads_and_split_back():
    x = torch.arange(24.0).reshape(2, 3, 4)  # vmap's axis (2) first, then batch·heads (3)
    merged = runtime_autograd._merged(x, 0, 2)
    assert merged.shape == (6, 4) and torch.equal(merged[4], x[1, 1])
    results, dims = runtime_autograd._split([merged, torch.empty(0)], 2)
    assert torch.equal(results[0], x) and dims == [0, None]
    assert runtime_autograd._merged(torch.ones(3, 4), None, 2).shape == (6, 4)  # unbatched: expanded
    assert runtime_autograd._merged(None, 0, 2) is None


def test_a_batched_tensor_is_seen_and_unwrapped():
    seen = []

    def inside(x):
        seen.append((runtime_autograd._batched(x), runtime_autograd._physical(x).shape))
        return x

    torch.func.vmap(inside)(torch.zeros(5, 3))
    assert seen == [(True, (5, 3))]
    plain = torch.zeros(2)
    assert not runtime_autograd._batched(plain) and runtime_autograd._plain(plain) is plain
    assert runtime_autograd._plain(None) is None and runtime_autograd._rebatched(plain, None) is plain


def test_a_batched_trainable_scalar_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(runtime_autograd, "SPEC", "temperature")
    runtime_autograd._no_batched_scalar(False)
    with pytest.raises(RuntimeError, match="temperature: a trainable scalar batched"):
        runtime_autograd._no_batched_scalar(True)


def test_autocast_casts_float32_factors_only_under_autocast():
    q, k = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)
    assert runtime_autograd._autocast(q, k, None) == (q, k, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = runtime_autograd._autocast(q, k, None)
    assert got[0].dtype == torch.bfloat16 and got[1] is k and got[2] is None


def test_a_functions_signature_is_kept():
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(x, y):
            return x

    assert runtime_autograd._signature_kept(Function) is Function
    assert list(Function.forward.__signature__.parameters) == ["x", "y"]


def test_a_backward_outside_torch_func_on_plain_tensors_takes_the_fast_path():
    plain, leaked, seen = torch.ones(2), [], []

    def inside(x):
        leaked.append(x)  # wrapped by grad's level, dead once it ends
        seen.append(runtime_autograd._untransformed(plain, (plain,)))
        return x.sum()

    torch.func.grad(inside)(torch.ones(2))
    assert seen == [False]  # a transform active
    assert runtime_autograd._untransformed(plain, (plain, None))
    assert not runtime_autograd._untransformed(plain, (leaked[0],)) and not runtime_autograd._untransformed(
        leaked[0], ()
    )


def test_applied_is_function_apply_without_its_binding():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(x, k):
            return x * k, x.new_zeros(())

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.k = inputs[1]
            ctx.set_materialize_grads(False)
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def backward(ctx, grad, _):
            return grad * ctx.k, None

    x, leaked = torch.arange(3.0, requires_grad=True), []
    out, kept = runtime_autograd._applied(Twice, x, 2.0)
    assert torch.equal(out, 2 * x) and out.grad_fn is not None and not kept.requires_grad
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], torch.full((3,), 2.0))
    torch.func.grad(lambda y: leaked.append(y) or y.sum())(torch.ones(2))
    out, _ = runtime_autograd._applied(Twice, leaked[0], 3.0)  # a dead wrapper unwrapped, as Function.apply does
    assert not torch._C._functorch.is_functorch_wrapped_tensor(out) and torch.equal(out, torch.full((2,), 3.0))


def test_a_saved_tensor_list_gets_its_absent_ones_back():
    ctx = SimpleNamespace(absent=[False, True, False])
    assert runtime_autograd._tensors(ctx, ["a", "b"]) == ["a", None, "b"]


# --- the public functions' arguments


def test_dimensions_are_read_off_the_inputs_axes(monkeypatch):
    monkeypatch.setattr(runtime_module, "AXES", {"Q": ("n", "d"), "K": ("m", "d"), "b": (1, "m")})
    monkeypatch.setattr(runtime_module, "_DIMENSIONS", {})
    q, k = torch.zeros(2, 5, 4), torch.zeros(7, 4)
    assert runtime_module._dimensions(q, k, None) == {"n": 5, "d": 4, "m": 7}
    runtime_module._dimensions(q, k, None)["n"] = 0  # a fresh dict per call: the cached one stays as read
    assert runtime_module._dimensions(q, k, None) == {"n": 5, "d": 4, "m": 7}
    assert runtime_module._dimensions(q, k, torch.zeros(1, 7)) == {"n": 5, "d": 4, "m": 7}
    with pytest.raises(ValueError, match=r"K has shape \(7, 3\); expected \(\.\.\., m, d\) with d = 4"):
        runtime_module._dimensions(q, torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"b has shape \(2, 7\); expected \(\.\.\., 1, m\)"):
        runtime_module._dimensions(q, k, torch.zeros(2, 7))
    with pytest.raises(ValueError, match=r"Q has shape \(5,\); expected \(\.\.\., n, d\)"):
        runtime_module._dimensions(torch.zeros(5), k)
    with pytest.raises(ValueError, match=r"K has shape \(7, 3\)"):  # a refusal is never cached
        runtime_module._dimensions(q, torch.zeros(7, 3))
    assert len(runtime_module._DIMENSIONS) == 2


def test_head_counts_and_products_of_axes_are_checked():
    assert runtime_module._count("num_heads", 4) == 4
    assert runtime_module._count("num_heads", np.int64(2)) == 2
    for wrong in (True, 0, 2.0, "2"):
        with pytest.raises(ValueError, match="num_heads must be a positive integer"):
            runtime_module._count("num_heads", wrong)
    runtime_module._divides("num_kv_heads", 2, "num_heads", 4)
    with pytest.raises(ValueError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        runtime_module._divides("num_kv_heads", 3, "num_heads", 4)
    assert runtime_module._share({"H*d_k": 32}, "H*d_k", 4) == 8
    with pytest.raises(ValueError, match="H\\*d_k = 30 is not a multiple of 4"):
        runtime_module._share({"H*d_k": 30}, "H*d_k", 4)
    with pytest.raises(ValueError, match="H\\*d_k = 30, expected 32"):
        runtime_module._product({"H*d_k": 30}, "H*d_k", 32)


def test_a_bool_mask_becomes_additive():
    like = torch.zeros(1, dtype=torch.float16)
    got = runtime_module._additive("M", torch.tensor([[True, False]]), like)
    assert got.dtype == torch.float16 and got.tolist() == [[-math.inf, 0.0]]
    floats = torch.zeros(1, 2)
    assert runtime_module._additive("M", floats, like) is floats and runtime_module._additive("M", None, like) is None
    grad = torch.zeros(2, requires_grad=True)
    assert not runtime_module._constant(grad).requires_grad and runtime_module._constant(2.0) == 2.0


def test_masks_by_position_keyword_and_key_padding_combine():
    query = torch.zeros(2, 3, 4)
    with pytest.raises(TypeError, match="M and attn_mask are the same mask"):
        runtime_module._mask("M", torch.zeros(3, 5), torch.zeros(3, 5), None, query, False)
    with pytest.raises(ValueError, match="key_padding_mask: expected a bool tensor"):
        runtime_module._mask("M", None, None, torch.zeros(2, 5), query, False)
    padding = torch.tensor([[False] * 4 + [True]] * 2)  # (batch, m): the last key ignored
    got = runtime_module._mask("M", torch.zeros(3, 5), None, padding, query, False)
    assert got.shape == (2, 3, 5) and bool(torch.isinf(got[..., -1]).all()) and not bool(got[..., :-1].any())
    per_head = runtime_module._mask("M", None, None, padding, query, True)
    assert per_head.shape == (2, 1, 1, 5)


def test_a_bias_row_may_be_one_dimensional_or_left_out():
    like = torch.zeros(2, dtype=torch.float64)
    assert runtime_module._row(torch.zeros(4)).shape == (1, 4) and runtime_module._row(None) is None
    zero = runtime_module._or_zero(None, like)
    assert zero.shape == () and zero.dtype == torch.float64


def test_tangents_and_directions_name_inputs(monkeypatch):
    monkeypatch.setattr(runtime_module, "TANGENT_OF", ("Q", "K"))
    assert runtime_module._tangents({"Q": 1}) == {"Q": 1}
    with pytest.raises(ValueError, match="tangents: 'V' is no input; inputs: Q, K"):
        runtime_module._tangents({"V": 1})
    with pytest.raises(TypeError, match="direction: expected a dict"):
        runtime_module._direction([1])
    q, k, dq = torch.zeros(2), torch.ones(2), torch.full((2,), 3.0)
    with forward_ad.dual_level():
        dual_q, plain_k = runtime_module._duals({"Q": dq}, q, k)
        assert torch.equal(forward_ad.unpack_dual(dual_q).tangent, dq) and plain_k is k


def test_a_hessian_vector_product_differentiates_along_the_direction():
    # f = ⟨1, x² y⟩: ∂f/∂x = 2 x y, so H [dx, dy] at x: 2 y dx + 2 x dy
    x, y = runtime_module._leaves(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
    out = x * x * y
    got = runtime_module._along(out, torch.ones(2), {"x": x, "y": y}, {"x": torch.ones(2)})
    assert got["x"].tolist() == [6.0, 8.0] and got["y"].tolist() == [2.0, 4.0]


# --- the copies in the generated modules


def test_the_helpers_called_are_found_with_the_ones_they_call():
    text = "def f(x):\n    return _rows(x), _count('h', 2)\n_width = 3\n"
    assert called_helpers(text) == ["_rows", "_batched", "_count"]  # _rows calls _batched; the runtime's order
    assert called_helpers("x = 1\n") == []


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*_triton.py")), ids=lambda p: p.stem)
def test_a_generated_module_copies_the_runtime_it_calls_verbatim(path):
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    defined = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in TRITON_RUNTIME:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            defined[node.name] = "".join(lines[first - 1 : node.end_lineno])
    assert all(source == TRITON_RUNTIME[name] for name, source in defined.items())
    body = "".join(line for i, line in enumerate(lines) if not _in_helper(i + 1, tree, defined))
    assert list(defined) == called_helpers(body)  # every helper it calls, no other, in the runtime's order


def _in_helper(number: int, tree: ast.Module, helpers: dict) -> bool:
    """Is line number inside the definition of one of the copied helpers?"""
    return any(
        isinstance(node, ast.FunctionDef)
        and node.name in helpers
        and min([node.lineno, *(d.lineno for d in node.decorator_list)]) <= number <= node.end_lineno
        for node in tree.body
    )


def test_a_spec_without_head_counts_gets_no_count():
    attention = (GENERATED / "attention_triton.py").read_text(encoding="utf-8")
    mha = (GENERATED / "mha_triton.py").read_text(encoding="utf-8")
    assert "def _count(" not in attention and "def _count(" in mha
