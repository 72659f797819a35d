"""sa.from_torch of two layouts attention code writes its heads in, each dropped in at one length and compared with
torch autograd of the original module at another (float64; output and the gradients of the input and of every
parameter, relative error ≤ 1e-9):

- along the heads axis: multi-query keys and values by slicing one head (k[:, :1]) or by a one-head projection
  broadcast against the query's H heads (matmul's and sdpa's broadcasting, expand), grouped heads by
  repeat_interleave, a range of heads (x[:, h0:h1], narrow);
- batch and heads merged, (B, H, n, d) ↔ (B·H, n, d): torch.bmm, BLOOM's baddbmm (alpha = 1/√d, an ALiBi bias as
  its input, a causal mask by masked_fill), GPT-NeoX's baddbmm of torch.zeros, a float mask as the input, addmm.

Also transformers' own BloomAttention and FalconAttention (ALiBi; multi-query or not), which read their fused
projection's pieces inside each head (view(B, n, H, 3, d)[..., i, :]). A reshape that moves the sequence into the
batch, a tiling of several heads and an index that drops the heads axis are refused in one line."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import symattn as sa  # noqa: E402
from symattn.lang.graph import postorder  # noqa: E402
from symattn.lang.ops import RepeatHeads  # noqa: E402
from symattn.trace.dropin import ClosedForm, drop_in  # noqa: E402

C, H = 16, 4
D = C // H


class Projections(torch.nn.Module):
    """q, k, v and output projections, the heads split as (B, H, n, d) by view and transpose(1, 2)."""

    def __init__(self, kv_width: int = C, out_width: int = C) -> None:
        super().__init__()
        self.q = torch.nn.Linear(C, C)
        self.k = torch.nn.Linear(C, kv_width)
        self.v = torch.nn.Linear(C, kv_width)
        self.o = torch.nn.Linear(out_width, C)

    def heads(self, x: torch.Tensor, proj: torch.nn.Module) -> torch.Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, -1, D).transpose(1, 2)

    def merged(self, a: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = a.shape
        return self.o(a.transpose(1, 2).reshape(b, n, -1))


def _attend(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


class SlicedMultiQuery(Projections):
    """Multi-query by slicing: one key and one value head, k[:, :1], broadcast against the H query heads."""

    def forward(self, x):
        q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
        return self.merged(_attend(q, k[:, :1], v[:, :1]))


class OneHeadMultiQuery(Projections):
    """Multi-query by a one-head projection: view(B, n, 1, d); keys broadcast by matmul, values by expand."""

    def __init__(self) -> None:
        super().__init__(kv_width=D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.heads(x, self.q), self.k(x).view(b, n, 1, D).transpose(1, 2)
        v = self.v(x).unsqueeze(1).expand(b, H, n, D)
        return self.merged(_attend(q, k, v))


class SdpaMultiQuery(Projections):
    """Multi-query through F.scaled_dot_product_attention: a one-head key (view(B, n, 1, d)) and value (x[:, None])
    broadcast by sdpa against the H query heads, is_causal."""

    def __init__(self) -> None:
        super().__init__(kv_width=D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.heads(x, self.q), self.k(x).view(b, n, 1, D).transpose(1, 2), self.v(x)[:, None]
        return self.merged(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class InterleavedGroups(Projections):
    """Grouped heads: two key/value heads, each repeated to two query heads by repeat_interleave(2, dim=1)."""

    def __init__(self) -> None:
        super().__init__(kv_width=2 * D)

    def forward(self, x):
        q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
        return self.merged(_attend(q, k.repeat_interleave(2, dim=1), v.repeat(1, 1, 1, 1).repeat_interleave(2, 1)))


class HeadRange(Projections):
    """A range of heads: heads 1 and 2 of the queries and keys (x[:, 1:3]), of the values (narrow)."""

    def __init__(self) -> None:
        super().__init__(out_width=2 * D)

    def forward(self, x):
        q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
        return self.merged(_attend(q[:, 1:3], k[..., 1:3, :, :], v.narrow(1, 1, 2)))


def _merged_heads(x, proj):
    """(B, n, H·d) → (B·H, n, d), as BLOOM and GPT-NeoX lay the heads out for bmm and baddbmm."""
    b, n, _ = x.shape
    return proj(x).view(b, n, H, D).transpose(1, 2).reshape(b * H, n, D)


def _split_back(a, b):
    """(B·H, n, d) → (B, n, H·d): view(B, H, n, d), permute, reshape."""
    return a.view(b, H, a.size(-2), D).permute(0, 2, 1, 3).reshape(b, a.size(-2), H * D)


class MergedBmm(Projections):
    """bmm on (B·H, n, d), scaled by 1/√d, a causal mask by masked_fill, bmm with the values, viewed back."""

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (_merged_heads(x, p) for p in (self.q, self.k, self.v))
        s = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(D)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o(_split_back(torch.bmm(torch.softmax(s, dim=-1), v), b))


class BloomStyle(Projections):
    """BLOOM's scores: alibi.baddbmm(q, kᵀ, beta=1, alpha=1/√d) with an ALiBi bias (B·H, 1, n) made from a buffer of
    slopes, viewed (B, H, n, n), the bool mask argument by masked_fill(finfo.min), the probabilities viewed back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, H + 1, dtype=torch.float64))

    def forward(self, x, mask):
        b, n, _ = x.shape
        q = _merged_heads(x, self.q)
        k = self.k(x).view(b, n, H, D).permute(0, 2, 3, 1).reshape(b * H, D, n)
        v = _merged_heads(x, self.v)
        alibi = (self.slopes[:, None, None] * torch.arange(n, dtype=x.dtype)[None, None, :]).repeat(b, 1, 1)
        s = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=1 / math.sqrt(D))
        s = s.view(b, H, n, n).masked_fill(mask, torch.finfo(x.dtype).min)
        p = torch.softmax(s, dim=-1).view(b * H, n, n)
        return self.o(_split_back(torch.bmm(p, v), b))


class NeoXStyle(Projections):
    """GPT-NeoX's scores: baddbmm of torch.zeros(B·H, n, n), beta=1, alpha = d^(−½); a causal buffer by torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.ones(32, 32, dtype=torch.bool).tril())

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (_merged_heads(x, p) for p in (self.q, self.k, self.v))
        zeros = torch.zeros(b * H, n, n, dtype=x.dtype)
        s = torch.baddbmm(zeros, q, k.transpose(1, 2), beta=1.0, alpha=D**-0.5).view(b, H, n, n)
        s = torch.where(self.bias[:n, :n], s, torch.finfo(x.dtype).min)
        return self.merged(torch.softmax(s, dim=-1) @ v.view(b, H, n, D))


class MaskAsInput(Projections):
    """The additive mask as baddbmm's input, beta = 1 (float, (B·H, n, n)); an unused input with beta = 0."""

    def forward(self, x, additive):
        b, n, _ = x.shape
        q, k, v = (_merged_heads(x, p) for p in (self.q, self.k, self.v))
        unused = torch.empty(b * H, n, n, dtype=x.dtype).fill_(float("nan"))
        s = torch.baddbmm(unused, q, k.transpose(1, 2), beta=0.0, alpha=1.0)
        s = torch.baddbmm(additive, q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(D)) + 0.5 * s
        return self.o(_split_back(torch.bmm(torch.softmax(s, dim=-1), v), b))


def _causal_bool(lengths: list[int], n: int) -> torch.Tensor:
    """(B, 1, n, n), True where not allowed: above the diagonal, or past a sequence's length."""
    keep = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
    return ~(keep[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril())


def _additive(lengths: list[int], n: int) -> torch.Tensor:
    """(B·H, n, n): 0 where allowed, −10⁹ where not (causal and padding)."""
    blocked = _causal_bool(lengths, n).expand(len(lengths), H, n, n).reshape(len(lengths) * H, n, n)
    return torch.zeros(blocked.shape, dtype=torch.float64).masked_fill(blocked, -1e9)


CASES = {  # name: (the module, its extra arguments at a batch's lengths and a length)
    "sliced_multi_query": (SlicedMultiQuery, None),
    "one_head_multi_query": (OneHeadMultiQuery, None),
    "sdpa_multi_query": (SdpaMultiQuery, None),
    "interleaved_groups": (InterleavedGroups, None),
    "head_range": (HeadRange, None),
    "merged_bmm": (MergedBmm, None),
    "bloom_baddbmm": (BloomStyle, _causal_bool),
    "neox_baddbmm": (NeoXStyle, None),
    "mask_as_input": (MaskAsInput, _additive),
}


def _args(name: str, lengths: list[int], n: int) -> tuple:
    extra = CASES[name][1]
    return (extra(lengths, n),) if extra is not None else ()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want|, the latter at least 10⁻³: a gradient that is zero but for round-off (∂/∂ a key
    bias, which adds the same to each row of scores) is compared absolutely, to 10⁻¹²."""
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-3)).item()


def _drop_in_matches_autograd(model, examples: tuple, args: tuple, inputs: int = 1, tolerance: float = 1e-9) -> None:
    """model dropped in at the examples against autograd of the original at args (another batch and length): the
    output, and the gradients of the first ``inputs`` arguments and of every parameter, within ``tolerance``."""
    original = copy.deepcopy(model)
    drop_in(model, *examples, second_order=False)
    name = type(model).__name__
    results = []
    for m in (original, model):
        leaves = [a.clone().requires_grad_() for a in args[:inputs]]
        out = m(*leaves, *args[inputs:])
        cotangent = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        results.append((out.detach(), torch.autograd.grad(out, [*leaves, *m.parameters()], cotangent)))
    (want, wanted), (got, grads) = results
    assert _relative(got, want) <= tolerance, f"{name}: output"
    labels = [*(f"argument {i}" for i in range(inputs)), *(p for p, _ in model.named_parameters())]
    for label, a, b in zip(labels, grads, wanted, strict=True):
        assert _relative(a, b) <= tolerance, f"{name}: ∂f/∂{label}"


@pytest.mark.parametrize("name", CASES)
def test_a_heads_form_drops_in_and_matches_autograd_at_another_length(name):
    """Traced and dropped in at 2 × 5, against autograd of the original at 3 × 7."""
    torch.manual_seed(0)
    model = CASES[name][0]().double().eval()
    g = torch.Generator().manual_seed(1)
    examples = (torch.randn(2, 5, C, dtype=torch.float64, generator=g), *_args(name, [5, 3], 5))
    args = (torch.randn(3, 7, C, dtype=torch.float64, generator=g), *_args(name, [7, 2, 5], 7))
    _drop_in_matches_autograd(model, examples, args)


@pytest.mark.parametrize(
    "name", ["sliced_multi_query", "one_head_multi_query", "sdpa_multi_query", "interleaved_groups"]
)
def test_shared_key_value_heads_are_repeat_heads(name):
    spec = sa.from_torch(CASES[name][0]().double(), torch.randn(2, 5, C, dtype=torch.float64))
    assert any(isinstance(node, RepeatHeads) for node in postorder(spec.output)), spec.output


def test_the_merged_layout_reads_as_the_per_head_one():
    """bmm on (B·H, n, d) and matmul on (B, H, n, d) trace to the same spec output (the names of the spec aside)."""

    class PerHead(MergedBmm):
        def forward(self, x):
            n = x.size(1)
            q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
            s = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e30)
            return self.merged(torch.softmax(s, -1) @ v)

    x = torch.randn(2, 5, C, dtype=torch.float64)
    assert sa.from_torch(MergedBmm().double(), x).output == sa.from_torch(PerHead().double(), x).output


def _refused(fn, *args) -> str:
    with pytest.raises(sa.SymattnError) as err:
        sa.from_torch(fn, *args)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_a_reshape_that_moves_the_sequence_into_the_batch_is_refused_in_one_line():
    model = MergedBmm().double()
    x = torch.randn(2, 5, C, dtype=torch.float64)

    def rows_in_batch(x):
        q = _merged_heads(x, model.q)
        return q.reshape(-1, D).sum()

    def sequence_with_heads(x):
        q = _merged_heads(x, model.q)
        return q.view(2, H * 5, D)

    assert "a reshape from (8, 5, 4) to (40, 4)" in _refused(rows_in_batch, x)
    assert "a reshape from (8, 5, 4) to (2, 20, 4)" in _refused(sequence_with_heads, x)


def test_a_tiling_of_several_heads_and_a_dropped_heads_axis_are_refused_in_one_line():
    class Tiled(InterleavedGroups):  # head h reads key/value head h mod 2: no grouping of symattn's
        def forward(self, x):
            q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
            return self.merged(_attend(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)))

    class Indexed(SlicedMultiQuery):  # k[:, 0] drops the heads axis: (B, n, d) with batch axes meets H heads
        def forward(self, x):
            q, k, v = (self.heads(x, p) for p in (self.q, self.k, self.v))
            return self.merged(_attend(q, k[:, 0], v[:, :1]))

    x = torch.randn(2, 5, C, dtype=torch.float64)
    assert "repeat tiles 2 heads 2 times" in _refused(Tiled().double(), x)
    assert "cannot trace __getitem__" in _refused(Indexed().double(), x)


def test_addmm_with_beta_and_alpha_is_the_scaled_sum():
    # addmm(C, A, B, beta=β, alpha=α) = β C + α A B, of matrices; β = 0 ignores C
    def scaled(a, b, c):
        return torch.addmm(c, a, b, beta=0.5, alpha=2.0) + torch.addmm(c, a, b, beta=0.0)

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(*s, dtype=torch.float64, generator=g).requires_grad_() for s in ((5, 3), (3, 4), (5, 4)))
    closed = ClosedForm(scaled, (a.detach(), b.detach(), c.detach()))
    want = scaled(a, b, c)
    got = closed(a, b, c)
    assert _relative(got, want) <= 1e-12
    for x, y in zip(torch.autograd.grad(got.sum(), (a, b, c)), torch.autograd.grad(want.sum(), (a, b, c))):
        assert _relative(x, y) <= 1e-12


class BloomOutput(torch.nn.Module):
    """BloomAttention's output (it returns (output, weights)), called as BloomBlock calls it."""

    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x, residual, alibi, attention_mask):
        return self.attn(x, residual, alibi, attention_mask)[0]


class FalconOutput(BloomOutput):
    """FalconAttention's output, called as FalconDecoderLayer calls it."""

    def forward(self, x, alibi, attention_mask):
        return self.attn(x, alibi, attention_mask)[0]


def _alibi_and_causal(build, b: int, n: int) -> tuple:
    """The model's ALiBi bias (B·H, 1, n) for unpadded sequences and transformers' additive causal mask (B, 1, n, n)."""
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    mask = torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill(causal, torch.finfo(torch.float64).min)
    return build(torch.ones(b, n, dtype=torch.long), H, torch.float64), mask


def _bloom():
    from transformers.models.bloom.modeling_bloom import BloomAttention, BloomConfig, build_alibi_tensor

    config = BloomConfig(hidden_size=C, n_head=H, attention_dropout=0.0, hidden_dropout=0.0)
    config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)

    def args(b, n):  # hidden states, the residual (an input too), ALiBi, the causal mask
        x, residual = (torch.randn(b, n, C, dtype=torch.float64, generator=g) for _ in range(2))
        return (x, residual, *_alibi_and_causal(build_alibi_tensor, b, n))

    return BloomOutput(BloomAttention(config, layer_idx=0)), args, 2, 1e-6  # BLOOM's softmax is computed in float32


def _falcon(multi_query: bool):
    from transformers.models.falcon.modeling_falcon import FalconAttention, FalconConfig, build_alibi_tensor

    config = FalconConfig(
        hidden_size=C, num_attention_heads=H, multi_query=multi_query, alibi=True, new_decoder_architecture=False
    )
    config.bias, config.attention_dropout, config._attn_implementation = True, 0.0, "eager"
    g = torch.Generator().manual_seed(1)

    def args(b, n):
        return (torch.randn(b, n, C, dtype=torch.float64, generator=g), *_alibi_and_causal(build_alibi_tensor, b, n))

    return FalconOutput(FalconAttention(config, layer_idx=0)), args, 1, 1e-9


def test_bloom_with_padded_sequences_reads_its_alibi_per_head_and_per_sequence():
    """BLOOM's ALiBi of right-padded sequences (build_alibi_tensor of the 0/1 attention mask, (B·H, 1, n)) differs per
    sequence and per head: a per-head constant per sequence, read at positions (issue 56). Against autograd of the
    original at another batch size, length and padding."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import BloomAttention, BloomConfig, build_alibi_tensor

    config = BloomConfig(hidden_size=C, n_head=H, attention_dropout=0.0, hidden_dropout=0.0)
    config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)

    def args(lengths: list[int], n: int) -> tuple:
        x, residual = (torch.randn(len(lengths), n, C, dtype=torch.float64, generator=g) for _ in range(2))
        kept = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
        _, causal = _alibi_and_causal(build_alibi_tensor, len(lengths), n)
        mask = causal.masked_fill(kept[:, None, None, :] == 0, torch.finfo(torch.float64).min)
        return x, residual, build_alibi_tensor(kept, H, torch.float64), mask

    torch.manual_seed(0)
    model = BloomOutput(BloomAttention(config, layer_idx=0)).double().eval()
    _drop_in_matches_autograd(model, args([5, 3], 5), args([7, 4, 6], 7), 2, 1e-6)  # BLOOM's softmax: float32


@pytest.mark.parametrize("name", ["bloom", "falcon_multi_query", "falcon"])
def test_bloom_and_falcon_attention_from_transformers_drop_in(name):
    """transformers' own BloomAttention (fused (B, n, H, 3, d) pieces, baddbmm of the ALiBi bias with alpha = 1/√d,
    (B·H, n, d) and bmm) and FalconAttention with ALiBi (multi-query: one key and value head of the (B, n, H + 2, d)
    view, broadcast; the merged layout by flatten(0, 1)), against autograd of the original at another length."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, args, inputs, tolerance = _bloom() if name == "bloom" else _falcon(name == "falcon_multi_query")
    _drop_in_matches_autograd(model.double().eval(), args(2, 5), args(3, 7), inputs, tolerance)
