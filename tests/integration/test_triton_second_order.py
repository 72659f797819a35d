"""Second derivatives through the Triton modules under Triton's interpreter: a backward asked to be differentiable
(create_graph=True) recomputes the core by torch ops and differentiates it, so double backward and reverse over
reverse give what autograd of an independent float64 forward gives; a plain backward still runs the kernels."""

from __future__ import annotations

import pytest
from triton_rendered import REFERENCES, compare, gallery, random_inputs, torch, triton_module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_second_order")


def _second(run, inputs: dict, cotangent, directions: list) -> list:
    """The gradients of ⟨cotangent, run(inputs)⟩ and their derivative along directions (a Hessian-vector product)."""
    leaves = list(inputs.values())
    grads = torch.autograd.grad(run(inputs), leaves, cotangent, create_graph=True)
    along = sum((g * d).sum() for g, d in zip(grads, directions))
    return [*grads, *torch.autograd.grad(along, leaves)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["temperature", "bias", "softplus", "sigmoid", "differential", "pointer"])
def test_double_backward_matches_autograd_of_the_eager_forward(name, causal, folder):
    spec, generator = gallery(name), torch.Generator().manual_seed(21)
    module, reference = triton_module(spec, folder), REFERENCES[name]
    inputs = random_inputs(spec, generator)
    out = module.forward(**inputs, causal=causal)
    cotangent = torch.randn(out.shape, generator=generator).masked_fill(~out.isfinite(), 0.0)
    directions = [torch.randn(x.shape, generator=generator) for x in inputs.values()]
    got = _second(lambda x: module.forward(**x, causal=causal), inputs, cotangent, directions)
    double = {k: x.detach().double().requires_grad_() for k, x in inputs.items()}
    want = _second(lambda x: reference(x, causal), double, cotangent.double(), [d.double() for d in directions])
    for i, (a, b) in enumerate(zip(got, want)):
        compare(a, b, f"{name} causal={causal}: {'gradient' if i < len(inputs) else 'hvp'} {i % len(inputs)}", 1e-4)


def test_a_plain_backward_still_runs_the_kernels(folder, monkeypatch):
    """Without create_graph the backward kernels run (the eager core is never called); with it, it is."""
    module = triton_module("attention", folder)
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    calls = []
    eager = module._core_eager
    monkeypatch.setattr(module, "_core_eager", lambda *a: calls.append(1) or eager(*a))
    torch.autograd.grad(module.forward(q, k, v, causal=True).sum(), (q, k, v))
    assert not calls
    torch.autograd.grad(module.forward(q, k, v, causal=True).sum(), (q, k, v), create_graph=True)
    assert calls == [1]


def test_a_batched_cotangent_is_refused_in_one_line(folder):
    """torch.func.jacrev runs the backward under vmap: the kernels take one cotangent, so it is refused, clearly."""
    module = triton_module("attention", folder)
    q, k, v = (torch.randn(1, 1, 5, 16) for _ in range(3))
    with pytest.raises(
        RuntimeError, match=r"attention: the Triton kernels' backward does not run under torch.func.vmap"
    ):
        torch.func.jacrev(lambda x: module.forward(x, k, v))(q)
