"""docs/positions.md runs as written: its Python blocks in order, every spec they make derives and verifies, its
derivation excerpts are what `sa.derive(…).text()` prints, each gallery spec's generated torch module, standard and
memory-efficient, matches torch autograd of an independent forward (the bias built with torch.arange and torch.tanh,
float64, n = 70 > the window of 64), and the Triton and memory-efficient backends compute each variant, as it says."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
from fenced import fenced_blocks

import symattn as sa
from symattn.codegen import generate as codegen

torch = pytest.importorskip("torch")  # the "From PyTorch" block traces a torch function

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "positions.md"
GALLERY = {"relative", "alibi_heads", "relative_table", "sliding_window", "documents", "learned_slope", "soft_capped"}


def blocks(language: str) -> list[str]:
    """The guide's fenced code blocks in a language, in order."""
    return fenced_blocks(GUIDE.read_text(encoding="utf-8"), language)


@pytest.fixture(scope="module")
def specs() -> dict[str, sa.Spec]:
    """Every spec the guide's Python blocks make, by name (the blocks run in one namespace, as a reader runs them)."""
    namespace: dict = {"__name__": "positions_guide"}
    for block in blocks("python"):
        exec(compile(block, str(GUIDE), "exec"), namespace)
    made = [value for value in namespace.values() if isinstance(value, sa.Spec)]
    return {spec.name: spec for spec in made}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_guide_makes_the_gallery_and_the_traced_spec(specs):
    assert set(specs) == GALLERY | {"alibi_causal"}


@pytest.mark.parametrize("name", sorted(GALLERY | {"alibi_causal"}))
def test_every_spec_of_the_guide_derives_and_verifies(specs, name):
    assert sa.derive(specs[name]).verify().ok


@pytest.mark.parametrize(("name", "heading"), [("relative_table", "∂f/∂b"), ("alibi_causal", "Forward pass:")])
def test_the_excerpts_are_what_derive_prints(specs, name, heading):
    excerpt = next(block for block in blocks("text") if block.startswith(heading))
    printed = _flat(sa.derive(specs[name]).text())
    assert _flat(excerpt) in printed


def test_the_traced_spec_reads_positions_and_takes_no_constant(specs):
    traced = specs["alibi_causal"]
    assert [str(x) for x in traced.inputs] == ["q", "k", "v"] and not traced.constants


@pytest.mark.parametrize("name", sorted(GALLERY))
@pytest.mark.parametrize(("backend", "variant"), [("triton", "standard"), ("torch", "memeff")])
def test_the_triton_and_memory_efficient_backends_compute_every_variant(specs, name, backend, variant):
    # (a table read at positions too: the Triton kernels gather it, test_triton_tables.py runs them)
    assert "def forward" in codegen.render(specs[name], backend, variant=variant, second_order=False)


N, WIDTH, HEADS = 70, 3, 8


def _hidden(visible):
    return torch.where(visible, 0.0, -math.inf).double()


BIAS = {  # name → the positional term of an independent forward, of the grids i, j and the extra inputs
    "relative": lambda i, j, extra: -(i - j).abs() / 2,
    "relative_table": lambda i, j, extra: extra[0][(i - j).abs().long(), 0],
    "sliding_window": lambda i, j, extra: _hidden((j <= i) & (i - j < 64)),
    "documents": lambda i, j, extra: _hidden(extra[0][..., :, 0, None] == extra[0][..., None, :, 0]),
    "learned_slope": lambda i, j, extra: -extra[0] * (i - j).abs(),
    "soft_capped": lambda i, j, extra: 8 * torch.tanh(-(i - j).abs() / 8),
    "alibi_heads": lambda i, j, extra: (
        -torch.tensor([2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)]).double()[:, None, None] * (i - j).abs()
    ),
}


def _reference(name, q, k, v, *extra):
    i, j = torch.arange(N, dtype=torch.float64)[:, None], torch.arange(N, dtype=torch.float64)[None, :]
    if name != "alibi_heads":
        return torch.softmax(q @ k.mT / math.sqrt(WIDTH) + BIAS[name](i, j, extra), dim=-1) @ v
    q, k, v = (x.view(2, N, HEADS, WIDTH).transpose(1, 2) for x in (q, k, v))
    out = torch.softmax(q @ k.mT / math.sqrt(WIDTH) + BIAS[name](i, j, extra), dim=-1) @ v
    return out.transpose(1, 2).reshape(2, N, HEADS * WIDTH)


def _inputs(name):
    """Q, K, V (a batch of 2), then the spec's extra input (τ, the table b) or its constant (document ids)."""
    g = torch.Generator().manual_seed(3)
    width = HEADS * WIDTH if name == "alibi_heads" else WIDTH
    tensors = [torch.randn(2, N, width, generator=g, dtype=torch.float64) for _ in range(3)]
    extra = {
        "relative_table": [torch.randn(N, 1, generator=g, dtype=torch.float64)],
        "learned_slope": [torch.tensor(0.3, dtype=torch.float64)],
        "documents": [torch.randint(0, 4, (2, N, 1), generator=g).sort(dim=1).values.double()],
    }
    return tensors, extra.get(name, [])


def _module(spec: sa.Spec, variant: str) -> types.ModuleType:
    module = types.ModuleType(f"{spec.name}_{variant}")
    exec(compile(codegen.render(spec, "torch", variant, second_order=False), module.__name__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("variant", ["standard", "memeff"])
@pytest.mark.parametrize("name", sorted(GALLERY))
def test_the_generated_torch_module_matches_autograd(specs, name, variant):
    # the memory-efficient module in blocks of 32 rows (70 = 2·32 + 6): each reads its positions, a table's too
    tensors, extra = _inputs(name)
    learned = tensors + ([] if name == "documents" else extra)
    constants = extra if name == "documents" else []
    want_leaves = [x.clone().requires_grad_() for x in learned]
    want = _reference(name, *want_leaves[:3], *(want_leaves[3:] or constants))
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in learned]
    options = {"block_size": 32} if variant == "memeff" else {}
    got = _module(specs[name], variant).forward(*leaves, *constants, **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    wanted = torch.autograd.grad(want, want_leaves, cotangent)
    for index, (g, w) in enumerate(zip(torch.autograd.grad(got, leaves, cotangent), wanted)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"{name}: gradient {index}")
