"""User values as SymPy objects, without ever evaluating text.

SymPy's ``sympify`` runs a string through ``eval``; symattn's public functions take
expressions, numbers and symbols, never formulas as text (formulas go through the
whitelist parser in ``parse``). ``expression`` is the one door they all use.
"""

from __future__ import annotations

import numbers

import sympy as sp
from sympy import Basic

from symattn.errors import SymattnError


def expression(value: object, what: str = "the expression") -> Basic:
    """value as a SymPy object: SymPy objects as they are, Python and NumPy numbers converted, text refused."""
    if isinstance(value, Basic):
        return value
    converted = getattr(value, "_sympy_", lambda: None)()  # SymPy's protocol (sa.matrix's values): their expression
    if isinstance(converted, Basic):
        return converted
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Number):
        hint = " (text is never evaluated; formulas go through symattn.lang.naming.parse)"
        hint = hint if isinstance(value, str) else ""
        raise SymattnError(f"{what} must be a SymPy expression or a number, got {type(value).__name__} {value!r}{hint}")
    if isinstance(value, numbers.Integral):
        return sp.Integer(int(value))
    if isinstance(value, numbers.Rational):
        return sp.Rational(int(value.numerator), int(value.denominator))
    if isinstance(value, numbers.Real):
        number = float(value)
        if number != number or number in (float("inf"), float("-inf")):
            raise SymattnError(f"{what} must be a finite number, got {value!r}")
        return sp.Float(number)
    raise SymattnError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
