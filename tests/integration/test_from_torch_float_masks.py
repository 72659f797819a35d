"""sa.from_torch of eager attention that adds a float mask to its per-head scores, as Hugging Face's eager
attention adds a (B, 1, 1, m) padding or (B, 1, n, m) causal attention_mask (0 where allowed, a large negative
number or −∞ where not): the argument is the spec's additive mask M (a constant, not an input), and the generated
modules and the drop-in take it at any batch size and length. Each is checked against torch autograd of the
original at new inputs, a new batch size, a new length and a new padding."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rendered import close, load  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

D, H = 8, 2


class EagerSelfAttention(torch.nn.Module):
    """BERT's eager self-attention: q, k, v projections split into heads, scores + attention_mask, softmax."""

    def __init__(self, sliced: bool = False) -> None:
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(D, D) for _ in range(3))
        self.sliced = sliced

    def heads(self, x):
        return x.view(*x.shape[:2], H, D // H).transpose(1, 2)

    def forward(self, hidden_states, attention_mask):
        q, k, v = (
            self.heads(self.query(hidden_states)),
            self.heads(self.key(hidden_states)),
            self.heads(self.value(hidden_states)),
        )
        attn_weights = q @ k.transpose(-1, -2) / math.sqrt(D // H)
        if self.sliced:  # as transformers' eager_attention_forward: the mask cut to the keys
            attention_mask = attention_mask[:, :, :, : k.shape[-2]]
        attn_weights = attn_weights + attention_mask
        probs = torch.softmax(attn_weights, dim=-1)
        context = (probs @ v).transpose(1, 2)
        return context.reshape(*context.shape[:2], D)


def padding(lengths: list[int], n: int, extra: int = 0) -> torch.Tensor:
    """(B, 1, 1, n + extra): 0 on each sequence's first tokens, float64's most negative number on its padding."""
    keep = torch.arange(n + extra)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.zeros(len(lengths), 1, 1, n + extra, dtype=torch.float64)
    return mask.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float64).min)


def causal(lengths: list[int], n: int, extra: int = 0) -> torch.Tensor:
    """(B, 1, n, n): −∞ on later keys and on the padding, 0 elsewhere."""
    future = torch.zeros(n, n + extra, dtype=torch.float64).masked_fill(
        torch.ones(n, n + extra, dtype=torch.bool).triu(1), -math.inf
    )
    padded = padding(lengths, n, extra)
    return torch.minimum(padded.masked_fill(padded < 0, -math.inf), future)


MASKS = [
    ("padding", padding, False),
    ("causal", causal, False),
    ("sliced_padding", lambda lengths, n: padding(lengths, n, extra=2), True),
]


def _model(sliced: bool) -> EagerSelfAttention:
    torch.manual_seed(0)
    return EagerSelfAttention(sliced).double()


def _want(model, x, mask, cotangent):
    leaves = [x.clone().requires_grad_(), *model.parameters()]
    out = model(leaves[0], mask)
    return out.detach(), torch.autograd.grad(out, leaves, cotangent)


NEW = [(2, 5, [3, 5]), (3, 7, [7, 2, 5])]  # the example's sizes with new padding, then a new batch size and length


@pytest.mark.parametrize("kind, make, sliced", MASKS, ids=[m[0] for m in MASKS])
@pytest.mark.parametrize("backend", ["torch", "numpy", "drop_in"])
def test_a_float_mask_added_to_per_head_scores_is_the_additive_mask(kind, make, sliced, backend):
    model = _model(sliced)
    example = (torch.randn(2, 5, D, dtype=torch.float64), make([5, 4], 5))
    spec = sa.from_torch(model, *example)
    names = [key.replace(".", "_") for key, _ in model.named_parameters()]
    assert spec.input_names == ("hidden_states", *names)  # the mask is no input: it has no gradient
    assert [str(c.name) for c in spec.constants] == ["M"] and not spec.bool_forms
    module = load(spec, backend) if backend != "drop_in" else None
    closed = ClosedForm(model, example) if backend == "drop_in" else None
    for seed, (batch, n, lengths) in enumerate(NEW):
        g = torch.Generator().manual_seed(seed + 1)
        x, mask = torch.randn(batch, n, D, dtype=torch.float64, generator=g), make(lengths, n)
        cotangent = torch.randn(batch, n, D, dtype=torch.float64, generator=g)
        want_out, want = _want(model, x, mask, cotangent)
        M = mask[..., :n]  # in torch's layout, (B, 1, 1, m) or (B, 1, n, m), as the model's own code gets it
        params = [p.detach().clone() for p in model.parameters()]
        if backend == "numpy":
            out, saved = module.forward(x.numpy(), *(p.numpy() for p in params), M.numpy())
            grads = module.backward(saved, cotangent.numpy())
            got = [grads[name] for name in spec.input_names]
        else:
            leaves = [x.clone().requires_grad_(), *(p.requires_grad_() for p in params)]
            out = module.forward(*leaves, M) if backend == "torch" else closed(leaves[0], mask)
            got = torch.autograd.grad(
                out, leaves if backend == "torch" else [leaves[0], *model.parameters()], cotangent
            )
            out = out.detach()
        close(out, want_out, f"output at {batch} × {n}")
        for name, a, b in zip(spec.input_names, got, want):
            close(a, b, f"∂f/∂{name} at {batch} × {n}")


def _per_head(lengths: list[int], n: int) -> torch.Tensor:
    """A float mask varying along the batch and the heads: the padding, and head 1 of sequence 0 blind to key 0."""
    per_head = padding(lengths, n).expand(len(lengths), H, n, n).clone()
    per_head[0, 1, :, 0] = -math.inf
    return per_head


def test_a_float_mask_that_varies_over_the_batch_and_the_heads_is_a_per_head_constant_per_sequence():
    """Read at positions, [C_ij] split into the heads: the drop-in passes each call's own (B, n, H·m)."""
    model = _model(False)
    closed = ClosedForm(model, (torch.randn(2, 5, D, dtype=torch.float64), _per_head([5, 4], 5)))
    (c,) = closed.spec.constants
    assert c.shape[1] == H * c.shape[0]
    for seed, (batch, n, lengths) in enumerate(NEW):
        g = torch.Generator().manual_seed(seed + 1)
        x, mask = torch.randn(batch, n, D, dtype=torch.float64, generator=g), _per_head(lengths, n)
        cotangent = torch.randn(batch, n, D, dtype=torch.float64, generator=g)
        want_out, want = _want(model, x, mask, cotangent)
        leaves = [x.clone().requires_grad_(), *model.parameters()]
        out = closed(leaves[0], mask)
        close(out.detach(), want_out, f"output at {batch} × {n}")
        for name, a, b in zip(closed.spec.input_names, torch.autograd.grad(out, leaves, cotangent), want):
            close(a, b, f"∂f/∂{name} at {batch} × {n}")


def test_a_float_matrix_without_batch_axes_stays_an_input():
    """A float (n, m) argument added to the scores is still an input with a gradient, as before."""
    model = _model(False)
    spec = sa.from_torch(model, torch.randn(2, 5, D, dtype=torch.float64), torch.randn(5, 5, dtype=torch.float64))
    assert spec.input_names[:2] == ("hidden_states", "attention_mask") and not spec.constants


def test_traced_at_batch_one_the_drop_in_takes_a_larger_batch():
    """At batch 1 the (1, 1, 1, m) mask broadcast over nothing is still M, not an input of batch (1, 1)."""
    model = _model(False)
    example = (torch.randn(1, 5, D, dtype=torch.float64), padding([4], 5))
    assert sa.from_torch(model, *example).input_names[0:2] == ("hidden_states", "query_weight")
    closed = ClosedForm(model, example)
    g = torch.Generator().manual_seed(5)
    x, mask = torch.randn(3, 7, D, dtype=torch.float64, generator=g), padding([7, 2, 5], 7)
    cotangent = torch.randn(3, 7, D, dtype=torch.float64, generator=g)
    want_out, want = _want(model, x, mask, cotangent)
    leaves = [x.clone().requires_grad_(), *model.parameters()]
    out = closed(leaves[0], mask)
    close(out.detach(), want_out, "output")
    for a, b in zip(torch.autograd.grad(out, leaves, cotangent), want):
        close(a, b, "gradient")


def test_the_drop_in_refuses_a_float_mask_that_requires_grad():
    """The additive mask is a constant: a mask that requires grad would silently get none, so the call raises."""
    model = _model(False)
    example = (torch.randn(2, 5, D, dtype=torch.float64), padding([5, 4], 5))
    closed = ClosedForm(model, example)
    with pytest.raises(sa.SymattnError, match="attention_mask requires grad"):
        closed(example[0], example[1].clone().requires_grad_())


class SlicedKeys(EagerSelfAttention):
    """Keys and values from a slice of a second float argument: no mask, so the slice is refused as before."""

    def forward(self, hidden_states, encoder_states):
        keys = encoder_states[:, :4]
        q, k, v = self.heads(self.query(hidden_states)), self.heads(self.key(keys)), self.heads(self.value(keys))
        context = (torch.softmax(q @ k.mT, dim=-1) @ v).transpose(1, 2)
        return context.reshape(*context.shape[:2], D)


class MaskUsedTwice(EagerSelfAttention):
    """The float mask added to the scores and multiplied into the output: a constant there would lose its gradient."""

    def forward(self, hidden_states, attention_mask):
        return super().forward(hidden_states, attention_mask) * attention_mask.squeeze(1).mT[..., :1]


def test_a_float_argument_that_is_no_additive_mask_keeps_its_refusal():
    x = torch.randn(2, 5, D, dtype=torch.float64)
    torch.manual_seed(0)
    with pytest.raises(sa.SymattnError, match=r"cannot trace __getitem__: indexing or slicing a traced tensor"):
        sa.from_torch(SlicedKeys().double(), x, torch.randn(2, 6, D, dtype=torch.float64))
    with pytest.raises(sa.SymattnError, match=r"attention_mask .* uses it otherwise too"):
        sa.from_torch(MaskUsedTwice().double(), x, padding([5, 3], 5))


def test_a_float_argument_that_asks_for_a_gradient_stays_an_input():
    """An example that requires grad says the user wants its gradient: it is not read as a constant mask, and a
    batched float input added to per-head values is refused as before (nothing is silently not differentiated)."""
    x = torch.randn(2, 5, D, dtype=torch.float64)
    bias = padding([5, 3], 5).clone().requires_grad_()
    with pytest.raises(sa.SymattnError, match="per-head values"):
        sa.from_torch(_model(False), x, bias)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_the_mask_is_taken_in_any_shape_that_broadcasts_and_a_wrong_one_is_named(backend):
    """M as (B, 1, 1, m), (B, 1, n, m), (B, n, m), (B, 1, m) or (n, m) gives the same output; a shape that broadcasts
    to none of (n, m) and (B, n, m) is a ValueError naming M."""
    model = _model(False)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    module = load(sa.from_torch(model, x, padding([5, 4], 5)), backend)
    mask = padding([5, 3], 5)
    params = [p.detach() for p in model.parameters()]
    shapes = [mask, mask.expand(2, 1, 5, 5), mask[:, 0].expand(2, 5, 5), mask[:, 0], mask[0, 0].expand(5, 5)]

    def run(m):
        if backend == "numpy":
            return module.forward(x.numpy(), *(p.numpy() for p in params), m.numpy())[0]
        return module.forward(x, *params, m).detach()

    want = model(x, mask).detach()
    for m in shapes:
        close(run(m), want if m.ndim != 2 else model(x, m).detach(), f"M {tuple(m.shape)}")
    with pytest.raises(ValueError, match=r"M: expected shape .* got \(2, 2, 1, 5\)"):
        run(mask.expand(2, 2, 1, 5))


def test_two_float_arguments_added_together_are_masks_only_where_their_sum_is_one():
    """CLIP adds its padding and causal masks before the scores do (test_from_torch_hf_corpus.py); two position
    tables added together and used as values stay inputs, with their gradients."""

    def tables(x, pos1, pos2):
        h = x + (pos1 + pos2)
        return torch.softmax(h @ h.mT, -1) @ h

    spec = sa.from_torch(tables, *(torch.randn(2, 5, 4, dtype=torch.float64) for _ in range(3)))
    assert spec.input_names == ("x", "pos1", "pos2") and not spec.constants
