"""The Triton backward's two modes under Triton's interpreter (CPU float32, partial blocks): deterministic=True (the
default: dQ by the query part, the same bits run to run) and deterministic=False (dQ added by the key part's atomic
adds, no query part: 5 products per tile against 7). Every gradient of both against torch autograd of an independent
float64 forward, for a core with V (plain, causal, grouped-query heads with masks), the transformer block, a
positional spec, a gallery variant and a map core; the atomic launch taken exactly where the query part has nothing
else to make (an n × m input's gradient, a trainable scalar, a learned table: the deterministic path); the two
backward parts launched apart with their own non-square blocks."""

from __future__ import annotations

import math

import pytest
from test_positions_tables import table_spec
from test_triton_heads import _eager, _inputs
from test_triton_positions import positional_spec
from test_triton_positions import reference as positional_reference
from triton_rendered import DV, REFERENCES, D, M, N, compare, counted, gallery, random_inputs, torch, triton_module

MODES = (True, False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_deterministic")


def _spied(module, monkeypatch) -> list[bool]:
    """The atomic flag of every backward plan made from now on (the module's plans made again)."""
    seen, parts = [], module._backward_parts
    monkeypatch.setattr(module, "_PLANS", {})
    monkeypatch.setattr(module, "_backward_parts", lambda *a: seen.append(a[-1]) or parts(*a))
    return seen


def _both_modes(forward, reference, inputs: dict, generator, rtol=1e-4) -> list:
    """forward(inputs, deterministic) for each mode: output and every input's gradient against autograd of
    reference (float64, the same cotangent); [each mode's gradients]."""
    double = {k: x.detach().double().requires_grad_() for k, x in inputs.items()}
    want = reference(double)
    cotangent = torch.randn(want.shape, generator=generator, dtype=torch.float64)
    wanted = torch.autograd.grad(want, list(double.values()), cotangent)
    found = []
    for deterministic in MODES:
        out = forward(inputs, deterministic)
        grads = torch.autograd.grad(out, list(inputs.values()), cotangent.float())
        compare(out, want.detach(), f"forward deterministic={deterministic}", rtol=rtol)
        for name, got, expected in zip(inputs, grads, wanted):
            compare(got, expected, f"d{name} deterministic={deterministic}", rtol=rtol)
        found.append(grads)
    return found


def _attention_inputs(generator) -> dict:
    return {
        k: torch.randn(2, 2, r, c, generator=generator).requires_grad_()
        for k, r, c in (("Q", N, D), ("K", M, D), ("V", M, DV))
    }


def _sdpa(causal: bool):
    return lambda x: torch.nn.functional.scaled_dot_product_attention(x["Q"], x["K"], x["V"], is_causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_in_both_modes_the_atomic_one_with_five_products_per_tile_against_seven(causal, folder, monkeypatch):
    module, generator = triton_module("attention", folder), torch.Generator().manual_seed(1)
    inputs = _attention_inputs(generator)
    seen = _spied(module, monkeypatch)
    dots, _ = counted(module, monkeypatch)  # the interpreter's tl.dot calls
    marks = []  # the count before and after each mode's forward (its backward runs after it, before the next)

    def forward(x, deterministic):
        marks.append(dots[0])
        out = module.forward(*x.values(), causal=causal, deterministic=deterministic)
        marks.append(dots[0])
        return out

    grads = _both_modes(forward, _sdpa(causal), inputs, generator)
    marks.append(dots[0])
    forwards, backwards = (marks[1] - marks[0], marks[3] - marks[2]), (marks[2] - marks[1], marks[4] - marks[3])
    tiles = forwards[0] // 2  # the tiles a pass visits (the forward: S and P V, 2 products each)
    assert seen == [False, True] and forwards == (2 * tiles, 2 * tiles) and tiles > 0
    assert backwards == (7 * tiles, 5 * tiles), "deterministic=False: the key part alone, 5 products per tile"
    assert all(torch.equal(a, b) for a, b in zip(grads[0][2:], grads[1][2:]))  # dV: the same sums either way


def test_the_default_backward_is_the_same_bits_on_every_run(folder):
    module, generator = triton_module("attention", folder), torch.Generator().manual_seed(2)
    inputs = _attention_inputs(generator)
    out = module.forward(*inputs.values(), causal=True)
    cotangent = torch.randn(out.shape, generator=generator)
    first = torch.autograd.grad(out, list(inputs.values()), cotangent)
    again = torch.autograd.grad(module.forward(*inputs.values(), causal=True), list(inputs.values()), cotangent)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_grouped_query_heads_with_masks_in_both_modes(folder, monkeypatch):
    mha, generator = triton_module("mha", folder), torch.Generator().manual_seed(3)
    inputs = _inputs(4, 2, False, generator)
    hidden = torch.rand((2, N, M), generator=generator) < 0.2
    hidden[..., 0] = False  # a key for every row
    additive = torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, -math.inf).unsqueeze(1)
    seen = _spied(mha, monkeypatch)

    def forward(x, deterministic):
        options = {"num_heads": 4, "num_kv_heads": 2, "causal": True, "deterministic": deterministic}
        return mha.forward(*x.values(), attn_mask=hidden, **options)

    _both_modes(forward, lambda x: _eager(x, 4, 2, additive, True), inputs, generator)
    assert seen == [False, True]


def test_the_transformer_block_in_both_modes_matches_the_torch_module(folder):
    from symattn.generated import transformer_block_torch as theirs

    ours, generator = triton_module("transformer_block", folder), torch.Generator().manual_seed(4)
    shapes = {"X": (2, N, 16), **{f"W_{p}": (16, 16) for p in "QKVO"}, "W_1": (16, 24), "W_2": (24, 16)}
    shapes |= {name: (1, 16) for name in ("gamma_1", "beta_1", "gamma_2", "beta_2")}
    inputs = {k: (torch.randn(s, generator=generator) / 2).requires_grad_() for k, s in shapes.items()}
    order = [*inputs][:5] + ["gamma_1", "beta_1", "gamma_2", "beta_2", "W_1", "W_2"]
    inputs = {k: inputs[k] for k in order}
    _both_modes(
        lambda x, deterministic: ours.forward(*x.values(), num_heads=2, causal=True, deterministic=deterministic),
        lambda x: theirs.forward(*x.values(), num_heads=2, causal=True),
        inputs,
        generator,
    )


def test_a_positional_spec_in_both_modes(folder):
    module, generator = triton_module(positional_spec("relative"), folder), torch.Generator().manual_seed(5)
    inputs = {k: torch.randn(2, r, 8, generator=generator).requires_grad_() for k, r in (("Q", N), ("K", M), ("V", M))}
    _both_modes(
        lambda x, deterministic: module.forward(*x.values(), causal=True, deterministic=deterministic),
        lambda x: positional_reference("relative", *x.values(), causal=True),
        inputs,
        generator,
    )


@pytest.mark.parametrize("name, atomic", [("softcap", True), ("pointer", True), ("temperature", False)])
def test_a_gallery_variant_in_both_modes_a_trainable_scalar_on_the_deterministic_path(
    name, atomic, folder, monkeypatch
):
    """softcap (a core with V), pointer (a map: O = log-softmax, no V): the atomic launch; temperature (a trainable
    scalar τ, summed per query block by the query part): deterministic=False as True."""
    spec, generator = gallery(name), torch.Generator().manual_seed(6)
    module, inputs = triton_module(spec, folder), random_inputs(spec, generator)
    seen = _spied(module, monkeypatch)
    _both_modes(
        lambda x, deterministic: module.forward(*x.values(), causal=True, deterministic=deterministic),
        lambda x: REFERENCES[name](x, True),
        inputs,
        generator,
    )
    assert seen == ([False, True] if atomic else [False])  # (one plan: the same launch for both)


def test_an_n_by_m_gradient_or_a_learned_table_keeps_the_deterministic_path(folder, monkeypatch):
    """A float attn_mask that requires grad (written by the query part) and a learned table read at positions (its
    histograms by the query part): deterministic=False launches as True, the same bits."""
    module, generator = triton_module("attention", folder), torch.Generator().manual_seed(7)
    inputs = _attention_inputs(generator) | {"attn_mask": torch.randn(N, M, generator=generator).requires_grad_()}
    tables = triton_module(table_spec("relative"), folder)
    learned = {k: torch.randn(2, r, 8, generator=generator).requires_grad_() for k, r in (("Q", N), ("K", N), ("V", N))}
    learned["b"] = torch.randn(N, 1, generator=generator).requires_grad_()
    for run, x in (
        (lambda x, **o: module.forward(*[*x.values()][:3], attn_mask=x["attn_mask"], **o), inputs),
        (lambda x, **o: tables.forward(*x.values(), **o), learned),
    ):
        seen = _spied(module, monkeypatch) if x is inputs else _spied(tables, monkeypatch)
        grads = []
        for deterministic in MODES:
            out = run(x, causal=True, deterministic=deterministic)
            grads.append(torch.autograd.grad(out, list(x.values()), torch.ones_like(out)))
        assert seen == [False]  # (one plan: the same launch for both)
        assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_the_module_attribute_sets_the_mode_and_a_bad_value_is_refused(folder, monkeypatch):
    module, generator = triton_module("attention", folder), torch.Generator().manual_seed(8)
    inputs = _attention_inputs(generator)
    layer = module.Attention()
    layer.deterministic = False
    seen = _spied(module, monkeypatch)
    out = layer(*inputs.values(), causal=True)
    want = _sdpa(True)({k: x.detach().double().requires_grad_() for k, x in inputs.items()})
    compare(out, want.detach(), "the module's forward")
    torch.autograd.grad(out.sum(), list(inputs.values()))
    assert seen == [True]
    with pytest.raises(ValueError, match="deterministic must be True or False, got 'no'"):
        module.forward(*inputs.values(), deterministic="no")


@pytest.mark.parametrize("spec", ["attention", "mha"])
def test_the_backward_parts_launched_apart_with_non_square_blocks(spec, folder, monkeypatch):
    """The key part at 16 × 32 and the query part at 32 × 16 (two launches; the atomic one at the key part's): both
    modes against autograd, so a block-shape bug in either part cannot hide behind the interpreter's 16 × 16."""
    module, generator = triton_module(spec, folder), torch.Generator().manual_seed(9)
    blocks = {"forward": (16, 16), "jvp": (16, 16), "backward_keys": (16, 32), "backward_queries": (32, 16)}
    monkeypatch.setattr(module, "_launch", lambda x, width, kernel: dict(zip(("BLOCK_M", "BLOCK_N"), blocks[kernel])))
    seen = _spied(module, monkeypatch)
    launches = []
    parts = module._backward_parts
    monkeypatch.setattr(module, "_backward_parts", lambda *a: launches.append(parts(*a)) or launches[-1])
    if spec == "attention":
        inputs = _attention_inputs(generator)
        forward = lambda x, deterministic: module.forward(*x.values(), causal=True, deterministic=deterministic)  # noqa: E731
        reference = _sdpa(True)
    else:
        inputs = _inputs(4, 2, True, generator)
        options = {"num_heads": 4, "num_kv_heads": 2, "causal": True}
        forward = lambda x, deterministic: module.forward(*x.values(), **options, deterministic=deterministic)  # noqa: E731
        reference = lambda x: _eager(x, 4, 2, 0.0, True)  # noqa: E731
    _both_modes(forward, reference, inputs, generator, rtol=5e-4 if spec == "mha" else 1e-4)
    assert seen == [False, True]
    shapes = [[(c["KEYS"], c["QUERIES"], c["BLOCK_M"], c["BLOCK_N"]) for _, c in made] for made in launches]
    assert shapes == [[(True, False, 16, 32), (False, True, 32, 16)], [(True, False, 16, 32)]]
