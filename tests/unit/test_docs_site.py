"""The documentation site's navigation and pages agree: every page mkdocs.yml names exists, every page is named.

`mkdocs build --strict` (CI, after the tests) checks links, anchors and references; this is the part that needs
no MkDocs installed. The nav is read with a line pattern, not a YAML parser (PyYAML is no test dependency).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NAV_PAGE = re.compile(r"^\s+- (?:[^:\n]+: )?(\S+\.md)\s*$")


def nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:\n") :]
    return [found[1] for line in nav.splitlines() if (found := NAV_PAGE.match(line))]


def test_every_page_in_the_nav_exists():
    pages = nav_pages()
    assert "index.md" in pages and len(pages) > 20, pages
    assert [page for page in pages if not (DOCS / page).is_file()] == []


def test_every_page_in_docs_is_in_the_nav():
    pages = set(nav_pages())
    written = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert sorted(written - pages) == []


def test_the_included_files_exist():
    """pymdownx.snippets includes (--8<-- "path") name files relative to the repository root."""
    included = [
        found[1]
        for path in DOCS.rglob("*.md")
        for found in re.finditer(r'^--8<-- "([^"]+)"$', path.read_text(encoding="utf-8"), re.M)
    ]
    assert "CHANGELOG.md" in included
    assert [name for name in included if not (ROOT / name).is_file()] == []
