"""Traced code reaches the fused kernels: every function and module of the ``from_torch`` corpora (plain torch,
positions written with ``torch.arange``, Hugging Face's own attention classes, Swin's window attention) dropped in,
its call on CUDA handed by the generated torch module to the spec's Triton module, rendered in memory at that first
call. Here the device rule is widened to CPU tensors and the kernels run under Triton's interpreter: the routed
call (float32) gives the torch ops' output and every gradient (float64)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # first: without torch (or triton, triton_rendered's skip) this module is skipped

from torch_corpus import ENTRIES, EXAMPLE_SIZES, NEW_SIZES  # noqa: E402
from triton_rendered import interpreted  # noqa: E402, F401  (skips without triton or the interpreter)

from symattn.trace.dropin import ClosedForm  # noqa: E402
from symattn.trace.source import bound_arguments  # noqa: E402

NOT_A_CORE = {  # corpus entries whose function has no core the kernels compute, and why their call keeps the torch ops
    "no_self_attention": "the weights multiplied by a constant after the softmax (P ⊙ C) V",
}


def _floating(x):
    return x.float() if _is_float(x) else x


def _is_float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _routed_calls(closed: ClosedForm, args: tuple, monkeypatch) -> list | None:
    """The generated module closed calls at args routed to its Triton module for CPU tensors; the list its kernels'
    calls go into (None where the spec has no Triton module)."""
    generated = closed.code(closed._traced_at(args).spec)
    monkeypatch.setattr(generated, "_kernel_device", lambda x: True)
    kernels = generated._kernels_module()
    if kernels is None:
        return None
    calls, forward = [], kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    return calls


def _kernels_give_the_torch_ops_values(fn, example: tuple, args: tuple, monkeypatch) -> None:
    """fn traced at example (float64) and dropped in; at args (float32) its call through the torch ops, then routed
    to the kernels: the same output and gradients (fn's float arguments and parameters)."""
    closed = ClosedForm(fn, example, second_order=False)

    inputs = set(closed._traced_at(args).arguments)  # the float arguments that are inputs (a float mask: a constant)
    names = list(bound_arguments(fn, args))

    def step(cast) -> list:
        given = tuple(cast(a).requires_grad_() if name in inputs else cast(a) for name, a in zip(names, args))
        leaves = [a for a in given if isinstance(a, torch.Tensor) and a.requires_grad]
        if isinstance(fn, torch.nn.Module):
            leaves += fn.to(leaves[0].dtype).parameters()
        out = closed(*given)
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)]

    want = step(lambda a: a.double() if _is_float(a) else a)  # the torch ops in float64
    calls = _routed_calls(closed, tuple(_floating(a) for a in args), monkeypatch)
    assert calls is not None, f"{closed.spec.name}: no Triton module"
    got = step(_floating)
    assert calls == [1]
    for a, b in zip(got, want):  # None: no gradient reaches the leaf (its input only stopped or unread), zero
        a, b = (torch.zeros(()) if x is None else x for x in (a, b))
        assert (a - b).abs().max() <= 1e-4 * max(b.abs().max(), 1.0), closed.spec.name


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.name not in NOT_A_CORE], ids=lambda e: e.name)
def test_the_corpus_dropped_in_runs_the_kernels(entry, monkeypatch):
    fn, example = entry.make(EXAMPLE_SIZES, torch.Generator().manual_seed(0))
    module = isinstance(fn, torch.nn.Module)  # its widths fixed: a new batch and the same lengths
    _, args = entry.make(EXAMPLE_SIZES | {"B": 3} if module else NEW_SIZES, torch.Generator().manual_seed(1))
    _kernels_give_the_torch_ops_values(fn, example, args, monkeypatch)


@pytest.mark.parametrize("name", sorted(NOT_A_CORE))
def test_a_function_without_a_core_keeps_the_torch_ops_on_cuda(name, monkeypatch):
    (entry,) = [e for e in ENTRIES if e.name == name]
    fn, example = entry.make(EXAMPLE_SIZES, torch.Generator().manual_seed(0))
    closed = ClosedForm(fn, example, second_order=False)
    args = tuple(_floating(a) for a in example)
    assert _routed_calls(closed, args, monkeypatch) is None
    spec_args = closed.inputs(args)
    assert closed.generated.path(*spec_args) == f"torch: no {closed.spec.name}_triton module imports beside this one"


def test_positions_written_with_arange_run_the_kernels(monkeypatch):
    """Every positional form of test_positions_from_torch (relative bias, ALiBi, windows, T5-style buckets, integer
    division, …) and a table held as a buffer: computed in the kernels' tiles."""
    from test_positions_from_torch import FORMS, Attention, _x

    for form in sorted(FORMS):
        torch.manual_seed(0)
        with monkeypatch.context() as patched:
            _kernels_give_the_torch_ops_values(Attention(form), (_x(5, 0),), (_x(7, 7),), patched)
    torch.manual_seed(0)
    _kernels_give_the_torch_ops_values(Attention("relative", buffer=True), (_x(5, 0),), (_x(7, 7),), monkeypatch)


TRANSFORMERS = (  # test_from_torch_transformers.CASES (imported in the test: transformers is optional)
    "bert_padding",
    "roberta_padding",
    "distilbert_padding",
    "vit",
    "gpt2_causal",
    "opt_causal",
    "clip_text_causal",
    "bart_padding",
    "whisper_causal",
    "t5_no_relative_bias_causal",
    "t5_relative_bias",
    "t5_relative_bias_decoder_causal",
    "llama_gqa_causal",
    "mistral_gqa_sliding",
)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_a_transformers_attention_dropped_in_runs_the_kernels(name, monkeypatch):
    pytest.importorskip("transformers")
    import test_from_torch_transformers as hf

    assert set(TRANSFORMERS) == set(hf.CASES)  # every case of the transformers corpus
    build, _ = hf.CASES[name]
    torch.manual_seed(0)
    model = build().double().eval()
    sliding = "sliding" in name
    example = (torch.randn(2, 5, 16, dtype=torch.float64), *hf._masks(name, [5, 4] if sliding else [5, 3], 5))
    args = (torch.randn(3, 7, 16, dtype=torch.float64), *hf._masks(name, [7, 5, 6] if sliding else [7, 2, 5], 7))
    _kernels_give_the_torch_ops_values(model, example, args, monkeypatch)


def test_swins_window_attention_dropped_in_runs_the_kernels(monkeypatch):
    """The relative position table read at the index buffer (T[idx[0, N·i + j], h]): both gathers in the kernels."""
    pytest.importorskip("transformers")
    import test_from_torch_transformers as hf
    from transformers.models.swin.modeling_swin import SwinAttention, SwinConfig

    torch.manual_seed(0)
    model = hf.First(SwinAttention(hf.config(SwinConfig, embed_dim=16), 16, 2, 2), None).double().eval()
    with torch.no_grad():
        model.attention.relative_position_bias.relative_position_bias_table.normal_()  # (zeros as Swin starts it)
    args = (torch.randn(3, 4, 16, dtype=torch.float64),)
    _kernels_give_the_torch_ops_values(model, (torch.randn(2, 4, 16, dtype=torch.float64),), args, monkeypatch)
