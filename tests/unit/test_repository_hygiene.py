"""The repository's own housekeeping: .gitignore names no tracked file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_gitignore_lists_no_tracked_file():
    done = subprocess.run(
        ["git", "ls-files", "-i", "-c", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout == "", f"tracked yet ignored: {done.stdout.split()}"
