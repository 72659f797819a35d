"""Verification marks: each printed line of a derivation paired with the checks of its equality.

``Document.lines(chain)`` prints one row per definition and one per equality
sides[k] = sides[k + 1] of each equation; ``verify_chain`` checks the k-th equality of
the i-th equation as ``Check(step=i, equality=k)``, df itself against a central
difference (step 0, equality −1: the first row) and the printed gradient, named and
closed, against the engine's (one result line per target). A row passes when all its checks do.
"""

from __future__ import annotations

from collections.abc import Sequence

from symattn.derive.step_check import Check
from symattn.derive.steps import Chain, Definition

PASS = "✓"


def row_checks(c: Chain, checks: Sequence[Check]) -> list[list[Check]]:
    """The checks of every printed row of ``c``, in print order, then those of each target's result line.

    A definition's row has none (it names a value; the equalities that use the name check it).
    """
    mine = [k for k in checks if k.target == c.label]
    by_place: dict[tuple[int, int], list[Check]] = {}
    for k in mine:
        by_place.setdefault((k.step, max(k.equality, 0)), []).append(k)
    rows: list[list[Check]] = []
    step = 0
    for item in c.items:
        if isinstance(item, Definition):
            rows.append([])
            continue
        rows += [by_place.pop((step, k), []) for k in range(len(item.sides) - 1)]
        step += 1
    rows += [by_place.pop((step + k, 0), []) for k in range(len(c.targets))]  # each gradient, named and closed
    return rows


def mark(checks: Sequence[Check]) -> str:
    """✓ when every check of a line passed, else ✗ with the worst relative discrepancy and its tolerance."""
    if not checks:
        return ""
    if all(k.ok for k in checks):
        return PASS
    worst = max((k for k in checks if not k.ok), key=lambda k: (k.discrepancy != k.discrepancy, k.discrepancy))
    return f"✗ {worst.discrepancy:.1e} > {worst.tolerance:.0e}"


def chain_marks(chains: Sequence[Chain], checks: Sequence[Check]) -> dict[str, list[str]]:
    """Chain label → the mark of each printed row, then of each target's result line."""
    return {c.label: [mark(row) for row in row_checks(c, checks)] for c in chains}


__all__ = ["PASS", "chain_marks", "mark", "row_checks"]
