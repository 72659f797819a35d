"""The Triton modules' host path: a plan's launches go through Triton's JIT once, then (on a GPU) call the compiled
kernel's launcher directly with the arguments in the kernel's order (runtime_launch._launcher). Here each kernel of a
module is wrapped so that its JIT launch runs under the interpreter and returns a stand-in compiled kernel whose
launcher runs the same interpreted kernel from the arguments as a compiled kernel's launcher receives them: the
outputs and gradients must be the same bits as the JIT's launches give, call after call."""

from __future__ import annotations

from pathlib import Path

import pytest
from triton_rendered import gallery, random_inputs, torch, triton_module


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("triton_host")


class _Compiled:
    """A compiled kernel's stand-in: run(grid_0, grid_1, grid_2, stream, function, metadata, launch metadata, enter
    hook, exit hook, *the kernel's arguments in its order) launches the interpreted kernel with those arguments."""

    function = packed_metadata = object()

    def __init__(self, kernel, runs: list):
        self.kernel, self.runs = kernel, runs

    def run(self, grid_0, grid_1, grid_2, stream, function, metadata, launch_metadata, enter, exit, *arguments):
        assert (function, metadata, launch_metadata, enter, exit) == (self.function, self.packed_metadata, *[None] * 3)
        assert len(arguments) == len(self.kernel.arg_names), "every parameter, the constexprs among them"
        self.runs.append(self.kernel.arg_names)
        self.kernel[(grid_0, grid_1, grid_2)](*arguments)


class _Jit:
    """A JIT kernel's stand-in: kernel[grid](*args, **constexprs) runs the interpreted kernel and returns the
    stand-in compiled kernel, as Triton's JIT returns the one it compiled."""

    def __init__(self, kernel, runs: list, jitted: list):
        self.kernel, self.arg_names, self.runs, self.jitted = kernel, kernel.arg_names, runs, jitted

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.jitted.append(self.arg_names)
            self.kernel[grid](*args, **constexprs)
            return _Compiled(self.kernel, self.runs)

        return launch


def _steps(module, inputs: dict, cotangent_seed: int, calls: int) -> list[list]:
    """calls × [the module's output (causal), every input's gradient along a seeded cotangent]."""
    found = []
    for _ in range(calls):
        out = module.forward(*inputs.values(), causal=True)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(cotangent_seed))
        found.append([out, *torch.autograd.grad(out, list(inputs.values()), cotangent)])
    return found


@pytest.mark.parametrize("name", ["temperature", "pointer", "bias", "differential"])
def test_a_direct_launch_of_the_compiled_kernel_gives_the_jits_bits(name, folder, monkeypatch):
    """A trainable scalar's core, a log-softmax map, an n × m input with its gradient, two cores: the JIT's launches
    against the direct launches (after each plan's first), three calls each."""
    module = triton_module(gallery(name), folder)
    inputs = random_inputs(gallery(name), torch.Generator().manual_seed(3))
    module._PLANS.clear()
    want = _steps(module, inputs, 5, 1)[0]
    runs, jitted = [], []
    kernels = {key: value for key, value in vars(module).items() if "_kernel" in key and hasattr(value, "arg_names")}
    with monkeypatch.context() as patched:
        patched.setattr(module, "_PLANS", {})  # the launches planned again with the stand-ins
        for key, kernel in kernels.items():
            patched.setattr(module, key, _Jit(kernel, runs, jitted))
        got = _steps(module, inputs, 5, 3)
        plans = len(module._PLANS)
    assert runs and len(jitted) == len(runs) / 2, f"{len(jitted)} JIT launches, {len(runs)} direct ones"
    assert plans and len(jitted) >= plans  # the first launch of each plan's kernels through the JIT
    for step in got:
        assert all(torch.equal(a, b) for a, b in zip(step, want, strict=True))


def test_an_eager_step_on_contiguous_operands_makes_no_torch_op_but_its_outputs(folder, monkeypatch):
    """attention's forward and backward on contiguous (B, H, n, d) operands, every launch stubbed (a stand-in
    compiled kernel whose launcher does nothing): the only torch ops of the step are the outputs' allocations (O, L,
    R; D, dQ, dK, dV: in their final shapes) and autograd's own detaches; no view, reshape, copy or sum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Idle:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    class Stub:
        def __init__(self, kernel):
            self.arg_names = kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **constexprs: Idle()

    module = triton_module("attention", folder)
    with monkeypatch.context() as patched:
        patched.setattr(module, "_PLANS", {})
        for key, value in vars(module).copy().items():
            if "_kernel" in key and hasattr(value, "arg_names"):
                patched.setattr(module, key, Stub(value))
        leaves = [torch.zeros(2, 3, 20, 16, requires_grad=True) for _ in range(3)]
        for causal in (False, True, False):  # (the first call of each plan through the stand-in JIT)
            with Ops() as ops:
                out = module.forward(*leaves, causal=causal)
                grads = torch.autograd.grad(out, leaves, torch.ones(out.shape))
    made = [x for x in ops.seen if x not in ("detach", "ones")]
    assert made == ["new_empty"] * 7, ops.seen
    assert [tuple(g.shape) for g in grads] == [(2, 3, 20, 16)] * 3 and out.shape == (2, 3, 20, 16)
