"""The README's set-up commands, as the README prints them: the first ``sh`` block under "## Set up", one command a
line, each line's trailing comment dropped.

.ci/run runs these, so that what CI installs and tests is what a new user's two commands install and test (the
README cannot drift from CI). ``--check`` fails unless the block holds exactly two commands: the set-up (install,
then the main job) and the test suite.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SECTION = "## Set up"
BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)
COMMENT = re.compile(r"\s+#.*$")  # a comment after the command (a '#' inside a quoted argument has no space before)


def commands(readme: str) -> list[str]:
    """The commands of the first sh block after the section heading, without their comments."""
    if SECTION not in readme:
        raise SystemExit(f"README.md has no {SECTION!r} section")
    found = BLOCK.search(readme.split(SECTION, 1)[1])
    if found is None:
        raise SystemExit(f"README.md's {SECTION!r} section has no ```sh block")
    return [COMMENT.sub("", line).strip() for line in found[1].splitlines() if line.strip()]


if __name__ == "__main__":
    lines = commands((Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8"))
    if len(lines) != 2:
        raise SystemExit(f"README.md's set-up block has {len(lines)} commands; expected 2 (set-up, tests)")
    index = {"setup": 0, "test": 1}[sys.argv[1]] if len(sys.argv) > 1 else None
    print("\n".join(lines) if index is None else lines[index])
