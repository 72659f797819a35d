"""What a forward saves for its backward, and what the backward makes again instead: the names the backward's
statements read, the scalar constants (made again from what they are made of) and the float options (resolved
again), and the constants a forward itself reads."""

from __future__ import annotations

from symattn.codegen.emit.sections import Statement, _uses
from symattn.codegen.schedule.build import Schedule
from symattn.specs import Option


def saved_names(sched: Schedule, sections: dict, mask: str | None, variant: str) -> list[str]:
    """The names forward saves for backward: those the backward's statements read."""
    maybe = [x for x in sched.spec.inputs if str(x.name) in sched.optional]
    backward = [
        line
        for sec in sections["backward_sections"]
        for line in sec.get("lines", []) + sec.get("body", []) + sec.get("accumulate", [])
    ]
    backward_text = (
        [b.value for b in backward]
        + [b.guard for b in backward]
        + [sl["full"] for sec in sections["backward_sections"] for sl in sec.get("slices", [])]
        + [
            line.value
            for sec in sections["backward_sections"]
            for line in sec.get("key_lines", []) + sec.get("map_lines", [])
        ]
        + [name for name, t in sched.gradients if t in sections["shared"]]  # returned as None when the input was
    )
    saved = [str(getattr(x, "name", x)) for x in sections["saved_symbols"]]
    saved += [str(x.name) for x in maybe] + [mask] * bool(mask) + ["mask_shape"] * bool(sched.constant_gradients)
    saved += ["causal"] * bool(mask)  # (read where a loop writes the causal part block by block)
    saved += [name for name in sections["unused"].values() if name not in saved]  # zero gradients take their shapes
    return [name for name in saved if _uses(name, backward_text)] + (["block_size"] if variant == "memeff" else [])


def saved_and_remade(sched: Schedule, saved: list[str], constants: list[Statement], printer) -> dict:
    """The names the forward saves, each scalar constant among them (scale = 1/√d_k) replaced by what it is made
    of (dimensions, trainable scalars), and the constants' statements the backward runs again: a torch Function
    may save ints and tensors, not floats (torch.compile's rule; under dynamic shapes such a float is symbolic).
    A float option the backward reads (scale, eps) stays saved, with what its default is made of: the backward
    resolves it again, float(<default> if scale is None else scale), first among the constants, so that a torch
    Function's forward need not save it (its setup_context keeps it as given); resolving the float a NumPy or JAX
    forward saved gives the same float."""
    values = {str(c.name): v for c, v in sched.constants}
    floats = {str(o.symbol): o for o in sched.options if not o.symbol.is_integer}  # (scale, eps)
    remade: set[str] = set()
    reads: list[str] = []
    stack = [name for name in saved if name in values or name in floats]
    while stack:
        name = stack.pop()
        if name not in remade:
            remade.add(name)
            made_of = values[name] if name in values else floats[name].default
            for x in sorted(getattr(made_of, "free_symbols", ()), key=str):
                (stack if str(x) in values or str(x) in floats else reads).append(str(x))
    kept = [name for name in saved if name not in values] + [name for name in floats if name in remade]
    kept = list(dict.fromkeys(kept))
    options = [o for symbol, o in floats.items() if symbol in remade]
    return {
        "saved": kept + [name for name in dict.fromkeys(reads) if name not in kept],
        "backward_constants": [_resolved(o, printer) for o in options] + [c for c in constants if c.target in remade],
    }


def _resolved(option: Option, printer) -> Statement:
    """symbol = float(<default> if symbol is None else symbol): a float option, read as saved (as given, or the
    float it was resolved to), resolved as the forward resolves it."""
    symbol = str(option.symbol)
    if option.default is None:
        return Statement(symbol, f"float({symbol})")
    return Statement(symbol, f"float({printer.doprint(option.default)} if {symbol} is None else {symbol})")


def read_constants(constants: list[Statement], sections: list[dict]) -> list[Statement]:
    """The constants the sections read (a forward computes only those: the backward makes its own again), and the
    constants those are made of, in order."""
    texts = [repr(sections)]
    needed: set[str] = set()
    for c in reversed(constants):
        if _uses(c.target, texts):
            needed.add(c.target)
            texts.append(c.value)
    return [c for c in constants if c.target in needed]
