"""The Triton modules' forward mode under Triton's interpreter (CPU float32 tensors, partial blocks): jvp (O and Ȯ in
one pass of the JVP kernel) and torch.func.jvp of forward (the core Function's jvp) against torch.func.jvp of an
independent eager forward in float64, with and without causal."""

from __future__ import annotations

import math

import pytest
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
    random_inputs,
    torch,
    triton_module,
)

import symattn as sa


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_jvp_modules")


def _spec(name: str) -> sa.Spec:
    return sa.spec(name) if name in sa.specs() else gallery(name)


def _expected(reference, inputs: dict, tangents: dict, causal: bool):
    """(output, its tangent) by torch.func.jvp of the float64 reference (an input without a tangent: zero)."""
    names = list(inputs)
    primals = tuple(x.detach().double() for x in inputs.values())
    moved = tuple(tangents[k].double() if k in tangents else torch.zeros_like(x) for k, x in zip(names, primals))
    return torch.func.jvp(lambda *xs: reference(dict(zip(names, xs)), causal), primals, moved)


def _tangents(inputs: dict, generator, left_out: str) -> dict:
    """A random tangent for each input but left_out (zero there: the kernel's absent-tangent path)."""
    return {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items() if k != left_out}


# softcap: a function's tangent; temperature: a trainable scalar's (τ̇ S); bias: an n × m input's tangent tile;
# sigmoid: no normaliser; gated: torch code after the core; qk_norm: Q and K of LayerNorms; softplus: the rows
# divided by their sums; differential: two cores; pointer: O = log_softmax(A), n × m
@pytest.mark.parametrize(
    "name, causal",
    [
        ("softcap", True),
        ("temperature", False),
        ("bias", True),
        ("sigmoid", True),
        ("gated", False),
        ("qk_norm", True),
        ("softplus", True),
        ("differential", False),
        ("pointer", True),
    ],
)
def test_jvp_matches_torch_func_jvp_of_the_eager_forward(name, causal, folder):
    generator = torch.Generator().manual_seed(17)
    spec = _spec(name)
    inputs = {k: x.detach() for k, x in random_inputs(spec, generator).items()}
    tangents = _tangents(inputs, generator, left_out="W_K")
    out, tangent = triton_module(spec, folder).jvp(*inputs.values(), tangents, causal=causal)
    want, want_tangent = _expected(REFERENCES[name], inputs, tangents, causal)
    compare(out, want, f"{name} jvp output")
    compare(tangent, want_tangent, f"{name} jvp tangent", rtol=5e-5)


def _masked_attention(mask):
    def reference(x, causal):
        return attend(x["Q"] @ x["K"].mT / math.sqrt(D) + mask, x["V"], causal)

    return reference


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_jvp_with_a_mask_and_a_row_all_masked(causal, folder):
    """A bool mask with row 3 all masked (zeros there, never NaN), and a float one for causal."""
    generator = torch.Generator().manual_seed(19)
    shapes = {"Q": (2, 2, N, D), "K": (2, 2, M, D), "V": (2, 2, M, DV)}
    inputs = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}
    tangents = _tangents(inputs, generator, left_out="K" if causal else "")
    if causal:
        mask = torch.randn((N, M), generator=generator)
        additive = mask
    else:
        mask = torch.rand((2, 1, N, M), generator=generator) < 0.3
        mask[:, :, 3] = True
        additive = torch.zeros(mask.shape).masked_fill(mask, -math.inf)
    out, tangent = triton_module("attention", folder).jvp(*inputs.values(), tangents, M=mask, causal=causal)
    want, want_tangent = _expected(_masked_attention(additive.double()), inputs, tangents, causal)
    kept = torch.arange(N) != 3  # the reference's fully masked row is NaN
    if not causal:
        assert not out[:, :, 3].any() and not tangent[:, :, 3].any()
    compare(out[..., kept, :], want[..., kept, :], "attention jvp output")
    compare(tangent[..., kept, :], want_tangent[..., kept, :], "attention jvp tangent", rtol=5e-5)


def test_torch_func_jvp_of_forward_runs_the_cores_jvp(folder):
    """torch.func.jvp through forward (the core Function's jvp: every tangent kind at once) equals jvp's."""
    generator = torch.Generator().manual_seed(23)
    shapes = {"Q": (2, N, D), "K": (2, M, D), "V": (2, M, DV), "B": (2, N, M)}
    inputs = {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()} | {"tau": torch.tensor(1.5)}
    tangents = {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items()}
    mask = (torch.rand((N, M), generator=generator) < 0.2) & ~torch.eye(N, M, dtype=torch.bool)
    module = triton_module(features_spec(), folder)

    def forward(*xs):
        return module.forward(*xs, mask, causal=True)

    out, tangent = torch.func.jvp(forward, tuple(inputs.values()), tuple(tangents.values()))
    mine, my_tangent = module.jvp(*inputs.values(), tangents, M=mask, causal=True)
    assert torch.equal(out, mine)
    assert (tangent - my_tangent).abs().max() <= 1e-5 * my_tangent.abs().max()

    def reference(x, causal):
        a = x["tau"] * torch.tanh(x["Q"] @ x["K"].mT / math.sqrt(D)) + x["B"]
        return attend(a.masked_fill(mask, -math.inf), x["V"], causal)

    _, want_tangent = _expected(reference, inputs, tangents, True)
    compare(tangent, want_tangent, "kernel_features torch.func.jvp tangent", rtol=5e-5)


def test_a_tangent_of_no_input_is_a_value_error(folder):
    module = triton_module("attention", folder)
    q, k, v = (torch.randn(1, size, D) for size in (N, M, M))
    with pytest.raises(ValueError, match="'X' is no input; inputs: Q, K, V"):
        module.jvp(q, k, v, {"X": q})


def test_torch_func_grad_runs_the_backward_kernels(folder):
    """torch.func.grad through forward (its level's wrapped tensors unwrapped for the kernels) equals autograd's
    gradient of an independent float64 forward."""
    generator = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(2, size, width, generator=generator) for size, width in ((N, D), (M, D), (M, DV)))
    module = triton_module("attention", folder)
    got = torch.func.grad(lambda q: module.forward(q, k, v, causal=True).sum())(q)
    double = q.double().requires_grad_()
    attend(double @ k.double().mT / math.sqrt(D), v.double(), True).sum().backward()
    compare(got, double.grad, "attention torch.func.grad dQ", rtol=5e-5)


def test_forward_mode_over_forward_mode_raises_instead_of_being_wrong(folder):
    """The JVP kernel's tangent is a first derivative: jvp of jvp raises (double backward is differentiable:
    test_triton_second_order.py)."""
    module = triton_module("attention", folder)
    q, k, v = (torch.randn(1, size, D) for size in (N, M, M))

    def tangent(q):
        return torch.func.jvp(lambda q: module.forward(q, k, v), (q,), (torch.ones_like(q),))[1]

    with pytest.raises(RuntimeError, match="forward mode over forward mode"):
        torch.func.jvp(tangent, (q.detach(),), (torch.ones_like(q),))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grouped_query_heads_jvp_matches_torch_func_jvp_of_the_torch_module(causal, folder):
    """mha with 4 query heads sharing 2 key/value heads (K and V never repeated: the kernels read head h // 2): jvp
    against torch.func.jvp of the generated torch module's forward, every input moving."""
    from symattn.generated import mha_torch

    generator = torch.Generator().manual_seed(29)
    shapes = {"Q": (2, N, 32), "K": (2, M, 32), "V": (2, M, 32), "W_Q": (32, 32), "W_K": (32, 16), "W_V": (32, 16)}
    shapes["W_O"] = (32, 32)
    inputs = {k: torch.randn(shape, generator=generator) / 3 for k, shape in shapes.items()}
    tangents = {k: torch.randn(x.shape, generator=generator) for k, x in inputs.items()}
    module = triton_module("mha", folder)
    assert "repeat_heads" not in module._compute.__code__.co_names
    heads = {"num_heads": 4, "num_kv_heads": 2, "causal": causal}
    out, tangent = module.jvp(*inputs.values(), tangents, **heads)
    want, want_tangent = torch.func.jvp(
        lambda *xs: mha_torch.forward(*(x.double() for x in xs), **heads),
        tuple(inputs.values()),
        tuple(tangents.values()),
    )
    compare(out, want, "grouped mha jvp output")
    compare(tangent, want_tangent, "grouped mha jvp tangent", rtol=5e-5)
