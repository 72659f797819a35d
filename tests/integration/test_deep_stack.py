"""A generated stack of pre-LN blocks against torch autograd of nn.TransformerEncoderLayer × L (issue 11).

benchmarks/deep_stack.py times the 12-layer stack; here a 3-layer one is generated from the same spec
file and checked, output and every gradient, against the independently written torch stack."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the reference stack is torch.nn.TransformerEncoderLayer")

DEEP_STACK = Path(__file__).resolve().parents[2] / "benchmarks" / "deep_stack.py"
LAYERS = 3


@pytest.fixture(scope="module")
def deep_stack(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("deep_stack", DEEP_STACK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.modules_for(LAYERS, tmp_path_factory.mktemp("stack"), order=1)


def test_the_generated_stack_and_the_chained_blocks_match_torch_autograd(deep_stack):
    ds, modules = deep_stack
    errors = ds.errors(ds.setup(LAYERS, 2, 8, 16, torch.float64, modules))
    assert set(errors) == {"torch_stack", "torch_blocks", "numpy_stack", "numpy_blocks"}
    assert all(error <= 1e-10 for error in errors.values()), errors  # measured ≈ 1e-15


def test_the_stack_keeps_float32(deep_stack):
    ds, modules = deep_stack
    runs = ds.setup(LAYERS, 2, 8, 16, torch.float32, modules)
    out, grads = runs.torch_stack()
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads.values())
    y, arrays = runs.numpy_stack()
    assert y.dtype.name == "float32" and all(a.dtype.name == "float32" for a in arrays.values())
    assert len(grads) == len(arrays) == 1 + 16 * LAYERS  # X and every weight of every layer
