"""A module's state around a trace: its parameters and buffers left as they were, and a forward that changes them
(a step counter incremented, a cache written) refused in one line, never dropped silently: the closed form computes
the forward's output, not its side effects, so a drop-in would stop updating what the original updates."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from symattn.errors import SymattnError


@dataclass
class _Held:
    """One parameter or buffer as the trace found it: where it is held, the tensor, its version counter, and for a
    buffer a copy of its values (a parameter is not copied: a forward that writes into one is refused, not undone)."""

    owner: object  # the submodule
    table: str  # "_parameters" or "_buffers"
    key: str
    name: str  # its dotted name in the module
    tensor: object  # None: an entry left out (a Linear's bias=False)
    version: int
    values: object


def _held(module) -> list[_Held]:
    """Every parameter and buffer entry of the module and its submodules (an entry None, a bias left out: as it is)."""
    found = []
    for prefix, sub in module.named_modules():
        for table in ("_parameters", "_buffers"):
            for key, tensor in getattr(sub, table).items():
                name = f"{prefix}.{key}" if prefix else key
                if tensor is None:
                    found.append(_Held(sub, table, key, name, None, 0, None))
                    continue
                values = tensor.detach().clone() if table == "_buffers" else None
                found.append(_Held(sub, table, key, name, tensor, tensor._version, values))
    return found


def _restored(module, held: list[_Held]) -> list[str]:
    """Put every parameter and buffer back (the same tensor objects; a buffer's values; a buffer the forward
    registered removed) and name what the forward changed."""
    import torch

    changed = []
    known = {(id(h.owner), h.table, h.key) for h in held}
    for h in held:
        table = getattr(h.owner, h.table)
        if table.get(h.key, h) is not h.tensor:  # reassigned (self.step = self.step + 1) or deleted
            table[h.key] = h.tensor
            changed.append(f"{h.table[1:-1]} {h.name!r} (reassigned)")
        elif h.tensor is not None and h.tensor._version != h.version:  # in place: self.step += 1
            if h.values is not None:
                with torch.no_grad():
                    h.tensor.copy_(h.values)
            changed.append(f"{h.table[1:-1]} {h.name!r} (written in place)")
    for prefix, sub in module.named_modules():
        for table in ("_parameters", "_buffers"):
            for key in [k for k in getattr(sub, table) if (id(sub), table, k) not in known]:
                del getattr(sub, table)[key]
                name = f"{prefix}.{key}" if prefix else key
                changed.append(f"{table[1:-1]} {name!r} (registered)")
    return changed


@contextmanager
def state_kept(module) -> Iterator[None]:
    """Run the body (a trace of module's forward; None: a function, no state) and leave the module's parameters and
    buffers as they were; a SymattnError naming each one the forward changed."""
    if module is None:
        yield
        return
    held = _held(module)
    try:
        yield
    finally:
        changed = _restored(module, held)
    if changed:
        raise SymattnError(
            f"from_torch: {type(module).__name__}.forward changes its state ({', '.join(changed)}): the closed form "
            "computes the output only, so a drop-in would drop the update; update it outside forward"
        )
