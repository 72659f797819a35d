"""f₂'s schedule by forward mode over the first schedule (forward over reverse).

With L = tr(Gᵀ F(x)) and g_i = ∂L/∂x_i the first gradients, f₂ = Σ_i tr(V_iᵀ g_i) has

    ∂f₂/∂x_j = Σ_i ∂²L/∂x_j ∂x_i [V_i]   (the Hessian of L is symmetric)
    ∂f₂/∂G   = Σ_i ∂F/∂x_i [V_i]          (L is linear in G)

and both are tangents along ẋ_i = V_i (Ġ = 0): of the first gradients g_j and of the output F.
So the second closed form is the first schedule run forward (its forward and backward assignments,
the *primal*), then one differential per primal assignment, each written with the tangents of the
values it reads (``autodiff.differentials``): as many small values as the first schedule has, none
of them written out in full. A constant (the additive mask M) does not move; the gradient the first
schedule gives it (dM) moves, and its tangent is ∂f₂/∂M.

Names: the first backward's values are renamed G_… (dQ → G_Q, t1 → G_t1, the seed grad_out → G_out,
as f₂'s spec names them); the tangent of a primal value N is dN, except the tangent of G_x (x an input
or a constant), which is f₂'s gradient dx, and the tangent of the first output, which is dG_out.
"""

from __future__ import annotations

import sympy as sp
from sympy import Basic, MatrixSymbol

from symattn.autodiff.differentials import differential
from symattn.codegen.schedule.build import Schedule, _needed, _simplified, finished, gradient_symbol
from symattn.codegen.schedule.dag import Assignment
from symattn.codegen.schedule.passes import stack_products
from symattn.lang.algebra import total
from symattn.lang.graph import matrix_symbols
from symattn.lang.naming.names import fresh_name
from symattn.specs.second_order import SecondOrder, inner

__all__ = ["tangent_schedule"]


def tangent_schedule(first: Schedule, so: SecondOrder) -> Schedule:
    """f₂'s schedule: the first schedule as its forward, the tangents of its gradients as its gradients."""
    spec = so.spec
    cotangent = next(x for x in spec.inputs if str(x.name) == so.cotangent)
    firsts = dict(first.gradients) | dict(first.constant_gradients)  # the first schedule's gradient names
    first_gradient = {x: firsts[str(x.name)] for x in (*first.spec.inputs, *first.spec.constants)}
    names = {str(x.name) for x in (*spec.inputs, *spec.constants)} | {str(a.target.name) for a in first.forward}
    own = {x: gradient_symbol(x, names) for x in (*first.spec.inputs, cotangent, *first.spec.constants)}
    taken = names | {str(g.name) for g in own.values()}  # every name f₂'s module knows
    primal, renamed = _primal(first, cotangent, taken)
    directions = {x: next(v for v in spec.inputs if str(v.name) == name) for x, name in _inputs(first, so)}
    value = MatrixSymbol(_fresh("f2", taken), 1, 1)
    terms = [inner(v, renamed[first_gradient[x]]) for x, v in directions.items()]
    primal.append(Assignment(value, total(*terms) if len(terms) > 1 else terms[0]))

    outputs = {renamed[g]: own[x] for x, g in first_gradient.items() if g in renamed}
    outputs[renamed[first.output]] = own[cotangent]
    tangents: dict[Basic, Basic] = dict(directions)
    values = []
    for a in primal[:-1]:
        # the tangents of what this value reads, not all of them (SymPy's has() tries each one it is given)
        reads = [*matrix_symbols(a.value), *(x for x in a.value.free_symbols if x in directions)]
        d = differential(a.value, {x: tangents[x] for x in reads if x in tangents})
        if d is None or getattr(d, "is_ZeroMatrix", False):
            continue
        target = outputs.get(a.target) or MatrixSymbol(_fresh("d" + str(a.target.name), taken), *a.target.shape)
        tangents[a.target] = target
        values.append(Assignment(target, d, a.reduce_batch))
    values = _simplified(values, primal, write_out=False)
    # Ȧ = c·Q K_vᵀ + c·Q_v Kᵀ as one product c·[Q | Q_v] [K_v | K]ᵀ: the n × m tangent written once
    weights = set(first.weights) | {str(v.name) for x, v in directions.items() if str(x.name) in first.weights}
    values = stack_products(values, frozenset(weights), taken | {str(a.target.name) for a in values}, tuple(primal))
    made = {a.target for a in values}
    for symbol in own.values():  # a gradient no tangent reaches is 0
        if symbol not in made:
            values.append(Assignment(symbol, sp.ZeroMatrix(*symbol.shape)))
    gradients = [(str(x.name), own[x]) for x in (*first.spec.inputs, cotangent)]
    constant_gradients = [(str(c.name), own[c]) for c in first.spec.constants]
    computed = {a.target for a in primal}
    read = {x for a in values for x in matrix_symbols(a.value) if x in computed}
    needed = _needed(primal, {value} | read)
    forward = [a for a in primal if a.target in needed]
    return finished(spec, first.options, forward, value, first.seed, values, {}, gradients, constant_gradients)


def _inputs(first: Schedule, so: SecondOrder) -> list[tuple[Basic, str]]:
    """(input, the name of its direction) for every input of the first spec."""
    names = dict(so.directions)
    return [(x, names[str(x.name)]) for x in first.spec.inputs]


def _primal(first: Schedule, cotangent: MatrixSymbol, taken: set[str]) -> tuple[list[Assignment], dict[Basic, Basic]]:
    """The first schedule's forward and backward assignments, its named scalar constants written out (f₂'s
    schedule names its own), the backward's values renamed G_… and the seed G_out; and the renaming.

    taken: the names in use, to which the forward's and the new ones are added (no value shadows another)."""
    constants = {symbol: value for symbol, value in first.constants}
    taken.update(str(a.target.name) for a in first.forward)
    renamed: dict[Basic, Basic] = {first.seed: cotangent}
    for a in first.backward:
        name = str(a.target.name)
        label = _fresh("G_" + (name[1:] if name.startswith("d") else name), taken)
        renamed[a.target] = MatrixSymbol(label, *a.target.shape)
    table = constants | renamed
    primal = [Assignment(a.target, a.value.xreplace(constants), a.reduce_batch) for a in first.forward]
    primal += [Assignment(renamed[a.target], a.value.xreplace(table), a.reduce_batch) for a in first.backward]
    renamed.update({a.target: a.target for a in first.forward})
    return primal, renamed


def _fresh(name: str, taken: set[str]) -> str:
    """name, or name_2, name_3, … when taken; the name returned is taken from then on."""
    candidate = fresh_name(name, taken, bare=True, first=2, sep="_")
    taken.add(candidate)
    return candidate
