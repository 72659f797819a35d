"""Deep specs written without names get their layers named before anything is scheduled.

A spec file may write Y = tanh(… tanh(X W_1) … W_L) as one expression. Its closed forms are then
as deep as the spec, and every pass that rewrites a value (simplify, share, save, the second
closed form's sweep) would work on one value as large as the whole model. ``named_layers`` names
each operator application (tanh, softmax, layer norm, …) of a value deeper than ``DEPTH_CAP``,
H1, H2, …, as the spec's author would name its layers; values no deeper are left as they are (the
built-ins' and the gallery's are at most 7 deep with their names as leaves).
"""

from __future__ import annotations

import dataclasses

from sympy import Basic, MatrixSymbol

from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import fold, postorder
from symattn.lang.naming.names import Names
from symattn.lang.ops_block import _RowStatistic
from symattn.specs.spec import Spec

DEPTH_CAP = 12
LAYERS = (FunctionRecord, _RowStatistic)  # the operators a layer ends with


def named_layers(s: Spec) -> Spec:
    """s with the operator applications inside each too-deep value named H1, H2, … (s itself if none is)."""
    names = Names()
    taken = {str(x.name) for x in (*s.inputs, *s.constants)} | {label for label, _ in s.intermediates}
    serial = 0
    intermediates: list[tuple[str, Basic]] = []
    for label, expr in [*s.intermediates, ("", s.output)]:
        if depth(names.substitute(expr)) > DEPTH_CAP:
            for node in postorder(expr):
                if node is expr or node in names.table or not isinstance(node, LAYERS):
                    continue
                serial += 1
                while f"H{serial}" in taken:
                    serial += 1
                intermediates.append((f"H{serial}", node))
                names.add(node, MatrixSymbol(f"H{serial}", *node.shape))
        if label:
            intermediates.append((label, expr))
            names.add(expr, MatrixSymbol(label, *expr.shape))
    if len(intermediates) == len(s.intermediates):
        return s
    return dataclasses.replace(s, intermediates=tuple(intermediates))


def depth(expr: Basic) -> int:
    """The longest path from expr down to a leaf, on the DAG."""
    return fold(expr, lambda _: 0, lambda _, args: 1 + max(args))
