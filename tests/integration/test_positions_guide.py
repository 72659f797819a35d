"""docs/positions.md runs as written: its Python blocks in order, every spec they make derives and verifies, its
derivation excerpts are what `sa.derive(…).text()` prints, and the backends it says compute each variant do (the
others refuse it in one line)."""

from __future__ import annotations

from pathlib import Path

import pytest

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError

pytest.importorskip("torch")  # the "From PyTorch" block traces a torch function

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "positions.md"
GALLERY = {"relative", "alibi_heads", "relative_table", "sliding_window", "documents", "learned_slope", "soft_capped"}
READS_A_TABLE = {"relative_table", "documents"}  # standard variant only (the guide's "Not yet")


def blocks(language: str) -> list[str]:
    """The guide's fenced code blocks in a language, in order."""
    found, current, opened = [], [], None
    for line in GUIDE.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            if opened is None:
                opened, current = line[3:].strip(), []
            else:
                found += ["\n".join(current) + "\n"] if opened == language else []
                opened = None
        elif opened is not None:
            current.append(line)
    return found


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
def test_the_triton_and_memory_efficient_backends_are_as_the_guide_says(specs, name, backend, variant):
    if name not in READS_A_TABLE:
        assert "def forward" in codegen.render(specs[name], backend, variant=variant, second_order=False)
        return
    with pytest.raises(SymattnError, match=r"read|reads") as refused:
        codegen.render(specs[name], backend, variant=variant, second_order=False)
    assert "\n" not in str(refused.value)
