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


def test_the_wheel_lists_every_package_of_symattn():
    """pyproject.toml's packages name every folder of symattn/ with an __init__.py (a folder left out is missing
    from the wheel: its imports fail only once installed)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "symattn").rglob("__init__.py")}
    assert found - {"symattn.generated", "symattn.templates"} <= listed, sorted(found - listed)
