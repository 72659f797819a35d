"""What ``symattn generate`` says of the products whose order it fixed at typical sizes (``optimize.orders``)."""

from __future__ import annotations

import sympy as sp
from sympy import Basic

from symattn.derive.latex import text
from symattn.optimize.cost import TYPICAL_OTHER, TYPICAL_SIZES


def _dimensions(chain: tuple[Basic, ...]) -> list[str]:
    return sorted({str(s) for m in chain for size in m.shape for s in sp.sympify(size).free_symbols})


def size_notes(chains: list[tuple[Basic, ...]], stated: dict[str, int], most: int = 4) -> list[str]:
    """One line per product whose order a pass fixed at the typical sizes (``recording``) although its cheapest
    order depends on them, unless the user stated every one of its dimensions: the sizes it was priced at, and
    how to state the model's own (``symattn generate --size``)."""
    table = {**TYPICAL_SIZES, **stated}
    dims_of = {c: _dimensions(c) for c in chains}
    chains = [c for c in chains if not set(dims_of[c]) <= set(stated)]
    lines = []
    for mats in chains[:most]:
        at = ", ".join(f"{d}={table.get(d, TYPICAL_OTHER)}" for d in dims_of[mats])
        product = " ".join(text(m) for m in mats)
        lines.append(f"symattn generate: note: {product} is ordered for {at}; its cheapest order depends on these")
    if chains:
        more = f" ({len(chains) - most} more products alike)" if len(chains) > most else ""
        lines.append(f"symattn generate: note: state your model's sizes with --size DIM=SIZE{more}")
    return lines
