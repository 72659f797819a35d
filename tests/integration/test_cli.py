"""The command line's own behaviour: `list`, and bad input as exit 2 with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import symattn as sa
from symattn.cli import main


def test_list_names_every_spec_once_per_line(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sa.specs()


@pytest.mark.parametrize(
    "argv",
    [[], ["bogus"], ["derive", "nope"], ["derive", "attention", "--wrt", "Z"], ["generate", "--backend", "tensorflow"]],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "Traceback" not in captured.err


@pytest.mark.slow  # subprocesses
def test_python_dash_m_runs_the_same_command_line():
    done = subprocess.run([sys.executable, "-m", "symattn", "list"], capture_output=True, text=True, check=False)
    assert done.returncode == 0
    assert done.stdout.split()[0] == "attention"
    bad = subprocess.run([sys.executable, "-m", "symattn", "bogus"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_version_names_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"symattn {sa.__version__}"


def test_generate_says_when_everything_is_up_to_date(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["generate", "--spec", "attention", "--backend", "numpy", "--out", out]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    assert main(["generate", "--spec", "attention", "--backend", "numpy", "--out", out]) == 0
    assert capsys.readouterr().out.startswith("up to date: nothing to write")
    assert main(["generate", "--spec", "attention", "--backend", "numpy", "--out", out, "--check"]) == 0
    assert capsys.readouterr().out.startswith("up to date: every generated module")
