"""The fenced code blocks of a Markdown page (the README, a guide), for the tests that run or compare them."""

from __future__ import annotations


def fenced_blocks(text: str, language: str) -> list[str]:
    """text's fenced code blocks in a language ("" for a block without one), in order."""
    found, current, opened = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if opened is None:
                opened, current = line[3:].strip(), []
            else:
                found += ["\n".join(current) + "\n"] if opened == language else []
                opened = None
        elif opened is not None:
            current.append(line)
    return found
