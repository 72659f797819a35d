"""A spec with an additive attention mask: M added to the scores of each row softmax.

``with_mask(spec)`` turns softmax(A) into softmax(A + M) wherever the spec normalises rows, M (n × m) a constant
of the scores' shape. The generated modules then take the attention family's mask keywords (attn_mask,
key_padding_mask, causal) and build M from them, and their blocks of query rows skip the keys M hides, as the
built-in attention's do (``codegen.schedule.rowblocks``).
"""

from __future__ import annotations

from dataclasses import replace

from sympy import Basic, MatrixSymbol

from symattn.errors import SymattnError
from symattn.lang.algebra import total
from symattn.lang.graph import nodes, rewrite
from symattn.lang.rowwise import LogSoftmax, RowSoftmax
from symattn.specs.spec import Spec


def with_mask(spec: Spec, name: str = "M") -> Spec:
    """spec with softmax(A) → softmax(A + M) (and log_softmax alike) at every row normalisation, M a constant.

    Every softmax's scores must have one shape (n × m, n the first input's rows); the spec must not have a
    constant or input called name. The derivation, the gradients and the generated code follow from the new
    expression like any spec's: M gets no gradient (a float attn_mask's is given, as for attention).
    """
    roots = [spec.output, *(e for _, e in spec.intermediates)]
    found = [n for n in nodes(*roots) if isinstance(n, (RowSoftmax, LogSoftmax))]
    if not found:
        raise SymattnError(f"spec {spec.name}: with_mask needs a softmax to add the mask to, and there is none")
    shapes = {n.shape for n in found}
    if len(shapes) != 1:
        raise SymattnError(f"spec {spec.name}: with_mask needs one shape of scores, the softmaxes have {shapes}")
    taken = {str(x.name) for x in (*spec.inputs, *spec.constants)}
    if name in taken:
        raise SymattnError(f"spec {spec.name}: with_mask's mask {name!r} is already an input or constant")
    mask = MatrixSymbol(name, *shapes.pop())

    def add_mask(node: Basic) -> Basic | None:
        return node.func(total(node.arg, mask)) if isinstance(node, (RowSoftmax, LogSoftmax)) else None

    return replace(
        spec,
        output=rewrite(spec.output, add_mask),
        intermediates=tuple((label, rewrite(e, add_mask)) for label, e in spec.intermediates),
        constants=(*spec.constants, mask),
    )
