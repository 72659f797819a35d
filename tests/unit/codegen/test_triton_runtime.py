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
