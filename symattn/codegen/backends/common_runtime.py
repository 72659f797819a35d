"""Runtime helpers every generated module calls, whatever its backend: plain Python, no imports.

Real code, linted and tested; the generated-code printers copy the source of the ones a module
calls (read with ``ast``). ``SHAPES`` stands for the generated module's own constant.
"""

from __future__ import annotations

SHAPES: dict[str, str] = {}  # input name -> its shape as the docstring writes it, e.g. "(..., n, d_k)"
DIRECTION_OF: dict[str, str] = {}  # a module with a second closed form: input name -> its direction's name


def add_optional(a, b):
    """a + b, or a itself when b is None (an absent bias or mask)."""
    return a if b is None else a + b


def _check_shape(name, a, dims):
    """a's last two axes against the dimensions read off the inputs."""
    if tuple(a.shape[-2:]) != dims:
        batch = "..., " if a.ndim > 2 or SHAPES[name].startswith("(...") else ""
        raise ValueError(f"{name}: expected shape {SHAPES[name]} = ({batch}{dims[0]}, {dims[1]}), got {tuple(a.shape)}")


def _quotient(name, shape, divisor):
    """shape[-1] // divisor, which must divide it."""
    if shape[-1] % divisor:
        raise ValueError(f"{name}: expected shape {SHAPES[name]}, the last axis a multiple of {divisor}, got {shape}")
    return shape[-1] // divisor


def _positive_int(name, value):
    """value as a Python int >= 1: an int or a NumPy integer scalar, never a bool."""
    # value.__index__(), not type(value).__index__: torch.compile traces the one, not the other
    if type(value).__name__ in ("bool", "bool_") or not hasattr(value, "__index__") or value.__index__() < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value.__index__()


def _nonempty(sizes, named):
    """Every size but the query rows at least 1: with no keys or no features softmax and the norms have no value."""
    empty = [f"{size} = 0" for size, value in sizes.items() if value == 0]
    if empty:
        shapes = ", ".join(f"{name} {tuple(a.shape)}" for name, a in named.items() if a is not None)
        raise ValueError(f"{', '.join(empty)}: only the query rows may be empty; got {shapes}")


def _direction(direction):
    """A Hessian-vector product's direction: a dict from input names to arrays of their shapes (a name left
    out: zero in that input)."""
    if not isinstance(direction, dict):
        raise TypeError(f"direction: expected a dict from input names to arrays, got {type(direction).__name__}")
    unknown = [name for name in direction if name not in DIRECTION_OF]
    if unknown:
        raise ValueError(f"direction: {unknown[0]!r} is no input; inputs: {', '.join(DIRECTION_OF)}")
    return direction
