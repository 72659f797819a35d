"""The README's examples run as written: its commands (through the CLI's entry point) and its Python blocks."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from fenced import fenced_blocks

from symattn.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in a language ("" for a block without one), in order."""
    return fenced_blocks(README, language)


def test_the_derivation_excerpt_is_what_derive_prints(capsys):
    """`symattn derive self_attention --wrt W_V --verify`: every line of the README's excerpt is in its output."""
    command = next(line for block in blocks("sh") for line in block.splitlines() if "symattn derive" in line)
    assert main(shlex.split(command)[1:]) == 0
    printed = capsys.readouterr().out
    excerpt = next(block for block in blocks("") if "✓" in block)
    for line in excerpt.strip().splitlines():
        assert " ".join(line.split()) in " ".join(printed.split()), line


def test_the_generated_module_trains_as_the_readme_shows(tmp_path, monkeypatch):
    """`symattn generate --spec-file … --out mine/`, then the README's Python block, in a fresh folder."""
    pytest.importorskip("torch")
    command = next(line for block in blocks("sh") for line in block.splitlines() if "--spec-file" in line)
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in shlex.split(command.split("#")[0])[1:]]
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    code = next(block for block in blocks("python") if "loss.backward()" in block)
    namespace: dict = {}
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    exec(compile(code, "README.md", "exec"), namespace)
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in (namespace["W_Q"], namespace["W_K"]))


def test_the_pytorch_module_drops_in_as_the_readme_shows(capsys):
    pytest.importorskip("torch")
    code = next(block for block in blocks("python") if "drop_in(model, x)" in block)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert model.q.weight.grad is not None and "q_weight" in capsys.readouterr().out
