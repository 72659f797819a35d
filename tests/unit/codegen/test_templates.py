"""The templates keep only what varies per spec: code that no per-spec Jinja tag touches lives in a runtime module
(linted and unit-tested as Python) and is copied into the generated module from its source."""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parents[3] / "templates"
LONGEST_PLAIN_RUN = 60  # lines in a row without {{ or {%


def plain_run(text: str) -> tuple[int, int]:
    """(the length, the first line number) of text's longest run of consecutive lines holding no per-spec tag ({{ or
    {%); a Jinja comment ({# #}) is no tag: it renders nothing."""
    longest, start, run = 0, 0, 0
    for number, line in enumerate(text.splitlines(), 1):
        run = 0 if "{{" in line or "{%" in line else run + 1
        if run > longest:
            longest, start = run, number - run + 1
    return longest, start


def test_a_plain_run_is_counted_between_tags():
    text = "{% if a %}\nx = 1\ny = 2\n{{ b }}\n{# a comment #}\nz = 3\n"
    assert plain_run(text) == (2, 2)  # x, y (the comment and z after it: also 2, later)
    assert plain_run("a\nb\nc\n") == (3, 1)
    assert plain_run("{{ a }}\n{% b %}\n") == (0, 0)


def test_every_template_is_checked():
    assert len(list(TEMPLATES.glob("*.j2"))) >= 10
    assert {"triton_module.py.j2", "torch_module.py.j2", "_triton_core.j2"} <= {p.name for p in TEMPLATES.glob("*.j2")}


@pytest.mark.parametrize("template", sorted(TEMPLATES.glob("*.j2")), ids=lambda p: p.name)
def test_no_template_holds_a_long_run_of_plain_code(template: Path):
    length, start = plain_run(template.read_text(encoding="utf-8"))
    assert length <= LONGEST_PLAIN_RUN, (
        f"{template.name}: {length} lines from line {start} without a Jinja tag: move them to a runtime module"
    )
