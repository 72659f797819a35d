"""The Triton modules' nn.Module under Triton's interpreter (CPU float32 tensors, partial blocks): the torch module's
constructor, parameters (names, shapes, initialisation) and forward, so a torch module's state dict loads into it and
both give the same output and parameter gradients."""

from __future__ import annotations

import pytest
from triton_rendered import M, N, features_spec, gallery, random_inputs, torch, triton_module


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_module")


def _same_module(ours, theirs, *args, **kwargs) -> None:
    """ours (Triton) with theirs' state dict: the same parameters, output and parameter gradients."""
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in theirs.state_dict().items()
    ]
    assert repr(ours) == repr(theirs).replace(type(theirs).__name__, type(ours).__name__, 1)
    ours.load_state_dict(theirs.state_dict())
    got, want = ours(*args, **kwargs), theirs(*args, **kwargs)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    got_grads = torch.autograd.grad(got, list(ours.parameters()), cotangent)
    want_grads = torch.autograd.grad(want, list(theirs.parameters()), cotangent)
    for (name, _), a, b in zip(ours.named_parameters(), got_grads, want_grads):
        assert (a - b).abs().max() <= 5e-5 * max(b.abs().max(), 1.0), name


def test_mha_is_the_torch_modules_class_with_grouped_heads_and_biases(folder):
    from symattn.generated import mha_torch

    torch.manual_seed(0)
    theirs = mha_torch.MultiHeadAttention(32, num_heads=4, num_kv_heads=2, bias=True)
    ours = triton_module("mha", folder).MultiHeadAttention(32, num_heads=4, num_kv_heads=2, bias=True)
    assert ours.W_K.shape == (32, 16) and ours.b_O.shape == (1, 32) and not ours.b_O.any()
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, rows, 32, generator=generator) for rows in (N, M, M))
    padding = torch.rand((2, M), generator=generator) < 0.3
    padding[:, 0] = False
    _same_module(ours, theirs, q, k, v, key_padding_mask=padding, causal=True)
    with pytest.raises(ValueError, match="num_kv_heads = 3 does not divide num_heads = 4"):
        triton_module("mha", folder).MultiHeadAttention(32, num_heads=4, num_kv_heads=3)


def test_self_attention_and_a_gallery_spec_with_a_trainable_scalar(folder):
    from symattn.generated import self_attention_torch

    torch.manual_seed(0)
    theirs = self_attention_torch.SelfAttention(28, 16, 12)
    ours = triton_module("self_attention", folder).SelfAttention(28, 16, 12)
    _same_module(ours, theirs, torch.randn(2, N, 28, generator=torch.Generator().manual_seed(2)))
    module = triton_module(gallery("temperature"), folder)
    temperature = module.TemperatureAttention(28, 16, 12)
    assert dict(temperature.named_parameters())["tau"].shape == () and temperature.tau.item() == 1.0
    x = torch.randn(2, N, 28, generator=torch.Generator().manual_seed(4))
    functional = module.forward(x, temperature.W_Q, temperature.W_K, temperature.W_V, temperature.tau)
    assert torch.equal(temperature(x), functional)
    temperature(x).sum().backward()
    assert temperature.tau.grad is not None and temperature.W_Q.grad.abs().max() > 0


def test_attention_without_weights_keeps_its_options(folder):
    from symattn.generated import attention_torch

    theirs, ours = attention_torch.Attention(scale=0.3), triton_module("attention", folder).Attention(scale=0.3)
    assert list(ours.parameters()) == [] and repr(ours) == repr(theirs)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, rows, 16, generator=generator) for rows in (N, M, M))
    got, want = ours(q, k, v, causal=True), theirs(q, k, v, causal=True)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_torch_compile_fullgraph_traces_forward_and_backward_with_a_trainable_scalar(folder):
    """torch.compile(fullgraph=True) of forward (a function in tanh, τ, an n × m input B and the mask M): the kernel
    launches are custom ops, τ reaches the kernels as a tensor (no float() breaking the graph), the Function's twin
    without jvp is traced; output and every gradient equal the eager call's (aot_eager: the kernels run under the
    interpreter, inductor's code needs a GPU)."""
    module = triton_module(features_spec(), folder)
    inputs = random_inputs(features_spec(), torch.Generator().manual_seed(6))
    inputs |= {
        name: torch.randn(shape, generator=torch.Generator().manual_seed(7)).requires_grad_()
        for name, shape in (("Q", (2, N, 16)), ("K", (2, M, 16)), ("V", (2, M, 12)), ("B", (2, N, M)))
    }
    mask = torch.zeros(N, M).masked_fill(torch.rand(N, M, generator=torch.Generator().manual_seed(8)) < 0.2, -1e4)
    torch._dynamo.reset()
    compiled = torch.compile(module.forward, fullgraph=True, backend="aot_eager")
    got, want = compiled(*inputs.values(), mask, causal=True), module.forward(*inputs.values(), mask, causal=True)
    assert torch.equal(got, want)
    for name, a, b in zip(
        inputs,
        torch.autograd.grad(got.square().sum(), list(inputs.values())),
        torch.autograd.grad(want.square().sum(), list(inputs.values())),
    ):
        assert torch.equal(a, b), name


def test_the_compiled_module_gives_the_eager_modules_bits_a_learned_mask_included(folder):
    """torch.compile(fullgraph=True) of the mha module (grouped heads, biases, a float mask per batch that requires
    grad, causal): output and the gradients of the mask, a weight and a bias bitwise the eager call's."""
    torch.manual_seed(0)
    module = triton_module("mha", folder).MultiHeadAttention(32, num_heads=4, num_kv_heads=2, bias=True)
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(2, N, 32, generator=generator)
    mask = torch.randn(2, 1, N, N, generator=generator).requires_grad_()
    torch._dynamo.reset()
    runs = []
    for run in (module, torch.compile(module, fullgraph=True, backend="aot_eager")):
        out = run(x, x, x, attn_mask=mask, causal=True)  # by keyword: a learned mask (in its position, a constant)
        runs.append([out, *torch.autograd.grad(out.square().sum(), [mask, module.W_Q, module.b_K])])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_an_eager_step_launches_the_kernels_without_the_dispatcher(folder):
    """The host's work per call is what a GPU waits for: an eager forward + backward calls the launches directly (no
    custom op dispatched), while torch.compile still sees the ops (the tests above)."""
    module = triton_module("attention", folder)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, N, 16, generator=generator, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as run:
        torch.autograd.grad(module.forward(q, k, v, causal=True).sum(), (q, k, v))
    names = {event.key for event in run.key_averages()}
    assert "_CoreFunction" in names and not {name for name in names if name.startswith("symattn_triton::")}, names


def test_an_eager_call_applies_the_function_without_its_python_binding_and_torch_func_through_it(folder, monkeypatch):
    """Outside torch.func the core Function is applied by autograd's own apply (Function.apply's Python, which binds
    the arguments to forward's signature, is host time on every call); under torch.func.grad through Function.apply
    (its custom_function_call), K and V captured while they require grad (the kernels' backward once went through the
    op's autograd there and failed). Both give the eager torch module's output and gradient."""
    from symattn.generated import attention_torch

    module = triton_module("attention", folder)
    calls, apply = [], torch.autograd.Function.apply.__func__  # Function.apply, counted
    monkeypatch.setattr(module._CoreFunction, "apply", classmethod(lambda cls, *a: calls.append(cls) or apply(cls, *a)))
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, rows, 16, generator=generator, requires_grad=True) for rows in (N, M, M))
    out, want = module.forward(q, k, v, causal=True), attention_torch.forward(q, k, v, causal=True)
    (grad,), (want_grad,) = torch.autograd.grad(out.sum(), q), torch.autograd.grad(want.sum(), q)
    assert calls == [] and (out - want).abs().max() <= 1e-5 and (grad - want_grad).abs().max() <= 1e-4
    got = torch.func.grad(lambda x: module.forward(x, k, v, causal=True).sum())(q.detach())  # k, v: requires_grad
    assert calls and (got - want_grad).abs().max() <= 1e-4
