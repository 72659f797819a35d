"""sa.from_torch of rotary position embeddings and grouped key/value heads, as Llama and Mistral write them in
plain torch (transformers' modeling_llama.py, copied in torch_corpus/hf.py): rotate_half (halves of the last axis,
negation, cat) is a product with a constant signed permutation R, the cos and sin tables (made by the model's rotary
module, (B, n, d) equal for every sequence) are constants, repeat_kv (expand + reshape) is symattn's grouped heads.
Also the interleaved form (stack then flatten(-2)) and a partial rotary (cat of a rotated and a passed part)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

torch = pytest.importorskip("torch")

from torch_corpus import hf  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.autodiff.grad import default_seed  # noqa: E402
from symattn.derive.check import true_gradient  # noqa: E402
from symattn.lang.ops import RepeatHeads  # noqa: E402
from symattn.trace.constants import sizes_of, spec_layout, spec_value  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402
from symattn.trace.source import spec_tensors, trace  # noqa: E402


def causal(lengths: list[int], n: int) -> torch.Tensor:
    """(B, 1, n, n) as transformers' create_causal_mask makes it for eager attention: 0, or float64's minimum."""
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    allowed = keep[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)


def _llama(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    return hf.LlamaLayerAttention(hf.llama_config(**config)).double().eval()


def _compare(model, closed, x, args, rtol: float) -> None:
    """The drop-in against autograd of the original: output and every gradient (within rtol: Llama's softmax is
    computed in float32, softmax(…, dtype=torch.float32), the generated code's in float64)."""
    g = torch.Generator().manual_seed(3)
    x = x.clone().requires_grad_()
    want = model(x, *args)
    cotangent = torch.randn(want.shape, dtype=torch.float64, generator=g)
    leaves = [x, *model.parameters()]
    wanted = torch.autograd.grad(want, leaves, cotangent)
    got = closed(x, *args)
    scale = want.abs().max().item()
    np.testing.assert_allclose(got.detach(), want.detach(), rtol=rtol, atol=rtol * scale, err_msg="output")
    for (name, _), a, b in zip(
        [("x", x), *model.named_parameters()], torch.autograd.grad(got, leaves, cotangent), wanted
    ):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * b.abs().max().item(), err_msg=f"∂f/∂{name}")


def test_llama_rotary_attention_traces_rotate_half_as_a_signed_permutation():
    model = _llama(num_key_value_heads=4)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    spec = sa.from_torch(model, x, causal([5, 3], 5))
    names = [str(c.name) for c in spec.constants]
    assert names == ["C", "R", "C_2", "R_2", "M"], names  # cos, q's rotation, sin, k's rotation, the mask
    traced = trace(model, (x, causal([5, 3], 5)))
    r = traced.program.replay((x, causal([5, 3], 5)), {}, [traced.constants[1].ref])[0]
    half = torch.eye(2, dtype=torch.float64)
    assert torch.equal(r, torch.cat([torch.cat([0 * half, half], 1), torch.cat([-half, 0 * half], 1)]))
    assert len(traced.upcast) == 1  # eager_attention_forward's softmax(…, dtype=torch.float32)
    closed = ClosedForm(model, (x, causal([5, 3], 5)))
    _compare(model, closed, torch.randn(3, 7, 16, dtype=torch.float64), (causal([7, 2, 5], 7),), 1e-6)


def _evaluated(model, x, mask) -> tuple:
    """The traced spec's output and gradients evaluated by symattn's own evaluator (not the generated code)."""
    traced = trace(model, (x, mask))
    spec = traced.spec
    tensors = [spec_layout(t).detach() for t in spec_tensors(traced, [x, *model.parameters()])]
    sizes = sizes_of(spec, tensors)
    raw = traced.program.replay((x, mask), dict(model.named_buffers()), [c.ref for c in traced.constants])
    constants = [spec_value(c, r, torch.float64, sizes) for c, r in zip(traced.constants, raw)]
    constants = [(c[:, None] if c.ndim == 3 else c).numpy() for c in constants]  # M (B, n, m) over the heads
    g = np.random.default_rng(0).standard_normal((*x.shape[:-1], model.self_attn.o_proj.out_features))
    values = [t.numpy() for t in tensors] + constants + [g]
    leaves = (*spec.inputs, *spec.constants, default_seed(spec.output, None))
    out = sa.lambdify(leaves[:-1], spec.output, dims=sizes)(*values[:-1])
    grads = [
        sa.lambdify(leaves, true_gradient(spec, name), sum_batch=i > 0, dims=sizes)(*values)
        for i, name in enumerate(spec.input_names)
    ]
    return spec, out, grads, torch.tensor(g)


def test_grouped_query_heads_trace_as_repeated_heads_and_match_autograd():
    """repeat_kv is repeat_heads(x, H_kv, H); the spec, evaluated by symattn's evaluator, is autograd's function."""
    model = _llama()
    x, mask = torch.randn(2, 5, 16, dtype=torch.float64), causal([5, 3], 5)
    spec, out, grads, g = _evaluated(model, x, mask)
    assert any(isinstance(e, RepeatHeads) for _, e in spec.intermediates)
    leaves = [x.clone().requires_grad_(), *model.parameters()]
    want = model(leaves[0], mask)
    np.testing.assert_allclose(out, want.detach(), rtol=1e-6, atol=1e-7)
    for name, got, ref in zip(spec.input_names, grads, torch.autograd.grad(want, leaves, g)):
        np.testing.assert_allclose(np.reshape(got, ref.shape), ref, rtol=1e-6, atol=1e-6, err_msg=name)


def test_grouped_query_llama_drops_in():
    model = _llama()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    closed = ClosedForm(model, (x, causal([5, 3], 5)))
    _compare(model, closed, torch.randn(3, 7, 16, dtype=torch.float64), (causal([7, 2, 5], 7),), 1e-6)


class InterleavedRotary(torch.nn.Module):
    """GPT-J's rotate_every_two (x[..., ::2], x[..., 1::2], stack, flatten(-2)) on half of each head (a partial
    rotary, as GPT-NeoX: the other half passed through and put back with cat), position tables made inside."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qk, self.v = heads, torch.nn.Linear(d, 2 * d), torch.nn.Linear(d, d)

    @staticmethod
    def rotate_every_two(x):
        x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, x):
        B, n, d = x.shape
        q, k = self.qk(x).split(d, dim=-1)
        q, k, v = (t.view(B, n, self.heads, -1).transpose(1, 2) for t in (q, k, self.v(x)))
        rot = q.shape[-1] // 2
        angles = torch.arange(n, dtype=x.dtype)[:, None] / 10 ** (torch.arange(rot, dtype=x.dtype) // 2 / rot)
        cos, sin = angles.cos(), angles.sin()
        q = torch.cat([q[..., :rot] * cos + self.rotate_every_two(q[..., :rot]) * sin, q[..., rot:]], dim=-1)
        k = torch.cat([k[..., :rot] * cos + self.rotate_every_two(k[..., :rot]) * sin, k[..., rot:]], dim=-1)
        y = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1) @ v
        return y.transpose(1, 2).reshape(B, n, d)


def test_interleaved_and_partial_rotary_drop_in():
    torch.manual_seed(0)
    model = InterleavedRotary().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    spec = sa.from_torch(model, x)
    assert {"R", "E"} <= {str(c.name).split("_")[0] for c in spec.constants}
    closed = ClosedForm(model, (x,))
    _compare(model, closed, torch.randn(3, 7, 16, dtype=torch.float64), (), 1e-10)


def test_a_cat_along_another_axis_is_refused_in_one_line():
    def rows_cat(q, k):
        return torch.cat([q, k], dim=-2) @ k.mT

    with pytest.raises(sa.SymattnError, match=r"cannot trace cat: cat along dim=-2.*test_from_torch_rotary.py:"):
        sa.from_torch(rows_cat, torch.randn(2, 3, 4), torch.randn(2, 3, 4))


class SdpaGroupedQuery(torch.nn.Module):
    """Grouped-query attention through sdpa's enable_gqa: 4 query heads, 2 key/value heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, x):
        B, n, _ = x.shape
        q = self.q(x).view(B, n, 4, 4).transpose(1, 2)
        k, v = (f(x).view(B, n, 2, 4).transpose(1, 2) for f in (self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, n, 16)


def test_sdpa_enable_gqa_repeats_the_key_and_value_heads():
    torch.manual_seed(0)
    model = SdpaGroupedQuery().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    traced = trace(model, (x,))
    spec = traced.spec
    assert RepeatHeads in {type(node) for node in sp.preorder_traversal(spec.output)}
    tensors = [spec_layout(t).detach().numpy() for t in spec_tensors(traced, [x, *model.parameters()])]
    sizes = sizes_of(spec, [spec_layout(t) for t in spec_tensors(traced, [x, *model.parameters()])])
    (mask,) = traced.program.replay((x,), {}, [c.ref for c in traced.constants])
    m = spec_value(traced.constants[0], mask, torch.float64, sizes).numpy()
    out = sa.lambdify((*spec.inputs, *spec.constants), spec.output, dims=sizes)(*tensors, m)
    np.testing.assert_allclose(out, model(x).detach(), rtol=1e-12, atol=1e-12)


class LlamaCalledWithTables(torch.nn.Module):
    """LlamaAttention called as a decoder layer calls it: position_embeddings=(cos, sin) a tuple argument."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = hf.LlamaAttention(hf.llama_config(num_key_value_heads=4))

    def forward(self, hidden_states, position_embeddings, attention_mask):
        return self.self_attn(hidden_states, position_embeddings, attention_mask)[0]


def test_rotary_tables_passed_in_a_tuple_are_the_call_s_own():
    """cos and sin given as a tuple argument are constants read from each call (positions 0, 2, 4, … at the example's
    shape give the original's output, not the example's tables; a shift alone would not tell: RoPE's scores depend
    on the positions' differences)."""
    torch.manual_seed(0)
    model = LlamaCalledWithTables().double().eval()
    rotary = hf.LlamaRotaryEmbedding(hf.llama_config())
    x = torch.randn(2, 5, 16, dtype=torch.float64)

    def tables(step: int, batch: int, n: int) -> tuple:
        return rotary(x, (step * torch.arange(n)).expand(batch, n))

    closed = ClosedForm(model, (x, tables(1, 2, 5), causal([5, 3], 5)))
    for step, batch, n in [(2, 2, 5), (3, 3, 7)]:
        y = torch.randn(batch, n, 16, dtype=torch.float64)
        args = (tables(step, batch, n), causal([n] * batch, n))
        np.testing.assert_allclose(closed(y, *args).detach(), model(y, *args).detach(), rtol=1e-6, atol=1e-7)
