"""Every configuration of the drop-ins against torch's own modules built with the same arguments (issue 57):
TransformerEncoderLayer over norm_first × each spelling of the activation × bias × batch_first, MultiheadAttention
over bias × batch_first × kdim/vdim × need_weights × batched; the same state dict, eval mode; the output and the
gradients of the input and of every parameter agree within 1e-9 relative (float64, tiny sizes)."""

from __future__ import annotations

import functools
import sys

import pytest

from symattn.specs import family, spec

torch = pytest.importorskip("torch")

from symattn.generated import mha_torch, transformer_block_torch  # noqa: E402

F = torch.nn.functional
E, H, FF, L, S, N = 6, 2, 5, 4, 3, 2
RELATIVE = 1e-9

# torch's spellings of each activation the block computes: (id, the constructor's activation argument)
ACTIVATIONS = [
    ("relu", "relu"),
    ("gelu", "gelu"),
    ("F.relu", F.relu),
    ("F.gelu", F.gelu),
    ("nn.ReLU", torch.nn.ReLU()),
    ("nn.GELU", torch.nn.GELU()),
    ("nn.GELU-tanh", torch.nn.GELU(approximate="tanh")),
    ("partial-gelu-tanh", functools.partial(F.gelu, approximate="tanh")),
    ("F.silu", F.silu),
    ("nn.SiLU", torch.nn.SiLU()),
    ("lambda-gelu-tanh", lambda x: F.gelu(x, approximate="tanh")),  # matched on the probe grid
    ("lambda-relu", lambda x: torch.relu(x)),
]
# one spelling per activation the block computes: the full grid over bias and batch_first for these
CORE = {"relu", "gelu", "nn.GELU-tanh", "F.silu"}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (0 for two zero tensors)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / scale if scale else (got - want).abs().max().item()


def compare(ref, ours, inputs, outputs) -> float:
    """The largest relative error of the output(s) and of the gradients of the inputs and every parameter of a
    random loss through both modules (ours loaded from torch's state dict, both in eval mode)."""
    ours.load_state_dict(ref.state_dict())
    ref.eval(), ours.eval()
    want, got = outputs(ref), outputs(ours)
    torch.manual_seed(3)
    seeds = [torch.randn_like(w) for w in want]

    def gradients(module, results):
        loss = sum((r * seed).sum() for r, seed in zip(results, seeds))
        return torch.autograd.grad(loss, [*inputs, *module.parameters()])

    pairs = [*zip(got, want), *zip(gradients(ours, got), gradients(ref, want), strict=True)]
    assert [name for name, _ in ours.named_parameters()] == [name for name, _ in ref.named_parameters()]
    return max(relative_error(a, b) for a, b in pairs)


def encoder_layers(activation, **options):
    """torch's layer with random parameters (biases and norms away from their init) and the drop-in, float64."""
    torch.manual_seed(5)
    kwargs = {"dim_feedforward": FF, "dropout": 0.1, "activation": activation, "dtype": torch.float64} | options
    ref = torch.nn.TransformerEncoderLayer(E, H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) / 3)
    return ref, transformer_block_torch.TransformerEncoderLayer(E, H, **kwargs)


def encoder_case(norm_first, spelling, bias, batch_first) -> float:
    ref, ours = encoder_layers(dict(ACTIVATIONS)[spelling], norm_first=norm_first, bias=bias, batch_first=batch_first)
    torch.manual_seed(2)
    x = torch.randn((N, L, E) if batch_first else (L, N, E), dtype=torch.float64, requires_grad=True)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, -1] = True
    return compare(ref, ours, [x], lambda module: [module(x, src_key_padding_mask=padding)])


GRID = [
    pytest.param(
        norm_first,
        spelling,
        bias,
        batch_first,
        id=f"{'pre' if norm_first else 'post'}-LN-{spelling}-{'bias' if bias else 'no_bias'}-"
        + ("batch_first" if batch_first else "seq_first"),
        marks=() if spelling in CORE or (bias and batch_first) else pytest.mark.slow,
    )
    for norm_first in (False, True)
    for spelling, _ in ACTIVATIONS
    for bias in (True, False)
    for batch_first in (False, True)
]


@pytest.mark.parametrize(("norm_first", "spelling", "bias", "batch_first"), GRID)
def test_encoder_layer_matches_torch_in_every_configuration(norm_first, spelling, bias, batch_first):
    # post-LN: X₁ = LN₁(X + MHA(X)), Z = LN₂(X₁ + FFN(X₁)); pre-LN: Y = X + MHA(LN₁(X)), Z = Y + FFN(LN₂(Y))
    assert encoder_case(norm_first, spelling, bias, batch_first) <= RELATIVE


@pytest.mark.parametrize("layer_norm_eps", [1e-5, 0.3])
def test_encoder_layer_eps_and_unbatched_input(layer_norm_eps):
    ref, ours = encoder_layers(F.silu, norm_first=False, layer_norm_eps=layer_norm_eps)
    x = torch.randn(L, E, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert compare(ref, ours, [x], lambda module: [module(x, src_mask=mask, is_causal=True)]) <= RELATIVE


def test_each_configuration_has_its_closed_form_and_only_the_generated_one_the_kernels():
    """The generated module computes the family's default configuration (pre-LN, exact GELU), the one its Triton
    module's kernels compute; every other configuration gets its own closed form, on the torch ops."""
    default = family("transformer_block").configuration(spec("transformer_block"))
    assert transformer_block_torch.CONFIGURATION == default
    assert transformer_block_torch._closed_form(default) == (
        transformer_block_torch.FUNCTION,
        transformer_block_torch.TRACED,
        True,
        None,
    )
    functions = {transformer_block_torch.FUNCTION}
    for norm_first in (False, True):
        for name, approximate in (("relu", "none"), ("gelu", "none"), ("gelu", "tanh"), ("silu", "none")):
            configuration = {"norm_first": norm_first, "activation": name, "approximate": approximate}
            if configuration != default:
                function, _, kernels, _ = transformer_block_torch._closed_form(configuration)
                assert not kernels and function not in functions
                functions.add(function)
    assert len(functions) == 8


def attention_case(bias, batch_first, dims, need_weights, batched) -> float:
    kdim, vdim = dims
    torch.manual_seed(7)
    kwargs = {"bias": bias, "batch_first": batch_first, "kdim": kdim, "vdim": vdim, "dtype": torch.float64}
    ref = torch.nn.MultiheadAttention(E, H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) / 3)
    ours = mha_torch.MultiheadAttention(E, H, **kwargs)
    torch.manual_seed(11)

    def make(length, width):
        shape = ((N, length, width) if batch_first else (length, N, width)) if batched else (length, width)
        return torch.randn(shape, dtype=torch.float64, requires_grad=True)

    q, k, v = make(L, E), make(S, kdim or E), make(S, vdim or E)
    padding = torch.zeros((N, S) if batched else (S,), dtype=torch.bool)
    padding[..., 0] = True

    def outputs(module):
        out, weights = module(q, k, v, key_padding_mask=padding, need_weights=need_weights)
        return [out] if weights is None else [out, weights]

    return compare(ref, ours, [q, k, v], outputs)


ATTENTION_GRID = [
    pytest.param(
        bias, batch_first, dims, need_weights, batched, id=f"{bias=}-{batch_first=}-{dims=}-{need_weights=}-{batched=}"
    )
    for bias in (True, False)
    for batch_first in (False, True)
    for dims in ((None, None), (4, 3))
    for need_weights in (True, False)
    for batched in (True, False)
]


@pytest.mark.parametrize(("bias", "batch_first", "dims", "need_weights", "batched"), ATTENTION_GRID)
def test_multihead_attention_matches_torch_in_every_configuration(bias, batch_first, dims, need_weights, batched):
    assert attention_case(bias, batch_first, dims, need_weights, batched) <= RELATIVE


def test_another_configuration_without_symattn_is_refused_in_one_line(monkeypatch):
    # a copy of the generated module where symattn does not import: its own configuration runs, another is refused
    monkeypatch.setattr(transformer_block_torch, "_CONFIGURED", {})
    monkeypatch.setitem(sys.modules, "symattn.codegen.generate", None)
    with pytest.raises(NotImplementedError, match=r"configuration=.*'norm_first': False.*symattn renders it"):
        transformer_block_torch.TransformerEncoderLayer(E, H, FF)
    transformer_block_torch.TransformerEncoderLayer(E, H, FF, activation="gelu", norm_first=True)


@pytest.mark.parametrize(
    ("ours", "theirs", "options"),
    [
        (mha_torch.MultiheadAttention, torch.nn.MultiheadAttention, {}),
        (mha_torch.MultiheadAttention, torch.nn.MultiheadAttention, {"kdim": 3, "vdim": 5, "bias": False}),
        (transformer_block_torch.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer, {"dim_feedforward": FF}),
        (transformer_block_torch.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer, {"bias": False}),
    ],
)
def test_the_same_seed_initialises_the_same_parameters(ours, theirs, options):
    # torch's initialisation, drawn in torch's order: the same arguments and seed give the same state dict
    torch.manual_seed(0)
    want = theirs(E, H, **options).state_dict()
    torch.manual_seed(0)
    got = ours(E, H, **options).state_dict()
    assert list(got) == list(want) and all(torch.equal(got[name], want[name]) for name in want)
