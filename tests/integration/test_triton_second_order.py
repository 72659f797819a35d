"""Second derivatives through the Triton modules under Triton's interpreter: a backward asked to be differentiable
(create_graph=True) recomputes the core by torch ops and differentiates it, so double backward, reverse over reverse
and the modules' hvp give what autograd of an independent float64 forward (and the torch module's closed form) gives;
a plain backward still runs the kernels."""

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


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hvp_matches_the_torch_modules_closed_form(causal, folder):
    """mha_triton.hvp (reverse over reverse through the eager cores) against mha_torch.hvp (the second closed form):
    grouped heads, some inputs moving, float32 against float64."""
    from symattn.generated import mha_torch

    generator = torch.Generator().manual_seed(23)
    shapes = {"Q": (2, 20, 32), "W_Q": (32, 32), "W_K": (32, 16), "W_V": (32, 16), "W_O": (32, 32)}
    x = {k: torch.randn(shape, generator=generator) / (6 if k.startswith("W") else 1) for k, shape in shapes.items()}
    grad_out = torch.randn(2, 20, 32, generator=generator)
    direction = {k: torch.randn(x[k].shape, generator=generator) for k in ("Q", "W_K", "W_O")}
    weights = [x[k] for k in ("W_Q", "W_K", "W_V", "W_O")]
    keywords = {"num_heads": 4, "num_kv_heads": 2, "causal": causal}
    got = triton_module("mha", folder).hvp(x["Q"], x["Q"], x["Q"], *weights, grad_out, direction, **keywords)
    wide = [t.double() for t in (x["Q"], *weights, grad_out)]
    want = mha_torch.hvp(*wide[:1] * 3, *wide[1:], {k: d.double() for k, d in direction.items()}, **keywords)
    assert sorted(got) == sorted(want) == ["K", "Q", "V", "W_K", "W_O", "W_Q", "W_V"]
    for name in want:
        compare(got[name], want[name], f"hvp {name}", 1e-4)


def test_hvp_of_a_trainable_scalar_and_its_errors(folder):
    """The temperature spec's hvp with τ moving, against reverse over reverse of the float64 eager forward; a
    direction that is not a dict, or names no input, is refused."""
    spec, generator = gallery("temperature"), torch.Generator().manual_seed(25)
    module, reference = triton_module(spec, folder), REFERENCES["temperature"]
    inputs = {k: x.detach() for k, x in random_inputs(spec, generator).items()}
    grad_out = torch.randn(module.forward(**inputs).shape, generator=generator)
    direction = {"tau": torch.tensor(0.7), "W_Q": torch.randn(inputs["W_Q"].shape, generator=generator)}
    got = module.hvp(*inputs.values(), grad_out, direction)
    double = {k: x.double().requires_grad_() for k, x in inputs.items()}
    grads = torch.autograd.grad(reference(double, False), list(double.values()), grad_out.double(), create_graph=True)
    along = sum((g * direction[k].double()).sum() for k, g in zip(double, grads) if k in direction)
    want = dict(zip(double, torch.autograd.grad(along, list(double.values()))))
    for name in want:  # τ's entry sums every score's: eager float32's own error there is 4e-4
        compare(got[name], want[name], f"hvp {name}", 1e-3 if name == "tau" else 1e-4)
    with pytest.raises(TypeError, match="direction: expected a dict"):
        module.hvp(*inputs.values(), grad_out, [1.0])
    with pytest.raises(ValueError, match="direction: 'nope' is no input"):
        module.hvp(*inputs.values(), grad_out, {"nope": 1.0})
