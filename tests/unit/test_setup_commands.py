"""The README's two set-up commands are CI's (.ci/run reads them from the README), and they install every optional
dependency a test skips without: a fresh machine that runs them runs the whole suite."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = runpy.run_path(str(ROOT / ".ci" / "readme_commands.py"))
# the distribution that provides an import name, where the two differ
DISTRIBUTION = {"jax.numpy": "jax"}


def _readme_commands() -> list[str]:
    return COMMANDS["commands"]((ROOT / "README.md").read_text(encoding="utf-8"))


def test_the_readme_gives_a_setup_and_a_test_command_and_ci_runs_them():
    setup, tests = _readme_commands()
    assert "pip install torch==2.13.0" in setup and setup.endswith("&& symattn generate"), setup
    assert tests.startswith("python -m pytest"), tests
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "readme_commands.py setup" in run and "readme_commands.py test" in run
    assert "pytest" not in run.split("readme_commands.py test", 1)[0].split("pip install -q --upgrade pip", 1)[1]


def test_a_comment_is_dropped_but_a_hash_inside_an_argument_is_kept():
    readme = "## Set up\n\n```sh\npip install 'a#b'   # install\npython -m pytest -q  # tests\n```\n"
    assert COMMANDS["commands"](readme) == ["pip install 'a#b'", "python -m pytest -q"]


def _extras_installed() -> set[str]:
    setup = _readme_commands()[0]
    extras = re.search(r'-e "\.\[([^\]]*)\]"', setup)
    assert extras, setup
    table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(table["dependencies"])
    for extra in extras[1].split(","):
        requirements += table["optional-dependencies"][extra.strip()]
    return {re.match(r"[A-Za-z0-9_.\-]+", r)[0].lower() for r in requirements}


def test_the_setup_installs_every_optional_dependency_a_test_skips_without():
    skipped_without = set()
    for path in (ROOT / "tests").rglob("*.py"):
        skipped_without |= set(re.findall(r'importorskip\("([a-z_.]+)"', path.read_text(encoding="utf-8")))
    third_party = {n for n in skipped_without if not n.startswith("symattn") and n not in sys.stdlib_module_names}
    missing = {DISTRIBUTION.get(n, n) for n in third_party} - _extras_installed()
    assert not missing, f"tests skip without {sorted(missing)}, which the README's set-up does not install"
