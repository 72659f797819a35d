"""The oldest versions pyproject.toml allows of the runtime dependencies, pinned: `name==version` per line.

.ci/run installs these (and no torch or jax) to run the tests that need neither, so that a floor
that no longer works fails CI instead of a user's install.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*$")


def floors(pyproject: Path) -> list[str]:
    """name==version for each runtime dependency, which must be written name>=version."""
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        found = FLOOR.match(requirement)
        if found is None:
            raise SystemExit(f"{pyproject}: dependency {requirement!r} has no >= floor to pin")
        pins.append(f"{found[1]}=={found[2]}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
