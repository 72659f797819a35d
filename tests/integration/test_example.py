"""The end-to-end example: one self-attention layer learns to reverse sequences with the generated NumPy backend."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains a model

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_reverse.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_reverse", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sgd_on_the_generated_backend_drives_the_loss_below_the_threshold():
    example = load_example()
    losses = example.train(steps=120, batch_size=16)
    assert losses[0] > 1.0  # about log(vocab) at the start
    assert losses[-1] < example.THRESHOLD


def test_the_amp_example_trains_under_autocast():
    """examples/amp_training.py: torch's AMP recipe with the drop-in MultiheadAttention (bfloat16 on the CPU)."""
    pytest.importorskip("torch")
    path = EXAMPLE.parent / "amp_training.py"
    spec = importlib.util.spec_from_file_location("amp_training", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.train(steps=30)
    assert losses[-1] < 0.7 * losses[0], losses
