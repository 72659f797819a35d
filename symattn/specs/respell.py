"""The same function, spelled otherwise: respellings of a spec for checking that its code does not depend on them.

A user may name any intermediate or none, write A + B or B + A, put 1/√d on the scores, on Q or
half on each of Q and K, and name the scaled factor or not. ``respellings(s)`` writes a spec each of
these ways; every one computes the same function, so the schedule made from each (its FLOPs, its
full n × m passes) should be the same (``tests/integration/test_respelling.py``,
``benchmarks/respelling.py``).
"""

from __future__ import annotations

import random

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul

from symattn.lang.algebra import factors, product
from symattn.lang.graph import children, postorder, rebuilt
from symattn.lang.naming.names import fresh_name
from symattn.specs.spec import Spec


def respellings(s: Spec, seed: int = 0) -> dict[str, Spec]:
    """s written several ways: as written; no intermediate named; every other one named; a random half named;
    sums and entrywise products in reverse order; each scalar factor of a product moved onto the product's
    last factor, named; each scalar factor split in two square roots on its first and last factors, named."""
    rng = random.Random(seed)
    half = tuple(pair for pair in s.intermediates if rng.random() < 0.5)
    return {
        "as written": s,
        "none named": _with(s, s.output, ()),
        "every other named": _with(s, s.output, s.intermediates[::2]),
        "a random half named": _with(s, s.output, half),
        "terms reversed": _rebuilt(s, _reversed),
        "scale on the last factor, named": _rebuilt(s, _scale_moved, named=True),
        "scale split over two factors, named": _rebuilt(s, _scale_split, named=True),
    }


def _with(s: Spec, output: MatrixExpr, intermediates: tuple) -> Spec:
    return Spec(s.name, s.summary, s.inputs, output, intermediates, s.options, s.dims, s.constants)


def _reversed(node: Basic, args: tuple, _: list) -> Basic:
    """A + B as B + A, A ⊙ B as B ⊙ A (SymPy keeps the order it is given)."""
    if isinstance(node, (MatAdd, HadamardProduct)):
        return rebuilt(node, tuple(reversed(args)))
    return rebuilt(node, args)


def _scale_moved(node: Basic, args: tuple, named: list) -> Basic:
    """c F₁ … F_k as F₁ … (c F_k), the scaled factor named."""
    coeff, mats = factors(rebuilt(node, args)) if isinstance(node, MatMul) else (1, ())
    if coeff in (1, -1) or len(mats) < 2:
        return rebuilt(node, args)
    scaled = MatMul(coeff, mats[-1])
    named.append(scaled)
    return MatMul(*mats[:-1], scaled)


def _scale_split(node: Basic, args: tuple, named: list) -> Basic:
    """c F₁ … F_k as (√c F₁) … (√c F_k), both scaled factors named (1/√d as d^(-1/4) on Q and on K)."""
    coeff, mats = factors(rebuilt(node, args)) if isinstance(node, MatMul) else (1, ())
    if coeff in (1, -1) or len(mats) < 2 or not coeff.is_positive:  # (√τ of a trainable τ: no spelling)
        return rebuilt(node, args)
    root = sp.sqrt(coeff)
    first, last = MatMul(root, mats[0]), MatMul(root, mats[-1])
    named += [first, last]
    return MatMul(first, *mats[1:-1], last)


def _rebuilt(s: Spec, change, named: bool = False) -> Spec:
    """s with each node of its DAG rebuilt by change(node, new args, extra), leaves first; the spec's intermediates
    are kept (as their rebuilt nodes), and with named, so are the values change put in extra (labels c1, c2, …)."""
    new: dict[Basic, Basic] = {}
    extra: list[Basic] = []
    for node in postorder(s.output, *(e for _, e in s.intermediates)):
        args = children(node)
        new[node] = change(node, tuple(new[a] for a in args), extra) if args else node
    output = product(new[s.output]) if isinstance(new[s.output], MatMul) else new[s.output]
    intermediates = [(label, new[e]) for label, e in s.intermediates if e in new]
    taken = {label for label, _ in intermediates} | {str(x.name) for x in (*s.inputs, *s.constants)}
    for e in dict.fromkeys(extra) if named else ():
        label = fresh_name("c", taken)
        taken.add(label)
        intermediates.append((label, e))
    # in the order of the DAG: an intermediate before those that read it
    order = {e: i for i, e in enumerate(postorder(output))}
    intermediates = sorted((p for p in intermediates if p[1] in order), key=lambda p: order[p[1]])
    return _with(s, output, tuple(intermediates))
