"""Schedules: a spec's forward and backward pass as named assignments in order.

``schedule(name)`` derives the spec's gradients and hash-conses forward values,
cotangents and gradients into one DAG in which every shared subexpression has a
name and is computed once:

- forward values are the spec's intermediates (S, A, P, O, …), each written with
  the earlier names (products are matched as contiguous runs of factors, so
  Q Kᵀ is found inside scale·X W_Q W_Kᵀ Xᵀ), plus the output;
- backward values are the cotangents of those intermediates (dP, dA, …), named
  "d" + the intermediate, then any other subexpression used twice, then the
  gradient of every input (dQ, dW_Q, …);
- the forward values the backward reads are saved once.

A transposed use of a named value is found too (dAᵀ inside the gradient of K).
Printers turn each assignment into code; templates only lay the lines out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixSymbol
from sympy.matrices.expressions import MatMul

from symattn.autodiff.grad import backward
from symattn.autodiff.scalars import as_matrix, is_scalar_input
from symattn.codegen.schedule.consistency import check_products
from symattn.codegen.schedule.dag import Assignment, expand, is_scaled_name, is_trivial, is_weight
from symattn.codegen.schedule.naming import (
    inline_products,
    name_constants,
    name_forward_values,
    name_product_runs,
    name_row_sums,
    save_entrywise_outputs,
)
from symattn.codegen.schedule.passes import (
    fold_scalar_multiples,
    fuse_projections,
    hoist_hadamard_scalars,
    inline_aliases,
    reassociate_products,
    save_forward_values,
    unshared_constant_gradients,
)
from symattn.codegen.schedule.sharing import order, product_name, share
from symattn.lang.algebra import factors, product, total, transpose
from symattn.lang.dims import Binding, bind_dimensions
from symattn.lang.graph import matrix_symbols, nodes
from symattn.lang.naming.names import Names, differential_name
from symattn.lang.ops import RowWise
from symattn.lang.positions import require_constant_indices, require_per_head_reads, sequence_tables
from symattn.optimize.cost import flops_value
from symattn.optimize.rewrites import sort_commutative
from symattn.optimize.simplify import rewrite, simplify
from symattn.specs import Option, Spec, family
from symattn.specs.layers import named_layers
from symattn.specs.spec import drawn_options

__all__ = ["Assignment", "Binding", "Option", "Schedule", "is_weight", "schedule"]


def simplifier(given: list[Basic]) -> Callable[[Basic], Basic]:
    """symattn.optimize.simplify.simplify with the forward values free (when present), products flattened.

    Flattening undoes the simplifier's placement of scalars inside products, so that
    the forward names still match; the printers place scalars on the smallest factor.
    """
    return lambda expr: expand(simplify(expr, given=given), {})


SEED = "grad_out"  # name of the output's cotangent in generated code
SORTED = (sort_commutative,)  # the rule that puts every sum's terms and entrywise product's factors in one order


@dataclass(frozen=True)
class Schedule:
    """A spec's generated forward and backward passes."""

    spec: Spec
    options: tuple[Option, ...]
    bindings: tuple[Binding, ...]
    weights: frozenset[str]
    forward: tuple[Assignment, ...]
    output: MatrixSymbol
    saved: tuple[Basic, ...]
    seed: MatrixSymbol
    backward: tuple[Assignment, ...]
    gradients: tuple[tuple[str, MatrixSymbol], ...]
    constants: tuple[tuple[sp.Symbol, Basic], ...] = ()
    # inputs that may be absent (None at run time): the biases and the additive mask M of an extended schedule
    optional: frozenset[str] = frozenset()
    # the gradients of the constants (dM of the additive mask M): a float attn_mask receives its gradient
    constant_gradients: tuple[tuple[str, MatrixSymbol], ...] = ()
    # inputs that receive no gradient: a user spec's fixed constants (a positional table), passed after the inputs
    fixed: frozenset[str] = frozenset()
    # a forward mode's schedule (schedule.forward_mode): each input's and forward value's tangent
    tangents: tuple[tuple[Basic, Basic], ...] = ()
    # the names of the user's spec's inputs, then its constants, in the order Spec lists them: the order the
    # generated forward takes them in (the fixed constants are among ``inputs`` here, the mask among constants);
    # () for a derived schedule (second order, forward mode), whose order is its spec's
    order: tuple[str, ...] = ()
    # the user's spec's ``bool_forms``: how a bool array passed for a constant becomes it (by constant name)
    bool_forms: tuple[tuple[str, str], ...] = ()

    @property
    def inputs(self) -> tuple[MatrixSymbol, ...]:
        return self.spec.inputs

    @property
    def scalar_inputs(self) -> frozenset[str]:
        """The names of the trainable scalars (0-d; their gradients are computed 1 × 1)."""
        return frozenset(str(x.name) for x in self.spec.inputs if not isinstance(x, MatrixSymbol))

    @property
    def mask(self) -> MatrixSymbol | None:
        """The additive mask M (the constant that may be absent: built at run time from the mask keywords), or None."""
        return next((c for c in self.spec.constants if str(c.name) in self.optional), None)


def _sweep(
    forward: list[Assignment], inputs: tuple, seed: MatrixSymbol, taken: frozenset[str], parameters=None
) -> tuple[list[Assignment], dict[Basic, str]]:
    """Reverse mode over the named forward assignments, one VJP per assignment.

    Returns the backward assignments (cotangent d<name> of each intermediate that
    receives one, and the gradient of each input; ``gradient_symbol`` against the spec's
    names, taken) and names for the cotangents of unnamed interior products (dQW_Q for
    Q W_Q inside split_heads(Q W_Q)).
    """
    named = Names()
    for a in forward:
        named.add(a.value, a.target)
    contributions: dict[Basic, list[Basic]] = {forward[-1].target: [seed]}
    targets = {a.target for a in forward}
    interior: dict[Basic, str] = {}
    assignments: list[Assignment] = []

    def collect(target: MatrixSymbol) -> Basic | None:
        terms = contributions.pop(target, [])
        if not terms:
            return None
        value = terms[0] if len(terms) == 1 else total(*terms)
        # an input's gradient is always assigned (dB = dA); a scaled name (dP₂ = −λ dD) is no value: the VJP
        # that reads it runs on dD, and −λ multiplies what it gives (below)
        if (is_trivial(value) or is_scaled_name(value)) and target not in inputs:
            return value
        scale, mats = factors(value) if isinstance(value, MatMul) else (1, ())
        if scale != 1 and len(mats) == 1 and target not in inputs:  # c·E: E is named, c multiplies its VJPs
            unscaled = MatrixSymbol(differential_name(f"{target.name}_unscaled", taken), *target.shape)
            assignments.append(Assignment(unscaled, mats[0]))
            return product(scale, unscaled)
        symbol = gradient_symbol(target, taken)
        # a weight's gradient is summed over the batch (an intermediate labelled W_h is no weight)
        assignments.append(Assignment(symbol, value, reduce_batch=is_weight(target, parameters) and target in inputs))
        return symbol

    scalars = [x for x in inputs if is_scalar_input(x)]
    for a in reversed(forward):
        g = collect(a.target)
        if g is None:
            continue
        wrt = [x for x in matrix_symbols(a.value) if x in inputs or x in targets]
        wrt += [x for x in scalars if x in a.value.free_symbols]
        # a VJP is linear in its cotangent: for g = c·Y (dP₂ = −λ dD) it runs on Y and c multiplies what it gives
        scale, (g,) = factors(g) if is_scaled_name(g) else (sp.Integer(1), (g,))
        tape = backward(a.value, wrt, g)
        for node, cot in tape.cotangents.items():
            if isinstance(node, (MatMul, sp.MatAdd)) and node not in wrt and product_name(node) and scale == 1:
                interior[named.substitute(cot)] = product_name(node)
        for x in wrt:
            if x in tape.cotangents:
                found = tape.gradients[x]  # a scalar's: tr(dAᵀ S) as 𝟏ᵀ (dA ⊙ S) 𝟏
                found = named.substitute(as_matrix(found) if x in scalars else found)
                contributions.setdefault(x, []).append(product(scale, found) if scale != 1 else found)
    for x in inputs:
        if contributions.get(x):
            collect(x)
        else:
            symbol = gradient_symbol(x, taken)
            assignments.append(Assignment(symbol, sp.ZeroMatrix(*symbol.shape)))
    return assignments, interior


def gradient_symbol(x: Basic, taken: Collection[str] = frozenset()) -> MatrixSymbol:
    """d<name> (``names.differential_name`` against taken, the spec's names), of x's shape; a trainable
    scalar's gradient is computed as a 1 × 1 matrix."""
    return MatrixSymbol(differential_name(str(x.name), taken), *getattr(x, "shape", (1, 1)))


def _simplified(
    backward_values: list[Assignment], forward: list[Assignment], write_out: bool = True
) -> list[Assignment]:
    """Each value with the cotangents it reads written out, simplified, renamed: kept if cheaper.

    This is where rowsum(dP ⊙ P) becomes rowsum(dO ⊙ O): the simplifier sees
    dP = dO Vᵀ and that O = P V is at hand. ``write_out=False``: each value simplified as it is, with
    the forward values at hand only (f₂'s tangents, each small).
    """
    leaves = {a.value: matrix_symbols(a.value) for a in forward}
    names = Names()
    for a in forward:
        names.add(a.value, a.target)
    definitions = {}
    for b in backward_values if write_out else ():
        if not b.reduce_batch:  # a weight's gradient is summed over the batch: no name for its per-batch value
            names.add(b.value, b.target)
        definitions[b.target] = b.value
        definitions[b.target.T] = transpose(b.value)
    targets = {b.target for b in backward_values}
    reads = {b.target: matrix_symbols(b.value) & targets for b in backward_values}  # the values as they stand
    out = []
    for b in backward_values:
        value = expand(b.value, definitions) if write_out else b.value
        # a forward value can be reused only if its leaves occur in the value (O = P V in rowsum(dO Vᵀ ⊙ P))
        within = matrix_symbols(value)
        simplify = simplifier([v for v, symbols in leaves.items() if symbols <= within])
        candidate = names.substitute(simplify(value), skip=b.value)
        # a candidate that reads its own name, directly (dT = dTᵀᵀ, its value's double transpose found) or through
        # another value that reads it (dU₂ = −ddU where ddU = −dU₂: each found as the other's negation), is no value
        cheaper = candidate != b.value and flops_value(candidate) < flops_value(b.value)
        if cheaper and not _reaches(matrix_symbols(candidate) & targets, b.target, reads):
            b = Assignment(b.target, candidate, b.reduce_batch)
            reads[b.target] = matrix_symbols(candidate) & targets
        out.append(b)
    return out


def _reaches(start: set, target: Basic, reads: dict) -> bool:
    """Does target occur among the names start, or among the names they read (reads: name → the names its value
    reads), transitively?"""
    seen, stack = set(), list(start)
    while stack:
        name = stack.pop()
        if name == target:
            return True
        if name not in seen:
            seen.add(name)
            stack += reads.get(name, ())
    return False


@functools.cache
def schedule(name: str, extended: bool = False, configuration: tuple = ()) -> Schedule:
    """The schedule of the built-in spec called name with its options as symbols.

    extended: with every optional part on (mask, biases; see ``Family.generated_options``),
    as the generated modules of a family with ``masks`` compute it; configuration: (option, value) pairs
    choosing one of the family's configurations (``Family.configured``; none: the default one).
    """
    return schedule_spec(*family(name).generated_spec(extended, configuration))


def schedule_spec(s: Spec, options: tuple[Option, ...] = ()) -> Schedule:
    """The forward and backward schedule of a spec; options are its symbolic keyword options.

    The spec's additive mask M (``split_constants``) and, when M is present, the inputs named b_…
    are optional: the generated code skips a term whose input is None. Its other constants are
    inputs that receive no gradient (``Schedule.fixed``): nothing is differentiated with respect to them.
    """
    options = (*options, *drawn_options(s, options))  # training, where the spec drops out
    order = tuple(str(x.name) for x in (*s.inputs, *s.constants))
    bool_forms = tuple(s.bool_forms.items())
    mask, fixed = split_constants(s)
    require_constant_indices(s.name, s.output, s.inputs)
    if fixed:
        masks = (mask,) if mask is not None else ()
        s = Spec(
            s.name, s.summary, (*s.inputs, *fixed), s.output, s.intermediates, s.options, s.dims, masks, s.parameters
        )
    s = named_layers(s)  # a deep spec written as one expression: its layers named H1, H2, …
    seed = MatrixSymbol(SEED, *s.output.shape)

    # Forward: the spec's intermediates in order, then the output.
    names = Names()
    forward: list[Assignment] = []
    intermediates = list(s.intermediates)
    if all(e is not s.output for _, e in intermediates):  # hash-consed specs: equal is the same object
        taken = {str(x.name) for x in (*s.inputs, *s.constants)} | {label for label, _ in intermediates}
        label = next(
            name for name in ("Y", "Z", "Out", *(f"Out{i}" for i in range(len(taken) + 1))) if name not in taken
        )
        intermediates.append((label, s.output))  # a name no input has: the output must not overwrite one
    for label, expr in intermediates:
        target = MatrixSymbol(label, *expr.shape)
        forward.append(Assignment(target, names.substitute(expr)))
        names.add(expr, target)
    output = names.table[s.output]
    trainable = frozenset(x for x in s.inputs if is_scalar_input(x))
    forward, labels = inline_products(forward, {output})
    taken = {str(x.name) for x in (*s.inputs, *s.constants)}  # and the forward's (an inlined product's label is free)
    forward = name_forward_values(forward, taken, trainable, labels)
    forward = _needed_forward(fold_scalar_multiples(forward, {output}, trainable), output)
    forward = name_product_runs(forward, taken, labels)

    # Backward: one VJP per forward assignment, then the simplifier's cheaper forms.
    taken = spec_names(s) | {str(a.target.name) for a in forward}
    differentiated = tuple(x for x in s.inputs if x not in fixed)
    backward_values, interior = _sweep(forward, (*differentiated, *s.constants), seed, taken, s.parameters)
    backward_values = _simplified(backward_values, forward)
    gradients = [(str(x.name), gradient_symbol(x, taken)) for x in differentiated]
    constant_gradients = [(str(c.name), gradient_symbol(c, taken)) for c in s.constants]
    sched = finished(s, options, forward, output, seed, backward_values, interior, gradients, constant_gradients)
    if not fixed:
        return dataclasses.replace(sched, order=order, bool_forms=bool_forms)
    # unbatched, like the weights (a positional table, (n, d)), but a table read at positions (per-token ids): batched
    read = sequence_tables(s.output)
    require_per_head_reads(s.name, s.output, read & frozenset(fixed))
    names = frozenset(str(x.name) for x in fixed)
    unbatched = frozenset(str(x.name) for x in fixed if x not in read)
    return dataclasses.replace(
        sched, fixed=names, weights=sched.weights | unbatched, order=order, bool_forms=bool_forms
    )


def split_constants(s: Spec) -> tuple[MatrixSymbol | None, tuple[MatrixSymbol, ...]]:
    """(the additive mask, the fixed constants) of a spec.

    The mask M is the first constant added as a term to the argument of a softmax (or another row-wise function:
    log-softmax), of the scores' shape, and
    used nowhere else: generated code builds it from attn_mask, key_padding_mask and causal (a float
    attn_mask receives its gradient). Every other constant (a positional table, a fixed matrix multiplied
    in, ALiBi's distances) is a fixed argument: passed after the inputs, read as it is, no gradient.
    """
    uses: dict = {c: [] for c in s.constants}  # constant → the nodes that take it as an argument
    scores: set = set()  # the sums a softmax takes, and the sums nested in them
    # (the output's nodes: an intermediate's sum that SymPy flattened into the scores' is no node of the output)
    for node in nodes(s.output):
        if isinstance(node, RowWise):
            stack = [node.arg]
            while stack:
                e = stack.pop()
                if isinstance(e, sp.MatAdd) and e not in scores:
                    scores.add(e)
                    stack.extend(e.args)
        for a in getattr(node, "args", ()):
            if a in uses:
                uses[a].append(node)
    # the mask is built n × m: n the first input's rows, m another input's (the keys')
    rows = {x.shape[0] for x in s.matrix_inputs}

    def is_mask(c: MatrixSymbol) -> bool:
        fits = bool(s.matrix_inputs) and c.shape[0] == s.matrix_inputs[0].shape[0] and c.shape[1] in rows
        return fits and bool(uses[c]) and all(u in scores and u.shape == c.shape for u in uses[c])

    mask = next((c for c in s.constants if is_mask(c)), None)
    return mask, tuple(c for c in s.constants if c is not mask)


def spec_names(s: Spec) -> frozenset[str]:
    """Every name the spec gives: its inputs, constants and intermediates."""
    return frozenset(str(x.name) for x in (*s.inputs, *s.constants)) | {label for label, _ in s.intermediates}


def finished(
    s: Spec,
    options: tuple[Option, ...],
    forward: list[Assignment],
    output: MatrixSymbol,
    seed: MatrixSymbol,
    backward_values: list[Assignment],
    interior: dict[Basic, str],
    gradients: list[tuple[str, MatrixSymbol]],
    constant_gradients: list[tuple[str, MatrixSymbol]],
) -> Schedule:
    """The schedule of a forward pass and its backward values (each simplified): shared values named, row
    sums and scalar constants named, projections fused, the values the gradients do not read dropped and what
    the backward reads saved. ``interior``: labels of shared cotangents (dQW_Q)."""
    trainable = frozenset(x for x in s.inputs if is_scalar_input(x))
    # Any other subexpression used twice gets a name and is computed once (products in their cheapest order first).
    backward_values = reassociate_products(backward_values)
    # sums and entrywise products in one order (SymPy's keys), so that A + B named in one value and B + A
    # in another are found equal: the order a value's terms had before names replaced them is no longer sorted
    backward_values = [Assignment(a.target, rewrite(a.value, SORTED), a.reduce_batch) for a in backward_values]
    taken = frozenset(str(x.name) for x in (*s.inputs, *s.constants, *(a.target for a in forward)))
    backward_values = share(backward_values, interior, taken)
    backward_values = order(name_row_sums(backward_values, taken))
    forward, backward_values = save_entrywise_outputs(forward, hoist_hadamard_scalars(backward_values), taken)
    forward, backward_values = save_forward_values(forward, backward_values, seed)
    outputs = {t for _, t in (*gradients, *constant_gradients)}

    # Keep what the gradients read; save what the backward reads.
    needed = _needed(backward_values, outputs)
    backward_values = [a for a in backward_values if a.target in needed]
    names = {str(x.name) for x in (*s.inputs, *s.constants, *(a.target for a in (*forward, *backward_values)))}
    constants, forward, backward_values = name_constants(forward, backward_values, {o.symbol for o in options} | names)
    forward, backward_values = fuse_projections(forward, backward_values, s.parameters)
    # dW_QKV after dQ, dK, dV whatever the order before; t = X read as X
    backward_values = order(inline_aliases(backward_values, outputs))
    constant_outputs = {t for _, t in constant_gradients}
    backward_values = unshared_constant_gradients(backward_values, constant_outputs, frozenset(names))
    forward_targets = {a.target for a in forward}
    read_back = set().union(*(a.value.free_symbols for a in backward_values)) - {a.target for a in backward_values}
    saved_inputs = [x for x in s.inputs if x in read_back]
    saved_values = [a.target for a in forward if a.target in read_back and a.target in forward_targets]
    scalars = sorted((x for x in read_back if isinstance(x, sp.Symbol) and x not in trainable), key=str)
    check_products(forward, "forward")
    check_products(backward_values, "backward")
    return Schedule(
        spec=s,
        options=options,
        bindings=tuple(bind_dimensions(s.matrix_inputs, {o.symbol for o in options})),
        weights=frozenset(str(x.name) for x in s.inputs if is_weight(x, s.parameters)),
        forward=tuple(forward),
        output=output,
        saved=(*saved_inputs, *saved_values, *scalars),
        seed=seed,
        backward=tuple(backward_values),
        gradients=tuple(gradients),
        constants=constants,
        optional=_optional(s),
        constant_gradients=tuple(constant_gradients),
    )


def _optional(s: Spec) -> frozenset[str]:
    """The inputs a generated module may be called without: the constants, and the biases next to them."""
    constants = {str(c.name) for c in s.constants}
    if not constants:
        return frozenset()
    biases = {str(x.name) for x in s.inputs if str(x.name).startswith("b_")} if s.parameters is None else set()
    return frozenset(constants | biases)


def _needed_forward(forward: list[Assignment], output: MatrixSymbol) -> list[Assignment]:
    """The forward assignments the output depends on (S disappears once folded into A)."""
    keep = _needed(forward, {output})
    return [a for a in forward if a.target in keep]


def _needed(assignments: list[Assignment], roots: set) -> set:
    """Targets the roots depend on, the roots included."""
    by_target = {a.target: a for a in assignments}
    needed: set = set()
    stack = list(roots)
    while stack:
        t = stack.pop()
        if t in needed:
            continue
        needed.add(t)
        stack.extend(x for x in matrix_symbols(by_target[t].value) if x in by_target)
    return needed
