"""Dimensions: positive integer symbols, equality of symbolic sizes, and reading them off shapes."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixSymbol

# The length of an input's axis, in a Binding's formula.
LENGTH = sp.Symbol("length", positive=True, integer=True)


def dim(name: str) -> sp.Symbol:
    """A dimension: a positive integer symbol."""
    return sp.Symbol(name, positive=True, integer=True)


def same_dim(a, b) -> bool:
    """True when two (possibly symbolic) dimensions are provably equal."""
    if a == b:
        return True
    return sp.simplify(sp.sympify(a) - sp.sympify(b)) == 0


@dataclass(frozen=True)
class Binding:
    """A dimension read off an input's shape: symbol = input.shape[axis] // divisor (None: the length itself).

    ``solution`` is set instead of ``divisor`` for a length that is no multiple of the
    symbol (n + 1, n²): the symbol as an expression of ``LENGTH``.
    """

    symbol: sp.Symbol
    input: str
    axis: int  # -2 (rows) or -1 (columns)
    divisor: Basic | None = None
    solution: Basic | None = None

    @property
    def formula(self) -> Basic:
        """The symbol as an expression of ``LENGTH`` (the axis' length); exact, so a remainder shows."""
        if self.solution is not None:
            return self.solution
        return LENGTH if self.divisor is None else LENGTH / self.divisor


def bind_dimensions(inputs: Iterable[MatrixSymbol], known: Iterable[sp.Symbol], solve: bool = False) -> list[Binding]:
    """How to read every dimension off the inputs' shapes, each from the first axis that determines it.

    The inputs' axes are visited in order, again while a pass binds something new: an
    axis whose length has one dimension s not known yet (known: given, or bound
    before) and is c·s, with c made of known dimensions, binds s = length // c.
    With ``solve``, a length that is any other expression of one unknown s (n + 1)
    binds s to the solution of length(s) = LENGTH; code generators, which print
    s = length // c, leave it off.
    """
    inputs = list(inputs)
    known = set(known)
    found: list[Binding] = []
    progress = True
    while progress:
        progress = False
        for x in inputs:
            for axis, size in zip((-2, -1), x.shape):
                binding = _binding(sp.sympify(size), known, str(x.name), axis, solve)
                if binding is not None:
                    found.append(binding)
                    known.add(binding.symbol)
                    progress = True
    return found


def _binding(size: Basic, known: set, name: str, axis: int, solve: bool) -> Binding | None:
    """The binding an axis of this length gives, if it has exactly one unknown dimension."""
    unknown = size.free_symbols - known
    if len(unknown) != 1:
        return None
    (s,) = unknown
    divisor = sp.simplify(size / s)
    if not (divisor.free_symbols - known or s in divisor.free_symbols):
        return Binding(s, name, axis, None if divisor == 1 else divisor)
    if solve:
        solutions = sp.solve(sp.Eq(size, LENGTH), s)
        if solutions:
            return Binding(s, name, axis, solution=solutions[0])
    return None
