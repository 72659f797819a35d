"""The names a derivation uses: the spec's intermediates, plus a name for each value the backward pass reuses.

A textbook that differentiates A = 50 tanh(S/(50√d)) first writes T = tanh(S/(50√d)),
so that the step reads (𝟏𝟏ᵀ − T^∘2) ⊙ dS rather than (𝟏𝟏ᵀ − ((1/50) A)^∘2) ⊙ dS.
``named_intermediates`` adds such a name for every unnamed entrywise or softmax node
whose own VJP reuses its value (tanh, σ, exp, softmax), placed just before the first
named intermediate that uses it. ``DisplayNames`` puts names back for printing and
first folds a scalar multiple of a product into it, so that 50 ((1/50) A) is seen as
the A it is.
"""

from __future__ import annotations

from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import MatMul, Transpose

from symattn.derive.folding import fold_product
from symattn.lang.algebra import factors, product
from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import postorder
from symattn.lang.naming.names import Names, _find
from symattn.specs import Spec


def named_intermediates(spec: Spec) -> list[tuple[str, MatrixExpr]]:
    """The spec's intermediates in forward order, with a name for each reused unnamed value.

    One walk over the DAG: a value is yielded before the first root (intermediate, then the
    output) that contains it, so it is named just before that root's definition.
    """
    given = list(spec.intermediates)
    named = {expr: name for name, expr in given}
    roots = [expr for _, expr in given] + [spec.output]
    symbols = {str(n.name) for n in postorder(*roots) if isinstance(n, MatrixSymbol)}
    taken = set(named.values()) | symbols | {"G", "Y"}
    out: list[tuple[str, MatrixExpr]] = []
    for node in postorder(*roots):
        if node in named:
            out.append((named[node], node))
        elif isinstance(node, FunctionRecord) and node.reads_value():  # (tanh: 𝟏𝟏ᵀ − T^∘2, softmax: P)
            label, k = node.letter, 1
            while label in taken:
                label, k = f"{node.letter}_{k}", k + 1
            taken.add(label)
            out.append((label, node))
    return out


class DisplayNames(Names):
    """Names put back for printing, with scalar multiples folded first: 50 ((1/50) A) reads A.

    A name is never renamed as a multiple of another: with A = 50 T, T stays T (not (1/50) A).
    """

    def _match(self, e: Basic) -> Basic:
        if not isinstance(e, MatrixExpr):
            return e
        coeff, mats = factors(fold_product(e) if isinstance(e, MatMul) else e)
        changed = True
        while changed:
            changed = False
            # only the patterns whose first factor occurs can match; tried in the order added
            for k in sorted({k for m in mats for k in self.by_first.get(m, ())}):
                replacement, p_coeff, p_mats = self.patterns[k]
                found = _find(mats, p_mats)
                if found is None:
                    continue
                rest = coeff / p_coeff
                if p_coeff != 1 and (not rest.is_number or (rest != 1 and len(p_mats) == 1 and _is_name(p_mats[0]))):
                    continue
                mats = mats[:found] + [replacement] + mats[found + len(p_mats) :]
                coeff, changed = rest, True
                break
        return product(coeff, *mats, canonical=False)


def _is_name(m: Basic) -> bool:
    return isinstance(m, MatrixSymbol) or (isinstance(m, Transpose) and isinstance(m.arg, MatrixSymbol))


__all__ = ["DisplayNames", "named_intermediates"]
