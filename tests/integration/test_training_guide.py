"""docs/training.md runs as written: its Python blocks in order, in one namespace, as a reader runs them (the
drop-in's output equal to torch's under the same seed, the encoder layer's backward, a spec that drops out derived,
a traced module's drop-in equal to the original under the same seed, gradcheck with the seed reset)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fenced import fenced_blocks

torch = pytest.importorskip("torch")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_the_guides_blocks_run_in_order():
    namespace: dict = {"__name__": "training_guide"}
    blocks = fenced_blocks(GUIDE.read_text(encoding="utf-8"), "python")
    assert len(blocks) == 4
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    assert namespace["layer"].linear1.weight.grad is not None
    assert namespace["dropped"].name == "dropped_attention"
