"""The JVP's schedule: the first schedule's forward, then one tangent per forward assignment.

Each assignment N = e(reads) gets Ṅ = de, its forward differential written with the tangents of the values it
reads (``autodiff.differentials``); a value no tangent reaches has none. Each tangent is simplified with the
forward's values at hand (Ṗ = P ⊙ (Ȧ − rowsum(Ȧ ⊙ P) 𝟏ᵀ) reads P, never exp(A) again). The output and its
tangent are both returned, so the output is kept (not overwritten by a later tangent).
"""

from __future__ import annotations

import dataclasses

import sympy as sp
from sympy import Basic, HadamardProduct, MatrixSymbol

from symattn.autodiff.differentials import differential
from symattn.codegen.schedule.build import Schedule, _simplified
from symattn.codegen.schedule.dag import Assignment
from symattn.codegen.schedule.naming import name_row_sums
from symattn.codegen.schedule.passes import hoist_hadamard_scalars, stack_products
from symattn.codegen.schedule.sharing import order
from symattn.lang.dims import bind_dimensions
from symattn.lang.graph import matrix_symbols
from symattn.lang.naming.names import fresh_name
from symattn.specs.forward_mode import ForwardMode, forward_mode_spec

__all__ = ["jvp_schedule"]


def jvp_schedule(first: Schedule) -> tuple[ForwardMode, Schedule]:
    """The forward mode spec and its schedule: forward = the first forward and the tangents; output = Ẏ."""
    fm = forward_mode_spec(first.spec)
    by_name = {str(x.name): x for x in (*fm.spec.inputs, *fm.spec.constants)}
    tangents: dict[Basic, Basic] = {by_name[x]: by_name[t] for x, t in fm.tangents}
    taken = set(by_name) | {str(c.name) for c in fm.spec.constants} | {str(a.target.name) for a in first.forward}
    taken |= {str(symbol) for symbol, _ in first.constants}
    # a named scalar constant of a trainable scalar (c = −λ) moves with it: written out where a value reads it
    moving = {c: v for c, v in first.constants if v.free_symbols & set(tangents)}
    values = []
    for a in first.forward:
        value = a.value.xreplace(moving) if moving else a.value
        reads = [*matrix_symbols(value), *(x for x in value.free_symbols if x in tangents)]
        d = differential(value, {x: tangents[x] for x in reads if x in tangents})
        if d is None or getattr(d, "is_ZeroMatrix", False):
            continue
        name = fresh_name("d" + str(a.target.name), taken, bare=True, first=2, sep="_")
        taken.add(name)
        tangents[a.target] = MatrixSymbol(name, *a.target.shape)
        values.append(Assignment(tangents[a.target], d, a.reduce_batch))
    values = _flat_hadamards(hoist_hadamard_scalars(_simplified(values, list(first.forward), write_out=False)))
    # the softmax's rowsum(Ȧ ⊙ P) named (D, an n × 1 column), so that Ṗ is computed into Ȧ, which dies there
    values = order(name_row_sums(values, frozenset(taken)))
    # Ȧ = c·Q K̇ᵀ + c·Q̇ Kᵀ as one product c·[Q | Q̇] [K̇ | K]ᵀ: the n × m tangent written once
    weights = set(first.weights) | {str(tangents[x].name) for x in fm.spec.inputs if str(x.name) in first.weights}
    taken |= {str(a.target.name) for a in values}
    values = stack_products(values, frozenset(weights), taken, first.forward)
    output = tangents.get(first.output)
    if output is None:  # the output depends on no input (a spec of constants only): its tangent is zero
        output = MatrixSymbol(fresh_name("d" + str(first.output.name), taken, bare=True, first=2), *first.output.shape)
        values.append(Assignment(output, sp.ZeroMatrix(*first.output.shape)))
    forward = (*first.forward, *values)
    read = {x for a in forward for x in a.value.free_symbols}
    sched = dataclasses.replace(
        first,
        constants=tuple((c, v) for c, v in first.constants if c in read),  # (c = 1/√d_k, …) those it reads
        spec=fm.spec,
        bindings=tuple(bind_dimensions(fm.spec.matrix_inputs, {o.symbol for o in first.options})),
        forward=forward,
        output=output,
        saved=(first.output,),  # returned beside Ẏ: kept intact
        backward=(),
        # a tangent is optional where its input is (a bias, the mask): None is zero, its terms left out
        optional=first.optional | {t for x, t in fm.tangents if x in first.optional},
        tangents=tuple(tangents.items()),
        gradients=(),
        constant_gradients=(),
    )
    return fm, sched


def _flat_hadamards(values: list[Assignment]) -> list[Assignment]:
    """(X ⊙ Y) ⊙ Z as X ⊙ Y ⊙ Z: a product rule's nested terms as one entrywise product, whose broadcast
    factors (u 𝟏ᵀ) print as columns beside its full ones (−(dZ 𝟏ᵀ) ⊙ (Z 𝟏ᵀ)^∘−2 ⊙ N, no n × d repeat)."""

    def flat(node: Basic) -> Basic:
        args = [x for a in node.args for x in (a.args if isinstance(a, HadamardProduct) else (a,))]
        return HadamardProduct(*args) if len(args) > len(node.args) else node

    return [
        Assignment(a.target, a.value.replace(lambda e: isinstance(e, HadamardProduct), flat), a.reduce_batch)
        for a in values
    ]
