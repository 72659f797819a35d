"""The Hugging Face corpus: the attention of BERT, ViT, GPT-2, CLIP, BART, Whisper, OPT, DistilBERT (its 4.x
code, with a (B, m) 0/1 mask), T5, Llama and Mistral as transformers 5.x writes it (plain-torch copies in
torch_corpus/hf.py; transformers itself is not installed: nothing is downloaded), tiny configs, eval mode, float64,
each called as its model calls it with the masks transformers builds for eager attention ((B, 1, n, n): 0, or the
dtype's minimum on padding, future or out-of-window keys). Each is traced at batch 2, length 5, dropped in, and
compared with torch autograd of the original (output and every gradient) at batch 3, length 7, with new padding;
each traced spec's derivation is verified step by step."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_corpus import hf  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

MIN = torch.finfo(torch.float64).min


def _allowed(lengths: list[int], n: int, causal: bool, window: int | None = None) -> torch.Tensor:
    keep = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    if causal:
        keep = keep & (cols <= rows)
    if window is not None:
        keep = keep & (rows - cols < window)
    return keep.expand(len(lengths), 1, n, n)


def padding(lengths, n):
    """create_bidirectional_mask for eager attention: (B, 1, n, n), the dtype's minimum on the padding keys."""
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~_allowed(lengths, n, False), MIN)


def ones(lengths, n):
    """DistilBERT's (4.x) attention_mask: (B, n) of 1 on the tokens, 0 on the padding (an integer tensor)."""
    return (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()


def causal(lengths, n):
    """create_causal_mask for eager attention: padding and future keys at the dtype's minimum."""
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~_allowed(lengths, n, True), MIN)


def sliding(lengths, n):
    """create_sliding_window_causal_mask (window 3), as Mistral's; every sequence at least n − 2 long, so that each
    query's window holds a real token (a row masked whole is NaN in the original's float32 softmax: −∞ there)."""
    lengths = [max(length, n - 2) for length in lengths]
    return torch.zeros(len(lengths), 1, n, n, dtype=torch.float64).masked_fill(~_allowed(lengths, n, True, 3), MIN)


def clip_masks(lengths, n):
    """CLIP's text encoder: the padding mask and the causal mask, added in its attention."""
    future = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~_allowed([n], n, True), MIN)
    return padding(lengths, n), future.expand(len(lengths), 1, n, n)


F32 = 1e-6  # a softmax computed in float32 (softmax(…, dtype=torch.float32), T5's scores.float()): its rounding

CASES = [  # name, module, the masks it is called with (a function of lengths and n), tolerance
    ("bert_self_attention_padding", lambda: hf.First(hf.BertSelfAttention()), lambda lens, n: (padding(lens, n),), 0),
    ("bert_attention_block_padding", lambda: hf.First(hf.BertAttention()), lambda lens, n: (padding(lens, n),), 0),
    ("vit_self_attention", lambda: hf.First(hf.BertSelfAttention()), lambda lens, n: (), 0),
    ("gpt2_conv1d_causal", lambda: hf.First(hf.GPT2Attention()), lambda lens, n: (causal(lens, n),), 0),
    ("clip_text_padding_and_causal", hf.CLIPTextAttention, clip_masks, F32),
    ("bart_padding", lambda: hf.First(hf.BartAttention()), lambda lens, n: (padding(lens, n),), 0),
    ("whisper_decoder_causal", lambda: hf.First(hf.BartAttention(k_bias=False)), lambda lens, n: (causal(lens, n),), 0),
    ("opt_causal", lambda: hf.First(hf.OPTAttention()), lambda lens, n: (causal(lens, n),), 0),
    ("distilbert_padding_01_mask", hf.DistilBertSelfAttention, lambda lens, n: (ones(lens, n),), 0),
    ("t5_causal_zero_bias", lambda: hf.First(hf.T5Attention(), "mask"), lambda lens, n: (causal(lens, n),), F32),
    ("llama_rope_causal", lambda: hf.LlamaLayerAttention(hf.llama_config(num_key_value_heads=4)), None, F32),
    ("mistral_rope_sliding", lambda: hf.LlamaLayerAttention(hf.llama_config(num_key_value_heads=4)), None, F32),
    ("llama_gqa_rope_causal", lambda: hf.LlamaLayerAttention(hf.llama_config()), None, F32),
    ("mistral_gqa_rope_sliding", lambda: hf.LlamaLayerAttention(hf.llama_config()), None, F32),
]


def _masks(name, make):
    if make is not None:
        return make
    return (lambda lens, n: (sliding(lens, n),)) if name.startswith("mistral") else (lambda lens, n: (causal(lens, n),))


TIMES: dict[str, tuple[float, float]] = {}  # name: (trace s, drop-in build s): for the closing note (-s shows them)


@pytest.mark.parametrize("name, build, make, tolerance", CASES)
def test_a_hugging_face_attention_traces_and_drops_in(name, build, make, tolerance):
    make = _masks(name, make)
    torch.manual_seed(0)
    model = build().double().eval()
    example = (torch.randn(2, 5, 16, dtype=torch.float64), *make([5, 3], 5))
    start = time.perf_counter()
    spec = sa.from_torch(model, *example)
    traced = time.perf_counter()
    closed = ClosedForm(model, example, second_order=False)
    TIMES[name] = (traced - start, time.perf_counter() - traced)
    print(f"{name}: trace {TIMES[name][0]:.2f} s, generate {TIMES[name][1]:.2f} s, {len(spec.intermediates)} names")
    assert spec.intermediates, "the model's variable names"
    verification = sa.derive(spec).verify()  # every printed step of the derivation, at random matrices
    assert verification.ok, verification.text()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=g).requires_grad_()
    masks = make([7, 2, 5], 7)
    want = model(x, *masks)
    cotangent = torch.randn(want.shape, dtype=torch.float64, generator=g)
    leaves = [x, *model.parameters()]
    wanted = torch.autograd.grad(want, leaves, cotangent)
    got = closed(x, *masks)
    rtol = tolerance or 1e-10
    names = ["hidden_states", *(p for p, _ in model.named_parameters())]
    pairs = [("output", got.detach(), want.detach()), *zip(names, torch.autograd.grad(got, leaves, cotangent), wanted)]
    for label, a, b in pairs:
        atol = rtol * max(1.0, b.abs().max().item()) if tolerance else 1e-12
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{name}: {label} at 3 × 7")
