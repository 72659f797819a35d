"""The body of a core's eager torch function (``_core_eager`` in the Triton module): O recomputed by torch ops in at
least float32, the n × m arrays in memory, differentiable. The kernels' Function differentiates it where a second
derivative is asked for (its backward under create_graph: double backward, reverse over reverse), as autograd's
double backward reads the eager math. A = E(S) prints from the same function records as the kernels' (TORCH).

Dropout of the weights multiplies P by the kernels' own mask, made whole from the saved seed (``_dropout_keep``).

A causal key j > i is hidden before the normaliser: −∞ before a (log-)softmax, 0 before a row sum or none. A row
whose every key is hidden gives O = 0 (−∞ for a log-softmax map), as the kernels do, with finite gradients.

A block of a longer sequence (context parallelism's ring) passes ``origin``, the positions of its first row and
first key, and ``part="share"`` for its share of the rows' output with the row statistic its merge reads
(``symattn.distributed.merge``): softmax(A) V and the row log-sum-exp L (−∞ for a row with no key); A V and the
row sums; A V alone (no normaliser). A log-softmax map has no such share (its output is n × m). ``part="logits"``
gives A itself (the causal mask applied): the ring's backward pulls the scores' cotangent back through it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEEN = 'seen = a.amax(-1, keepdim=True) > -float("inf")  # a row with a key to see'
SOFTMAX = "p = torch.softmax(torch.where(seen, a, 0.0), -1) * seen"


@dataclass(frozen=True)
class Normaliser:
    """How the eager core writes a normaliser: what a hidden key is filled with; the lines making p (or the map's O)
    from a, those both forms share, then the whole rows' (``rows``) or a block of keys' with its row statistic
    ``stat`` (``part="share"``; None: a map, which has no block's share)."""

    fill: str
    shared: tuple[str, ...]
    rows: tuple[str, ...] = ()
    partial: tuple[str, ...] | None = ()


NORMALISERS = {
    "row softmax": Normaliser(  # a block: its softmax and its row log-sum-exp (−∞: no key), from one exp
        '-float("inf")',
        (),
        (SEEN, SOFTMAX),
        (
            "top = a.amax(-1, keepdim=True)",
            'seen = top > -float("inf")  # a row with a key to see',
            "e = torch.exp(a - torch.where(seen, top, 0.0))",
            "total = e.sum(-1, keepdim=True)",
            'stat = torch.where(seen, top + torch.log(torch.where(seen, total, 1.0)), -float("inf"))',
            "p = e / torch.where(seen, total, 1.0)",
        ),
    ),
    "row sum": Normaliser(  # a block: A and its row sums
        "0.0",
        (),
        ("total = a.sum(-1, keepdim=True)", "p = a / torch.where(total == 0.0, 1.0, total)"),
        ("stat = a.sum(-1, keepdim=True)", "p = a"),
    ),
    "none": Normaliser("0.0", ("p = a",), partial=("stat = None",)),
    "log-softmax": Normaliser(
        '-float("inf")',
        (SEEN, 'p = torch.where(seen, torch.log_softmax(torch.where(seen, a, 0.0), -1), -float("inf"))'),
        partial=None,
    ),
}


def ring_record(normaliser: str) -> bool:
    """Does the eager core of this normaliser give a block of keys' share (``part="share"``)?"""
    return NORMALISERS[normaliser].partial is not None


def eager_body(core: dict) -> str:
    """The lines of ``_core_eager{c}(Q, K, V, causal, symbols, tensors, origin, part)`` for a core's context
    (``_core_context``)."""
    c, tiles, scalars = core["c"], core["tiles"], [x["name"] for x in core["scalars"]]
    names = [t["tile"] for t in tiles] + scalars + [f"table_{t['name']}" for t in core["tables"]]
    lines = [
        "wide = torch.promote_types(Q.dtype, torch.float32)  # a 16-bit run's n × m arrays float32, as the kernels'"
    ]
    given = "tensors[:-1]" if core["dropout"] else "tensors"  # (dropout's seed last)
    if names:
        lines.append(f"{_unpacked(names)} = (None if x is None else x.to(wide) for x in {given})")
    lines += [f"{t['tile']} = 0.0 if {t['tile']} is None else {t['tile']}" for t in tiles if t["optional"]]
    read = " ".join([core["eager_logits"], *core["eager_positions"]])  # (A₂'s base-2 coefficients: not read here)
    found = [x["name"] if re.search(rf"\b{x['name']}\b", read) else "_" for x in core["coefficients"]]
    if any(name != "_" for name in found):
        keywords = "".join(f", {x}={x}" for x in scalars)
        lines.append(f"{_unpacked(found)} = _coefficients{c}(**symbols{keywords})")
    repeat = ".repeat_interleave(Q.shape[-3] // K.shape[-3], dim=-3)" if core["grouped"] else ""
    lines += [f"s = Q.to(wide) @ K.to(wide){repeat}.mT", *core["eager_positions"], f"a = {core['eager_logits']}"]
    normaliser = NORMALISERS[core["normaliser"]]
    lines += [
        "if causal:  # query i sees keys j <= i (at origin's positions)",
        "    above = torch.ones(a.shape[-2:], dtype=torch.bool, device=a.device).triu(1 + origin[0] - origin[1])",
        f"    a = a.masked_fill(above, {normaliser.fill})",
    ]
    partial = normaliser.partial
    if partial is not None:
        lines += ["if part == \"logits\":  # the scores' steps A, for the ring's backward", "    return a"]
    lines += normaliser.shared
    if partial:  # a block's share and statistic, merged over the blocks by the ring
        lines += ['if part == "share":', *(f"    {x}" for x in partial)]
        lines += ["else:", *(f"    {x}" for x in normaliser.rows)] if normaliser.rows else []
    if core["dropout"]:
        lines += [
            "if tensors[-1] is not None:  # dropout: P ⊙ Z, the kernels' draws from the saved seed",
            f"    batch = _batches(Q, K, V, tensors[:{len(tiles)}], {core['grouped']})[0]",
            f"    keep = _dropout_keep{c}(tensors[-1], (*batch, *p.shape[-2:]))",
            f"    p = p * keep * {core['dropout']['scale']}",
        ]
    out = f"p @ V.to(wide){repeat}" if core["value"] else "p"
    if partial is not None:
        lines += [f"out = {out}", 'return (out, stat) if part == "share" else out.to(V.dtype)']
    else:
        lines.append(f"return ({out}).to({'V' if core['value'] else 'Q'}.dtype)")
    return "\n".join("    " + line for line in lines)


def _unpacked(names: list[str]) -> str:
    """The target of an assignment unpacking names: `a, b` (one name: `(a,)`)."""
    return f"({names[0]},)" if len(names) == 1 else ", ".join(names)
