"""Every example script runs as its docstring says, from the repository root, and exits 0.

One subprocess per file in examples/ and examples/from_torch/ (examples/specs/ holds spec files, which the
gallery's tests read): `python examples/NAME.py` as its docstring gives it, or for a spec file the
`symattn derive --spec-file …` command its docstring gives. train_reverse.py and amp_training.py train for
longer and tests/integration/test_example.py runs them and asserts on their losses: they are not run twice.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parents[2]
RUN_ELSEWHERE = {  # run by the tests named, with the options their docstrings give
    "train_reverse.py": "tests/integration/test_example.py",
    "amp_training.py": "tests/integration/test_example.py",
    "long_context_training.py": "tests/integration/test_context_parallel.py",
}
SCRIPTS = sorted(
    path.relative_to(ROOT).as_posix()
    for path in [*ROOT.glob("examples/*.py"), *ROOT.glob("examples/from_torch/*.py")]
    if path.name not in RUN_ELSEWHERE
)
OPTIONAL = ("jax", "torch", "triton")  # extras an example may import


def command(script: str, source: str) -> list[str]:
    """The command the script's docstring gives: `python SCRIPT`, else `symattn derive --spec-file SCRIPT …`."""
    if f"python {script}" in source:
        return [sys.executable, script]
    derive = re.search(rf"^\s*symattn (derive --spec-file {re.escape(script)}\b[^#\n]*)", source, re.M)
    assert derive, f"{script}'s docstring gives no command that runs it (`python {script}`)"
    return [sys.executable, "-m", "symattn", *shlex.split(derive[1])]


def test_every_example_is_collected():
    assert len(SCRIPTS) >= 9, SCRIPTS
    for name, test in RUN_ELSEWHERE.items():  # each example left out here exists and its test runs it
        assert (ROOT / "examples" / name).is_file() and name in (ROOT / test).read_text(encoding="utf-8"), name


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_example_runs_as_written(script):
    source = (ROOT / script).read_text(encoding="utf-8")
    for extra in OPTIONAL:
        if re.search(rf"^(import|from) {extra}\b", source, re.M) and importlib.util.find_spec(extra) is None:
            pytest.skip(f"{script} needs {extra} (pip install -e '.[{extra}]')")
    run = subprocess.run(command(script, source), cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert run.returncode == 0, f"{script} exited {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
