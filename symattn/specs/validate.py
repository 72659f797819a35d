"""A spec checked at the door: every field well formed before any derivation or code sees it.

Names become Python identifiers in generated modules, so they must be identifiers,
not keywords, and distinct; the output must be a matrix expression of symattn's
language whose every matrix symbol is an input or a constant, with shapes that fit.
A real scalar ``Symbol`` among the inputs is a trainable scalar (a temperature τ).
Each violation is one ``SpecError`` line naming the field.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol, Symbol
from sympy.matrices.expressions import FunctionMatrix, Identity, OneMatrix, ZeroMatrix

from symattn.autodiff.vjp import VJP_RULES, supported, vjp_rule
from symattn.errors import SymattnError
from symattn.lang.graph import nodes
from symattn.lang.shapes import SHAPE_RULES

# FunctionMatrix: a matrix of positions (Entries, or SymPy's own, which Spec makes Entries), no matrix read
LEAVES = (MatrixSymbol, Identity, OneMatrix, ZeroMatrix, FunctionMatrix)
RESERVED = {"G": "the cotangent of the output"}  # names the derivation and check give a meaning of their own
# how a bool array passed for a constant becomes it (Spec.bool_forms): −∞ where True / where False (an additive
# mask), 1 where False / where True (a mask multiplied in)
BOOL_FORMS = ("additive", "additive_false", "keep", "keep_false")


class SpecError(SymattnError, ValueError):
    """A spec with a malformed field."""


def is_identifier(name: str) -> bool:
    """name can name a variable or module of generated code: an ASCII identifier, not a keyword."""
    return name.isidentifier() and name.isascii() and not keyword.iskeyword(name)


def check_name(spec: str, field: str, name: object) -> str:
    """name, if it can name a variable of a generated module (an identifier, not a keyword)."""
    if not isinstance(name, str):
        raise SpecError(f"spec {spec!r}: {field}: a name must be a string, got {type(name).__name__} {name!r}")
    if not is_identifier(name):
        raise SpecError(f"spec {spec!r}: {field}: {name!r} is not a Python identifier (it names a variable)")
    return name


def check_symbols(spec: str, field: str, symbols: object, scalars: bool = False) -> tuple[Basic, ...]:
    """symbols as a tuple of MatrixSymbols (with scalars: or real scalar Symbols, trainable scalars)."""
    kinds = "MatrixSymbols or scalar Symbols" if scalars else "MatrixSymbols"
    if isinstance(symbols, (str, Basic)) or not isinstance(symbols, (tuple, list)):
        raise SpecError(f"spec {spec!r}: {field} must be a tuple of {kinds}, got {type(symbols).__name__}")
    for s in symbols:
        if isinstance(s, sp.Symbol) and not scalars:
            raise SpecError(f"spec {spec!r}: {field}: {s} is a scalar symbol; {field} are MatrixSymbols")
        if isinstance(s, sp.Symbol) and s.is_integer:
            raise SpecError(
                f"spec {spec!r}: {field}: {s} is an integer symbol (a dimension); a trainable scalar is a "
                f"real Symbol, e.g. sp.Symbol({str(s.name)!r}, real=True)"
            )
        if not isinstance(s, (MatrixSymbol, sp.Symbol)):
            raise SpecError(f"spec {spec!r}: {field}: {s!r} is a {type(s).__name__}, not one of the {kinds}")
        check_name(spec, field, str(s.name))
    return tuple(symbols)


def check_expression(spec: str, field: str, expr: object, seen: set[Basic] | None = None) -> None:
    """expr is a matrix expression of the language: known nodes, fitting shapes.

    Nodes in ``seen`` were checked before (shared with other fields), so each is walked once.
    """
    if not isinstance(expr, MatrixExpr):
        kind = "a scalar expression" if isinstance(expr, Basic) else f"a {type(expr).__name__}"
        raise SpecError(f"spec {spec!r}: {field} must be a matrix expression, got {kind}")
    seen = set() if seen is None else seen
    stack: list[Basic] = [expr]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if isinstance(node, LEAVES):
            continue
        if not isinstance(node, Basic):
            raise SpecError(f"spec {spec!r}: {field} contains {type(node).__name__} {node!r}, not a SymPy object")
        if isinstance(node, MatrixExpr) or node.has(MatrixSymbol):
            if vjp_rule(node) is None:
                known = ", ".join(sorted(supported(VJP_RULES)))
                raise SpecError(f"spec {spec!r}: {field}: {type(node).__name__} is not in the language ({known})")
            stack.extend(node.args)
        shape_rule = SHAPE_RULES.get(type(node))
        if shape_rule is not None:
            try:
                shape_rule(node)
            except SymattnError as err:
                raise SpecError(f"spec {spec!r}: {field}: {err}") from None


def validate(spec) -> tuple[Basic, ...]:
    """Raise SpecError naming the first malformed field of a Spec; return SymPy's own FunctionMatrix nodes in it
    (the language's Entries by another name: ``Spec`` makes them Entries, from this walk, with no walk of its own)."""
    name = spec.name
    if not isinstance(name, str) or not is_identifier(name):
        raise SpecError(f"spec name {name!r} must be a Python identifier (it names the generated modules)")
    if not isinstance(spec.summary, str):
        raise SpecError(f"spec {name!r}: summary must be a string, got {type(spec.summary).__name__}")
    inputs = check_symbols(name, "inputs", spec.inputs, scalars=True)
    constants = check_symbols(name, "constants", spec.constants)
    names = [str(s.name) for s in inputs + constants]
    for n in names:
        if n in RESERVED:
            raise SpecError(f"spec {name!r}: inputs: {n!r} is reserved ({RESERVED[n]}); rename the input")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"spec {name!r}: inputs: {', '.join(map(repr, duplicates))} named more than once")
    parameters = getattr(spec, "parameters", None)
    if parameters is not None:
        strangers = [p for p in parameters if not isinstance(p, str) or p not in names[: len(inputs)]]
        if not isinstance(parameters, tuple) or strangers:
            raise SpecError(f"spec {name!r}: parameters must be a tuple of input names, got {parameters!r}")
    forms = getattr(spec, "bool_forms", {})
    if not isinstance(forms, Mapping):
        raise SpecError(f"spec {name!r}: bool_forms must be a dict from constant names to forms, got {forms!r}")
    for key, form in forms.items():
        if key not in names[len(inputs) :]:
            raise SpecError(f"spec {name!r}: bool_forms: {key!r} is not the name of a constant")
        if form not in BOOL_FORMS:
            raise SpecError(f"spec {name!r}: bool_forms: {key!r}: form {form!r} is not one of {', '.join(BOOL_FORMS)}")
    seen: set[Basic] = set()
    check_expression(name, "output", spec.output, seen)
    leaves = {m for m in nodes(spec.output) if isinstance(m, (MatrixSymbol, Symbol))}  # atoms() walks the tree
    if not leaves & set(inputs):  # X − X folded to 0, A + I − A to I: nothing to differentiate
        raise SpecError(f"spec {name!r}: the output {spec.output} depends on no input (SymPy simplified them away)")
    symbols = {m for m in leaves if isinstance(m, MatrixSymbol)}
    for s in (*inputs, *constants):
        other = next((m for m in symbols if m.name == s.name and m != s), None)
        if other is not None:
            raise SpecError(
                f"spec {name!r}: {s.name} is two matrices, {s.shape[0]} × {s.shape[1]} and "
                f"{other.shape[0]} × {other.shape[1]}; give them different names"
            )
    missing = sorted({str(m.name) for m in symbols} - set(names))
    if missing:
        raise SpecError(f"spec {name!r}: output uses {', '.join(missing)}, which inputs and constants do not list")
    check_intermediates(name, spec.intermediates, set(names), seen)
    for field in ("options", "dims"):
        if not isinstance(getattr(spec, field), Mapping):
            raise SpecError(f"spec {name!r}: {field} must be a mapping, got {type(getattr(spec, field)).__name__}")
    return tuple(node for node in seen if type(node) is FunctionMatrix)


def check_intermediates(spec: str, intermediates: object, inputs: set[str], seen: set[Basic]) -> None:
    """Named intermediates: (identifier, matrix expression) pairs, names distinct and no input's."""
    if isinstance(intermediates, (str, Basic)) or not isinstance(intermediates, (tuple, list)):
        raise SpecError(f"spec {spec!r}: intermediates must be a tuple of (name, expression) pairs")
    seen: set[str] = set()
    for pair in intermediates:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise SpecError(f"spec {spec!r}: intermediates: {pair!r} is not a (name, expression) pair")
        label, expr = pair
        check_name(spec, "intermediates", label)
        if label in seen or label in inputs or label in RESERVED:
            raise SpecError(f"spec {spec!r}: intermediates: {label!r} is already the name of an input or intermediate")
        seen.add(label)
        check_expression(spec, f"intermediate {label}", expr, seen)
