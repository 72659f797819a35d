"""The Triton modules under torch.func beyond grad and jvp (Triton's interpreter, CPU float32 tensors): vmap of
forward, jacrev (the backward under vmap: the backward op's vmap rule), per-sample gradients (vmap of grad), jacfwd
(the JVP kernel under vmap) and vjp, each against the same transform of a float64 eager forward; forward mode over
the kernels' backward (hessian) and a batched trainable scalar refused in one line."""

from __future__ import annotations

import math

import pytest
from triton_rendered import REFERENCES, compare, gallery, random_inputs, torch, triton_module

N, M, D = 6, 7, 4  # small: jacrev's batch is the output's size


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_func")


def _attention(q, k, v, mask=None, causal=False):
    """softmax(Q Kᵀ / √d + mask) V; causal: key j hidden from query i where j > i."""
    a = q @ k.mT / math.sqrt(q.shape[-1]) + (0 if mask is None else mask)
    if causal:
        a = a.masked_fill(torch.ones(a.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(a, -1) @ v


def _inputs(seed: int, *batch: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, size, D, generator=generator) for size in (N, M, M)]


def _close(got, want, what: str) -> None:
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        compare(a, b, what)


def test_vmap_of_forward_batches_some_inputs_and_broadcasts_the_others(folder):
    module = triton_module("attention", folder)
    q, k, v = _inputs(1, 3, 2)
    mask = torch.randn(N, M, generator=torch.Generator().manual_seed(2))
    run = torch.func.vmap(lambda a, b, c: module.forward(a, b, c, attn_mask=mask, causal=True), in_dims=(0, 0, None))
    want = torch.func.vmap(lambda a, b, c: _attention(a, b, c, mask.double(), True), in_dims=(0, 0, None))
    _close(run(q, k, v[0]), want(q.double(), k.double(), v[0].double()), "vmap of forward")


def test_jacrev_of_every_input_and_of_a_learned_mask(folder):
    """The cotangents batched through the backward op's vmap rule: dQ, dK, dV and the mask's gradient tiles."""
    module = triton_module("attention", folder)
    q, k, v = _inputs(3)
    mask = torch.randn(N, M, generator=torch.Generator().manual_seed(4))
    got = torch.func.jacrev(lambda *x: module.forward(*x[:3], attn_mask=x[3], causal=True), argnums=(0, 1, 2, 3))
    want = torch.func.jacrev(lambda *x: _attention(*x, causal=True), argnums=(0, 1, 2, 3))
    _close(got(q, k, v, mask), want(q.double(), k.double(), v.double(), mask.double()), "jacrev")


@pytest.mark.parametrize("name", ["temperature", "pointer"])
def test_per_sample_gradients_and_jacrev_of_a_scalar_core_and_a_map(name, folder):
    """vmap of grad over a batch of X with the weights (and τ) shared: the trainable scalar's sums and the map's
    backward under the op's vmap rule; and jacrev of the whole output."""
    spec = gallery(name)
    module, reference = triton_module(spec, folder), REFERENCES[name]
    inputs = random_inputs(spec, torch.Generator().manual_seed(5))
    x, rest = inputs["X"].detach()[0, :, :5], {k: t.detach() for k, t in inputs.items() if k != "X"}  # 2 × 5 rows
    order = list(inputs)

    def ours(x, *values):
        return module.forward(*dict(zip(order, (x, *values))).values())

    def theirs(x, *values):
        return reference(dict(zip(order, (x, *values))), False)

    argnums = tuple(range(len(order)))
    loss = torch.func.grad(lambda *a: ours(*a).square().sum(), argnums=argnums)
    want_loss = torch.func.grad(lambda *a: theirs(*a).square().sum(), argnums=argnums)
    in_dims = (0, *(None,) * len(rest))
    got = torch.func.vmap(loss, in_dims=in_dims)(x, *rest.values())
    want = torch.func.vmap(want_loss, in_dims=in_dims)(x.double(), *(t.double() for t in rest.values()))
    for a, b in zip(got, want):
        compare(a, b, f"{name} per-sample gradients", rtol=5e-5)
    jacobian = torch.func.jacrev(ours, argnums=argnums)(x[0], *rest.values())
    expected = torch.func.jacrev(theirs, argnums=argnums)(x[0].double(), *(t.double() for t in rest.values()))
    for a, b in zip(jacobian, expected):
        compare(a, b, f"{name} jacrev", rtol=5e-5)


def test_jacfwd_by_the_jvp_kernel_under_vmap(folder):
    module = triton_module("attention", folder)
    q, k, v = _inputs(6, 2)
    got = torch.func.jacfwd(lambda *x: module.forward(*x, causal=True), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.jacfwd(lambda *x: _attention(*x, causal=True), argnums=(0, 1, 2))(
        q.double(), k.double(), v.double()
    )
    _close(got, want, "jacfwd")


def test_vjp_called_after_the_transform_runs_the_kernels(folder):
    """torch.func.vjp's function called outside the transform (its saved inputs still wrapped): the kernels' first
    derivative, not a second derivative through the eager core."""
    module = triton_module("attention", folder)
    q, k, v = _inputs(7)
    cotangent = torch.randn(N, D, generator=torch.Generator().manual_seed(8))
    _, pullback = torch.func.vjp(module.forward, q, k, v)
    _, expected = torch.func.vjp(_attention, q.double(), k.double(), v.double())
    _close(pullback(cotangent), expected(cotangent.double()), "vjp")


def test_hessian_and_a_batched_scalar_are_refused_in_one_line(folder):
    module = triton_module("attention", folder)
    q, k, v = _inputs(9)
    with pytest.raises(RuntimeError, match=r"attention: forward mode over the kernels' backward \(hessian"):
        torch.func.hessian(lambda x: module.forward(x, k, v).sum())(q)
    spec = gallery("temperature")
    temperature = triton_module(spec, folder)
    inputs = {k: t.detach() for k, t in random_inputs(spec, torch.Generator().manual_seed(10)).items()}
    taus = torch.tensor([0.5, 1.5])
    in_dims = tuple(0 if name == "tau" else None for name in inputs)
    with pytest.raises(RuntimeError, match=r"a trainable scalar batched by torch.func.vmap is not supported"):
        torch.func.vmap(temperature.forward, in_dims=in_dims)(*(taus if k == "tau" else t for k, t in inputs.items()))
