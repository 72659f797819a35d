"""Hugging Face's own attention classes (the installed ``transformers``, tiny random configs built in code, nothing
downloaded) traced, verified, dropped in and compared with torch autograd of the original at a new batch and
length, masks made as the models make them (padding, causal, a sliding window): output and every gradient.
The plain-torch copies in ``torch_corpus/hf.py`` test the same forms without ``transformers``."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.bart.modeling_bart import BartAttention, BartConfig  # noqa: E402
from transformers.models.bert.modeling_bert import BertConfig, BertSelfAttention  # noqa: E402
from transformers.models.clip.modeling_clip import CLIPAttention, CLIPTextConfig  # noqa: E402
from transformers.models.distilbert.modeling_distilbert import DistilBertConfig, DistilBertSelfAttention  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaConfig, LlamaRotaryEmbedding  # noqa: E402
from transformers.models.mistral.modeling_mistral import (  # noqa: E402
    MistralAttention,
    MistralConfig,
    MistralRotaryEmbedding,
)
from transformers.models.opt.modeling_opt import OPTAttention, OPTConfig  # noqa: E402
from transformers.models.roberta.modeling_roberta import RobertaAttention, RobertaConfig  # noqa: E402
from transformers.models.swin.modeling_swin import SwinAttention, SwinConfig  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Attention, T5Config  # noqa: E402
from transformers.models.vit.modeling_vit import ViTAttention, ViTConfig  # noqa: E402
from transformers.models.whisper.modeling_whisper import WhisperAttention, WhisperConfig  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

MIN = torch.finfo(torch.float64).min
F32 = 1e-6  # softmax(…, dtype=torch.float32) in the model: its rounding, whatever the inputs' dtype


def mask(lengths: list[int], n: int, causal: bool, window: int | None = None):
    """The additive (B, 1, n, n) mask transformers builds: padding after each length, causal, a sliding window."""
    keep = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = keep & (cols <= rows) if causal else keep
    keep = keep & (rows - cols < window) if window else keep
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~keep.expand(-1, 1, n, n), MIN)


IMPLEMENTATION = {"name": "eager"}  # transformers' attention function: its eager math, or torch's sdpa


def config(cls, **options):
    made = cls(**options)
    made._attn_implementation = IMPLEMENTATION["name"]
    return made


class First(torch.nn.Module):
    """The attention module called as its model calls it, its first output (the attention output)."""

    def __init__(self, attention, keyword: str | None = "attention_mask") -> None:
        super().__init__()
        self.attention, self.keyword = attention, keyword

    def forward(self, x, m=None):
        out = self.attention(x) if self.keyword is None else self.attention(x, **{self.keyword: m})
        return out if isinstance(out, torch.Tensor) else out[0]


class Rotary(torch.nn.Module):
    """Llama and Mistral attention with the model's rotary embedding, made from positions 0 … n − 1."""

    def __init__(self, attention, rotary) -> None:
        super().__init__()
        self.attention, self.rotary = attention, rotary

    def forward(self, x, m):
        positions = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        return self.attention(x, self.rotary(x, positions), m)[0]


def llama(cls, rotary, config_cls, **options):
    made = config(config_cls, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, **options)
    return Rotary(cls(made, 0), rotary(made))


CASES = {  # name (causal, sliding: the masks its model makes): (module, tolerance)
    "bert_padding": (lambda: First(BertSelfAttention(config(BertConfig, hidden_size=16, num_attention_heads=2))), 0),
    "roberta_padding": (
        lambda: First(RobertaAttention(config(RobertaConfig, hidden_size=16, num_attention_heads=2))),
        0,
    ),
    "distilbert_padding": (lambda: First(DistilBertSelfAttention(config(DistilBertConfig, dim=16, n_heads=2))), 0),
    "vit": (lambda: First(ViTAttention(config(ViTConfig, hidden_size=16, num_attention_heads=2)), None), F32),
    "gpt2_causal": (lambda: First(GPT2Attention(config(GPT2Config, n_embd=16, n_head=2), layer_idx=0)), 0),
    "opt_causal": (
        lambda: First(OPTAttention(config(OPTConfig, hidden_size=16, num_attention_heads=2), layer_idx=0)),
        F32,
    ),
    "clip_text_causal": (
        lambda: First(CLIPAttention(config(CLIPTextConfig, hidden_size=16, num_attention_heads=2))),
        F32,
    ),
    "bart_padding": (lambda: First(BartAttention(16, 2, config=config(BartConfig, d_model=16))), 0),
    "whisper_causal": (
        lambda: First(WhisperAttention(16, 2, config=config(WhisperConfig, d_model=16), layer_idx=0)),
        0,
    ),
    "t5_no_relative_bias_causal": (
        lambda: First(
            T5Attention(config(T5Config, d_model=16, d_kv=8, num_heads=2), has_relative_attention_bias=False), "mask"
        ),
        F32,
    ),
    "t5_relative_bias": (lambda: First(t5(is_decoder=False), "mask"), F32),
    "t5_relative_bias_decoder_causal": (lambda: First(t5(is_decoder=True), "mask"), F32),
    "llama_gqa_causal": (lambda: llama(LlamaAttention, LlamaRotaryEmbedding, LlamaConfig), F32),
    "mistral_gqa_sliding": (lambda: llama(MistralAttention, MistralRotaryEmbedding, MistralConfig, head_dim=4), F32),
}


def _masks(name: str, lengths: list[int], n: int) -> tuple:
    if name == "vit":
        return ()
    return (mask(lengths, n, "causal" in name or "gqa" in name, 3 if "sliding" in name else None),)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_transformers_attention_traces_verifies_and_drops_in(name, implementation, monkeypatch):
    build, tolerance = CASES[name]
    monkeypatch.setitem(IMPLEMENTATION, "name", implementation)
    torch.manual_seed(0)
    model = build().double().eval()
    example = (torch.randn(2, 5, 16, dtype=torch.float64), *_masks(name, [5, 4] if "sliding" in name else [5, 3], 5))
    spec = sa.from_torch(model, *example)
    assert sa.derive(spec).verify().ok
    assert spec.intermediates  # the model's own variable names
    closed = ClosedForm(model, example, second_order=False)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    masks = _masks(name, [7, 5, 6] if "sliding" in name else [7, 2, 5], 7)
    leaves = [x, *model.parameters()]
    want = model(x, *masks)
    cotangent = torch.randn_like(want)
    expected = torch.autograd.grad(want, leaves, cotangent)
    got = closed(x, *masks)
    grads = torch.autograd.grad(got, leaves, cotangent)
    assert (got - want).abs().max() <= tolerance + 1e-12
    for a, b in zip(grads, expected):
        assert (a - b).abs().max() <= (tolerance + 1e-12) * max(1.0, float(b.abs().max()))


def t5(is_decoder: bool) -> T5Attention:
    """T5's attention with its learned relative bias (the first layer's): bidirectional buckets in the encoder,
    causal ones in the decoder."""
    made = config(T5Config, d_model=16, d_kv=8, num_heads=2, is_decoder=is_decoder, dropout_rate=0.0)
    return T5Attention(made, has_relative_attention_bias=True, layer_idx=0)


@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_t5s_relative_bias_is_a_table_read_at_its_buckets_at_every_length(is_decoder):
    """The bias is the learned table read at the relative position's bucket, nn.Embedding(bucket(i − j)): a
    matrix of positions per head, no n × m constant; right where the buckets are logarithmic (|i − j| ≥ 8 in the
    encoder, 16 in the decoder) and its table's gradient the scatter of the score cotangent."""
    torch.manual_seed(0)
    model = First(t5(is_decoder), "mask").double().eval()
    reference = copy.deepcopy(model)
    example = (torch.randn(2, 5, 16, dtype=torch.float64), mask([5, 3], 5, is_decoder))
    spec = sa.from_torch(model, *example)
    assert not spec.constants or [str(c.name) for c in spec.constants] == ["M"]  # the mask argument alone
    sa.trace.drop_in(model, *example)
    for n in (9, 40):
        x = torch.randn(2, n, 16, dtype=torch.float64)
        given = (mask([n, n - 5], n, is_decoder),)
        leaves, copies = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = model(leaves, *given), reference(copies, *given)
        cotangent = torch.randn(want.shape, dtype=torch.float64)
        got.backward(cotangent)
        want.backward(cotangent)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(leaves.grad, copies.grad, rtol=1e-6, atol=1e-9)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_swins_window_attention_reads_its_relative_position_table_at_its_index_buffer(implementation, monkeypatch):
    """SwinAttention (window 2 × 2: N = 4 tokens, 2 heads): relative_position_bias_table[relative_position_index]
    (the index a flat buffer made from meshgrid), viewed (N, N, H), permuted and unsqueezed into the mask the
    attention function adds: the nested read T[idx[0, N·i + j], h], idx a spec constant. The derivation verifies;
    the drop-in matches the model's autograd at other batch sizes (eager: its float32 softmax)."""
    monkeypatch.setitem(IMPLEMENTATION, "name", implementation)
    torch.manual_seed(0)
    model = First(SwinAttention(config(SwinConfig, embed_dim=16), 16, 2, 2), None).double().eval()
    with torch.no_grad():
        model.attention.relative_position_bias.relative_position_bias_table.normal_()  # (zeros as Swin starts it)
    reference = copy.deepcopy(model)
    example = (torch.randn(2, 4, 16, dtype=torch.float64),)
    spec = sa.from_torch(model, *example)
    assert [str(c.name) for c in spec.constants] == ["relative_position_index"]
    assert sa.derive(spec).verify().ok
    sa.trace.drop_in(model, *example)
    tolerance = (F32 if implementation == "eager" else 0) + 1e-12
    for batch in (3, 6):
        x = torch.randn(batch, 4, 16, dtype=torch.float64)
        leaves, copies = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = model(leaves), reference(copies)
        cotangent = torch.randn(want.shape, dtype=torch.float64)
        got.backward(cotangent)
        want.backward(cotangent)
        assert (got - want).abs().max() <= tolerance
        assert (leaves.grad - copies.grad).abs().max() <= tolerance
        for p, q in zip(model.parameters(), reference.parameters()):
            assert (p.grad - q.grad).abs().max() <= tolerance * max(1.0, float(q.grad.abs().max()))
            p.grad = q.grad = None
