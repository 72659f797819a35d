"""torch's own attention modules read by from_torch: nn.MultiheadAttention (self- and cross-attention, packed or
separate projections, biases or none, key padding and attention masks, need_weights either way),
nn.TransformerEncoder of post-LN and pre-LN layers in train and eval, nn.TransformerDecoderLayer. Each drop-in
matches torch autograd of an untouched copy of the original at another length (float64): output, the input's
gradient and every parameter's. What the language has no word for is refused in one line."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from symattn.errors import SymattnError  # noqa: E402
from symattn.trace import drop_in, from_torch  # noqa: E402

E, H = 8, 2
F64 = torch.float64


def _x(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _agrees(module, reference, *args):
    inputs = [a.clone().requires_grad_() if a.is_floating_point() else a for a in args]
    copies = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    got, want = module(*inputs), reference(*copies)
    cotangent = _x(*want.shape, seed=3)
    got.backward(cotangent)
    want.backward(cotangent)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    for a, b in zip(inputs, copies):
        if a.is_floating_point():
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-11, msg=name)


class SelfAttention(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **options)

    def forward(self, x):
        return self.attention(x, x, x)[0]  # need_weights=True, torch's default: the weights are not used


class Masked(torch.nn.Module):
    """Self-attention under a causal float mask (nn.Transformer's) and a bool key padding mask."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)

    def forward(self, x, padding):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.attention(x, x, x, key_padding_mask=padding, attn_mask=causal, need_weights=False)[0]


class Cross(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64, **options)

    def forward(self, x, memory):
        return self.attention(x, memory, memory, need_weights=False)[0]


@pytest.mark.parametrize("options", [{}, {"bias": False}], ids=["bias", "no-bias"])
def test_multihead_self_attention_drops_in(options):
    torch.manual_seed(0)
    module = SelfAttention(**options)
    reference = copy.deepcopy(module)
    closed = drop_in(module, _x(2, 5, E))
    assert "attention_in_proj_weight_0" in {str(s.name) for s in closed.spec.inputs}  # the packed weight's query block
    for n in (5, 7):
        _agrees(module, reference, _x(2, n, E, seed=n))


def test_multihead_attention_with_a_causal_mask_and_key_padding_drops_in():
    torch.manual_seed(0)
    module = Masked()
    reference = copy.deepcopy(module)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, -2:] = True
    drop_in(module, _x(2, 5, E), padding)
    longer = torch.zeros(2, 7, dtype=torch.bool)
    longer[1, -3:] = True
    _agrees(module, reference, _x(2, 7, E, seed=1), longer)


@pytest.mark.parametrize("options", [{}, {"kdim": 6, "vdim": 6}], ids=["packed", "separate"])
def test_multihead_cross_attention_drops_in(options):
    torch.manual_seed(0)
    module = Cross(**options)
    reference = copy.deepcopy(module)
    width = options.get("kdim", E)
    drop_in(module, _x(2, 5, E), _x(2, 6, width, seed=1))
    _agrees(module, reference, _x(2, 7, E, seed=2), _x(2, 4, width, seed=3))


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_transformer_encoder_drops_in(norm_first, mode):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        E,
        H,
        16,
        dropout=0.0,
        batch_first=True,
        norm_first=norm_first,
        activation="gelu" if norm_first else "relu",
        dtype=F64,
    )
    module = getattr(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), mode)()
    reference = copy.deepcopy(module)
    drop_in(module, _x(2, 5, E))
    _agrees(module, reference, _x(2, 6, E, seed=4))


def test_transformer_decoder_layer_drops_in():
    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerDecoderLayer(E, H, 16, dropout=0.0, batch_first=True, dtype=F64)

        def forward(self, x, memory):
            causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            return self.layer(x, memory, tgt_mask=causal, tgt_is_causal=True)

    torch.manual_seed(0)
    module = Decoder()
    reference = copy.deepcopy(module)
    drop_in(module, _x(2, 5, E), _x(2, 6, E, seed=1))
    _agrees(module, reference, _x(2, 7, E, seed=2), _x(2, 3, E, seed=3))


def test_the_attention_weights_are_refused_where_they_are_read():
    class Weights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)

        def forward(self, x):
            out, weights = self.attention(x, x, x)
            return out + weights @ x

    with pytest.raises(SymattnError, match="need_weights=False"):
        drop_in(Weights(), _x(2, 5, E))


def test_what_the_language_has_no_word_for_is_refused_in_one_line():
    cases = {
        "add_bias_kv": SelfAttention(add_bias_kv=True),
        "add_zero_attn": SelfAttention(add_zero_attn=True),
    }
    for what, module in cases.items():
        with pytest.raises(SymattnError, match=what) as caught:
            drop_in(module, _x(2, 5, E))
        assert "\n" not in str(caught.value)


class SequenceFirst(torch.nn.Module):
    """batch_first=False, torch's default: the input is (n, B, E)."""

    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(E, H, dtype=F64)

    def forward(self, x):
        return self.attention(x, x, x)[0]


def test_sequence_first_attention_drops_in():
    torch.manual_seed(0)
    module = SequenceFirst()
    reference = copy.deepcopy(module)
    drop_in(module, _x(5, 2, E))
    _agrees(module, reference, _x(7, 3, E, seed=2))


def test_sequence_first_transformer_drops_in():
    """nn.Transformer with its defaults (batch_first=False): encoder and decoder, masks made by its own helper."""
    torch.manual_seed(0)
    module = torch.nn.Transformer(E, H, 1, 1, 16, dropout=0.0, dtype=F64)
    reference = copy.deepcopy(module)

    def call(model, src, tgt):
        return model(src, tgt, tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[0], dtype=F64))

    class Wrapped(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, src, tgt):
            return call(self.model, src, tgt)

    wrapped, wanted = Wrapped(module), Wrapped(reference)
    drop_in(wrapped, _x(5, 2, E), _x(4, 2, E, seed=1))
    _agrees(wrapped, wanted, _x(6, 3, E, seed=4), _x(3, 3, E, seed=5))


def test_a_sequence_first_input_mixed_along_its_first_axis_is_refused():
    """Sequence first, x @ x.mT would mix the batch entries: refused, never read as a product of sequences."""

    class Mixed(SequenceFirst):
        def forward(self, x):
            return self.attention(x, x, x)[0] @ x.mT

    with pytest.raises(SymattnError, match="sequence first"):
        drop_in(Mixed(), _x(5, 2, E))


def test_an_unbatched_query_is_refused_in_one_line():
    module = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)

    class Unbatched(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = module

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    with pytest.raises(SymattnError, match="unbatched query"):
        drop_in(Unbatched(), _x(5, E))


@pytest.mark.parametrize(
    "form",
    [
        lambda x: -x.transpose(0, 1),
        lambda x: torch.sqrt(x.transpose(0, 1) ** 2 + 1),
        lambda x: x.transpose(0, 1) * 2,
        lambda x: x.transpose(0, 1),
    ],
    ids=["neg", "pow", "scaled", "returned"],
)
def test_a_tensor_transposed_to_sequence_first_is_never_read_as_batch_first(form):
    """transpose(0, 1) of a (B, n, c) tensor is (n, B, c): every operation on it but the transpose back (and torch's
    own attention) is refused, so that no later rule takes its first axis for the batch."""
    with pytest.raises(SymattnError, match="sequence first"):
        from_torch(form, _x(3, 4, 5))


def test_a_transpose_to_sequence_first_and_back_is_the_tensor():
    spec = from_torch(lambda x: (x.transpose(0, 1).contiguous().transpose(1, 0) * 2).softmax(-1), _x(3, 4, 5))
    assert str(spec.output) == "RowSoftmax(2*x)"


def test_multihead_attention_with_dropout_trains_as_torchs():
    """MultiheadAttention(dropout=p) in train(): SDPA's dropout_p, read as sa.dropout and drawn as torch draws it,
    so the drop-in and the original agree under the same seed (output and every gradient); in eval(), no draws."""
    torch.manual_seed(0)
    module = SelfAttention(dropout=0.3).train()
    reference = copy.deepcopy(module)
    drop_in(module, _x(2, 5, E))
    x = _x(3, 7, E, seed=1)
    leaves, copies = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    got = module(leaves)
    torch.manual_seed(5)
    want = reference(copies)
    cotangent = _x(*want.shape, seed=2)
    got.backward(cotangent)
    want.backward(cotangent)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaves.grad, copies.grad, rtol=1e-10, atol=1e-12)
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    module.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x), rtol=1e-10, atol=1e-12)
