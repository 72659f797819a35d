"""The Spec type: a forward expression with named inputs, and the option parsers specs share.

A Spec is checked at the door (``validate``). ``Option`` declares a keyword of a generated
module: the name a user passes, the symbol it binds in the spec, and its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.dims import dim
from symattn.lang.graph import hash_consed, rewrite
from symattn.lang.lazy import plain
from symattn.lang.piecewise import RNG, TRAINING, draws
from symattn.lang.positions import canonical
from symattn.specs.validate import validate

__all__ = ["Option", "Spec", "dim", "flag", "head_count"]


@dataclass(frozen=True)
class Spec:
    """A forward expression with named inputs, options and intermediates."""

    name: str
    summary: str
    inputs: tuple[MatrixSymbol | sp.Symbol, ...]  # a real scalar Symbol is a trainable scalar
    output: MatrixExpr
    intermediates: tuple[tuple[str, MatrixExpr], ...] = ()
    options: Mapping[str, object] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    constants: tuple[MatrixSymbol, ...] = ()  # inputs that are not differentiated (the additive mask M)
    # the inputs that are parameters (no batch dimensions, gradients summed over the batch), by name;
    # None: those named W_…, b_…, gamma_…, beta_… (and the trainable scalars, always)
    parameters: tuple[str, ...] | None = None
    # constants a bool array may be passed for in the generated modules, by name: how the bool becomes the
    # constant — "additive" (−∞ where True, else 0), "additive_false" (−∞ where False), "keep" (1 where False,
    # else 0) or "keep_false" (1 where True). The additive mask (the constant added to a softmax's argument)
    # takes a bool without an entry too, read "additive" as attn_mask is. from_torch fills it for the bool
    # arguments of the traced function.
    bool_forms: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("inputs", "intermediates", "constants", "parameters"):  # lists are welcome; stored as tuples
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(tuple(v) if isinstance(v, list) else v for v in value))
        # sa.matrix's expressions: their SymPy expressions (SymPy's FunctionMatrix: the language's positions)
        object.__setattr__(self, "output", plain(self.output))
        for name in ("inputs", "constants"):
            if isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, tuple(plain(v) for v in getattr(self, name)))
        if isinstance(self.intermediates, tuple):
            pairs = ((v[0], plain(v[1])) if isinstance(v, tuple) and len(v) == 2 else v for v in self.intermediates)
            object.__setattr__(self, "intermediates", tuple(pairs))
        functions = validate(self)
        if functions:  # SymPy's FunctionMatrix: the language's matrix of positions (Entries)
            found = dict(zip(functions, canonical(functions)))
            object.__setattr__(self, "output", rewrite(self.output, found.get))
            object.__setattr__(self, "intermediates", tuple((k, rewrite(e, found.get)) for k, e in self.intermediates))
            validate(self)
        # one object per distinct subexpression: every later lookup compares arguments by identity
        exprs = hash_consed([self.output, *(e for _, e in self.intermediates)])
        object.__setattr__(self, "output", exprs[0])
        object.__setattr__(self, "intermediates", tuple((k, e) for (k, _), e in zip(self.intermediates, exprs[1:])))

    @property
    def matrix_inputs(self) -> tuple[MatrixSymbol, ...]:
        """The inputs that are matrices (not trainable scalars): the ones dimensions are read off."""
        return tuple(s for s in self.inputs if isinstance(s, MatrixSymbol))

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(str(s.name) for s in self.inputs)

    def input(self, name: str) -> MatrixSymbol:
        """The input symbol called name (SymattnError listing the names otherwise)."""
        for s in self.inputs:
            if s.name == name:
                return s
        raise SymattnError(f"spec {self.name!r} has no input {name!r}; inputs: {', '.join(self.input_names)}")


@dataclass(frozen=True)
class Option:
    """A keyword option of a generated forward: a scalar symbol and its default (None: required).

    ``divides``: the option whose value this one must divide (num_kv_heads divides num_heads). ``passed``: handed to
    the runtime as given (a random generator), not read as a number.
    """

    name: str
    symbol: sp.Symbol
    default: Basic | None
    divides: str | None = None
    passed: bool = False


def drawn_options(s: Spec, options: tuple[Option, ...]) -> tuple[Option, ...]:
    """The keywords a generated forward takes where the spec draws (dropout's mask), unless the options have them
    already: ``training`` (default True; False: no draw, the numbers of the spec without dropout) and ``rng``, the
    generator it draws from (torch: a torch.Generator, None for torch's default one; NumPy: a np.random.Generator,
    required while training)."""
    if any(o.name == TRAINING for o in options) or not draws(s.output):
        return ()
    return (Option(TRAINING, sp.Symbol(TRAINING), sp.true), Option(RNG, sp.Symbol(RNG), sp.Symbol("None"), passed=True))


def flag(name: str, value) -> bool:
    """A yes/no option: True/False (Python's or NumPy's), 1/0, or (from the command line) "true"/"false"."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, str) or value not in (0, 1) or isinstance(value, float):
        raise SymattnError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def head_count(option, what: str, symbol: str) -> Basic:
    """A head count: a symbol when None (or given as a symbol), else a positive integer (Python's or NumPy's)."""
    if option is None:
        return dim(symbol)
    if isinstance(option, sp.Symbol):
        return option
    if isinstance(option, str) and option.isidentifier():  # a symbolic count, e.g. "H_kv" from the command line
        return dim(option)
    if isinstance(option, (bool, np.bool_)) or not isinstance(option, (int, np.integer, sp.Integer)) or option < 1:
        raise SymattnError(f"{what} must be a positive integer, got {option!r}")
    return sp.Integer(int(option))
