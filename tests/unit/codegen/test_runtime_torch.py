"""The torch runtime helpers generated modules copy, run as ordinary code and checked against NumPy's."""

from __future__ import annotations

import numpy as np
import pytest

from symattn.codegen.backends.numpy import runtime as numpy_runtime
from symattn.codegen.backends.torch.backend import TORCH_RUNTIME
from symattn.numeric import numpy_runtime as eval_runtime

torch = pytest.importorskip("torch")
from symattn.codegen.backends.torch import function_runtime  # noqa: E402 (needs torch)
from symattn.codegen.backends.torch import pages as torch_pages  # noqa: E402
from symattn.codegen.backends.torch import runtime as torch_runtime  # noqa: E402


@pytest.fixture
def a():
    return np.random.default_rng(0).normal(size=(2, 3, 4, 6))


def test_every_helper_runs_from_its_copied_source_with_only_torch():
    namespace: dict = {"torch": torch, "SHAPES": {}, "OPTIONAL": (), "SPEC": "spec"}
    for name, helper in TORCH_RUNTIME.items():
        exec(helper, namespace)
        assert callable(namespace[name]), name


@pytest.mark.parametrize(
    "name, args",
    [
        ("row_softmax", ()),
        ("masked_row_softmax", ()),
        ("rows", ()),
        ("sum_batch", ()),
        ("gelu", ()),
        ("gelu_grad", ()),
        ("gelu_tanh", ()),
        ("gelu_tanh_grad", ()),
        ("layer_norm", (0.1,)),
        ("row_inv_std", (0.1,)),
        ("split_heads", (2,)),
        ("merge_heads", (3,)),
        ("repeat_heads", (6,)),
        ("sum_groups", (1,)),
    ],
)
def test_torch_helpers_agree_with_numpy(name, args, a):
    expected = getattr(numpy_runtime, name, None) or getattr(eval_runtime, name)
    got = getattr(torch_runtime, name)(torch.tensor(a), *args)
    np.testing.assert_allclose(got.numpy(), expected(a.copy(), *args), rtol=1e-12, atol=1e-14, err_msg=name)


def test_log_sum_exp_softmax_agrees_with_numpy(a):
    for name in ("row_softmax_lse", "masked_row_softmax_lse"):
        got = getattr(torch_runtime, name)(torch.tensor(a))
        expected = getattr(numpy_runtime, name)(a)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.numpy(), e, rtol=1e-12, err_msg=name)


def test_additive_mask_agrees_with_numpy():
    q, k = np.zeros((2, 3, 4)), np.zeros((2, 5, 4))
    attn = np.random.default_rng(1).random((3, 5)) < 0.3
    padding = np.zeros((2, 5), dtype=bool)
    padding[0, 2] = True
    expected = numpy_runtime._additive_mask(attn, padding, True, q, k, per_head=True)
    got = torch_runtime._additive_mask(
        torch.tensor(attn), torch.tensor(padding), True, torch.tensor(q), torch.tensor(k), per_head=True
    )
    np.testing.assert_array_equal(got.numpy(), expected)
    with pytest.raises(ValueError, match="attn_mask: expected a tensor"):
        torch_runtime._additive_mask(attn, None, False, torch.tensor(q), torch.tensor(k))


def test_input_checks_name_the_input(monkeypatch):
    monkeypatch.setattr(torch_runtime, "SHAPES", {"Q": "(..., n, d)", "b": "(1, d)"})
    monkeypatch.setattr(torch_runtime, "OPTIONAL", ("b",))
    q = torch.zeros(2, 3, 4, dtype=torch.float64)
    assert torch_runtime._tensors({"Q": q, "b": None}) == [q, None]
    with pytest.raises(TypeError, match=r"Q: expected a torch\.Tensor"):
        torch_runtime._tensors({"Q": q.numpy()})
    with pytest.raises(ValueError, match="mixed dtypes"):
        torch_runtime._tensors({"Q": q, "b": torch.zeros(1, 4)})
    assert function_runtime._only_tensors(q, None, 3) == [q]


class _Saved:
    """A Function's ctx with one saved input and no saved values."""

    def __init__(self, x):
        self.saved_tensors, self.tensor_names = (x,), []


def test_a_second_derivative_raises_naming_the_spec(monkeypatch):
    monkeypatch.setattr(function_runtime, "SPEC", "myspec")
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        (y,) = function_runtime._first_order(_Saved(x), None, (x * 2,))
    with pytest.raises(RuntimeError, match="myspec: double backward is not supported"):
        y.sum().backward()


@pytest.mark.parametrize("rows", [16, 1024])  # below and at the length from which (bᵀ a)ᵀ is used
def test_matmul_tn_is_the_transposed_product_either_way(rows):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 5, rows)), rng.standard_normal((2, 5, 2))
    got = torch_runtime.matmul_tn(torch.tensor(a), torch.tensor(b)).numpy()
    assert got.shape == (2, rows, 2) and np.allclose(got, a.swapaxes(-1, -2) @ b, rtol=1e-13, atol=1e-13)


def _huge_pages_in(start: int, size: int) -> int | None:
    """The AnonHugePages (kB) of the mappings overlapping [start, start + size), from /proc/self/smaps (madvise
    splits a mapping at the advised range); None where unreadable."""
    try:
        lines = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low < start + size and start < high
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_big_matmul_is_the_product_in_huge_pages_when_eager():
    a, b = torch.randn(8, 1024, 16), torch.randn(16, 1024)
    got = torch_runtime.big_matmul(a, b)
    assert torch.equal(got, torch.matmul(a, b)) and got.shape == (8, 1024, 1024)
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if torch_pages._madvise() else ""
    if "[madvise]" in thp or "[always]" in thp:  # the advice was taken: the 32 MiB result sits in huge pages
        assert (_huge_pages_in(got.data_ptr(), got.nbytes) or 0) >= 2048
    # under autograd, or small: the plain product (no out=, which autograd refuses)
    w = a.clone().requires_grad_()
    product = torch_runtime.big_matmul(w, b)
    assert product.requires_grad and torch.equal(product, a @ b)
    small = torch_runtime.huge_empty((3, 4), a)
    assert small.shape == (3, 4) and small.dtype == a.dtype


def test_blocks_of_query_rows_are_the_cpus_path():
    """A causal mask: blocks of 128 query rows on the CPU (each skips the keys after its last row); on any other
    device one block (a Python loop of small kernels costs more on a GPU than the keys it skips). A tensor on
    the meta device stands for one off the CPU."""
    for device in ("cpu", "meta"):
        query = torch.zeros(1000, 8, device=device)
        want = 128 if device == "cpu" else 1000
        assert torch_runtime.rows_per_block(None, True, query) == want
        assert torch_runtime.rows_per_block(None, False, query) == 1000


def test_a_call_routes_to_the_triton_module_only_where_the_kernels_apply(monkeypatch):
    """path() names the route and why: the torch ops off CUDA, with KERNELS False, under torch.func, for float64 or
    where no Triton module imports beside the module (here: none beside the runtime)."""
    monkeypatch.setattr(function_runtime, "SPEC", "spec")
    monkeypatch.setattr(function_runtime, "_KERNELS_MODULE", [])
    x = torch.zeros(2, 3)
    assert function_runtime.path(x, scale=1.0) == "torch: not every tensor is on CUDA"
    assert function_runtime._kernels_for(x) is None
    monkeypatch.setattr(function_runtime, "_kernel_device", lambda x: True)
    assert function_runtime.path(x.double()) == "torch: a float64 tensor"
    assert function_runtime.path(x) == "torch: no spec_triton module imports beside this one"
    assert function_runtime._KERNELS_MODULE == [None]  # looked for once
    seen = []
    torch.func.vmap(lambda row: seen.append(function_runtime.path(row)) or row)(x)
    assert seen == ["torch: under a torch.func transform"]
    monkeypatch.setattr(function_runtime, "_KERNELS_MODULE", [function_runtime])  # a module found
    assert function_runtime.path(x) == "triton" and function_runtime._kernels_for(x) is function_runtime
    monkeypatch.setattr(function_runtime, "KERNELS", False)
    assert function_runtime.path(x) == "torch: KERNELS is False"
    assert not function_runtime._constant(torch.zeros(1, requires_grad=True)).requires_grad
