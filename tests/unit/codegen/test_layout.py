"""Generated code is laid out as ruff format lays it out: ruff itself is the oracle.

The generated modules are committed ruff-format clean without running ruff (``codegen.layout``);
these tests format the same text with ruff and compare.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import sympy as sp

from symattn.codegen.emit import layout

ROOT = Path(__file__).resolve().parents[3]
RUFF = shutil.which("ruff")
needs_ruff = pytest.mark.skipif(RUFF is None, reason="ruff is not installed (pip install ruff)")


def formatted(source: str) -> str:
    """source as ruff format writes it (the project's line length)."""
    done = subprocess.run(
        [RUFF, "format", "--line-length", str(layout.WIDTH), "-"], input=source, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def in_function(statement: str) -> str:
    return "def f():\n    " + statement + "\n"


def term(k: int, width: int) -> str:
    """A call of about width characters (a term of a sum)."""
    return f"fn{k}(" + ", ".join(f"x{k}_{i}" for i in range(max(1, width // 7))) + ")"


SUMS = [
    " + ".join(term(k, 30) for k in range(3)),  # fits
    f"{term(0, 40)} + {term(1, 40)} + {'x' * 38}",  # 110 characters: in brackets, on one line
    " + ".join(term(k, 60) for k in range(4)),  # one term a line
    f"({term(0, 20)}) * ({' + '.join(term(k, 40) for k in range(3))}) + G_out",  # the last bracket that overflows
    f"t23 * dF + (a * b) * ({' + '.join(term(k, 40) for k in range(3))})",  # ends in a bracket
    f"sum_batch({' + '.join(term(k, 50) for k in range(3))})",  # a call: its argument broken
    f"sum_batch({' + '.join(term(k, 35) for k in range(3))})",  # a call: its argument on one line
    f"vecdot({' + '.join(term(k, 40) for k in range(3))}, t3)[..., None]",  # a call, then a subscript (ruff: the call)
]


def test_the_sums_reach_each_layout() -> None:
    laid_out = [layout.assigned("target", value, 4) for value in SUMS]
    assert laid_out[0] == SUMS[0]
    assert laid_out[1] == f"(\n        {SUMS[1]}\n    )"  # too long after "target = ", not on a line of its own
    assert laid_out[2].count("\n") == 5  # ( four terms )
    assert laid_out[3].endswith(") + G_out") and laid_out[3].startswith(f"({term(0, 20)}) * (\n")
    assert laid_out[4].startswith("t23 * dF + (a * b) * (\n")
    assert laid_out[5].count("\n") == 4 and laid_out[6].count("\n") == 2
    assert laid_out[7].startswith("vecdot(\n") and laid_out[7].endswith("\n    )[..., None]")


@needs_ruff
@pytest.mark.parametrize("value", SUMS)
def test_assigned_statements_are_ruffs(value: str) -> None:
    statement = f"target = {layout.assigned('target', value, 4)}"
    assert in_function(statement) == formatted(in_function(statement))


@needs_ruff
@pytest.mark.parametrize("count", [3, 14, 22, 40])
def test_tuples_unpackings_and_flags_are_ruffs(count: int) -> None:
    names = [f"W_{i}" for i in range(count)]
    inputs = tuple(sp.MatrixSymbol(name, 2, 2) for name in names)
    for text in (
        layout.checked_inputs(inputs, "_arrays"),
        layout.assign_tuple("gradients", [f'grads["{name}"]' for name in names], 4),
    ):
        assert in_function(text) == formatted(in_function(text))
    text = layout.deleted(names, 4)
    assert in_function(text) == formatted(in_function(text))
    flags = "def f():\n    if x:\n        " + layout.given_flags(names, 8) + "\n"
    assert flags == formatted(flags)


@needs_ruff
def test_committed_generated_modules_are_ruff_format_clean() -> None:
    done = subprocess.run([RUFF, "format", "--check", str(ROOT / "generated")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
