"""symattn's exceptions: every error a user can provoke is one of these."""

from __future__ import annotations


class SymattnError(Exception):
    """Base class of every error symattn raises on bad input."""


class UnsupportedNodeError(SymattnError, TypeError):
    """An expression node that symattn has no rule for."""

    def __init__(self, node: object, operation: str, supported: list[str]) -> None:
        self.node = node
        name = type(node).__name__
        super().__init__(f"unsupported node {name} ({node}) for {operation}; supported: {', '.join(sorted(supported))}")


class NotAMatrixError(SymattnError, TypeError):
    """A node that takes a matrix expression was given something else."""


class ShapeMismatchError(SymattnError, ValueError):
    """Two operands whose shapes do not fit the operation joining them."""

    def __init__(self, operation: str, left: tuple, right: tuple, where: object = None) -> None:
        self.left, self.right = left, right
        at = f" in {where}" if where is not None else ""
        super().__init__(f"shape mismatch for {operation}{at}: {_fmt(left)} and {_fmt(right)}")


class UnknownSpecError(SymattnError, KeyError):
    """A spec name that is not built in."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _fmt(shape: tuple) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
