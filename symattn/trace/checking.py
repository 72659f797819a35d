"""``check_backward``: is a hand-written torch backward right? Checked against the traced spec's closed form.

The user's backward takes the forward's arguments and the output's cotangent G, ``backward(*args, G)`` (for a
module, ``backward(module, *args, G)``), and returns the gradients of f = ⟨G, forward(*args)⟩: a dict by
the spec's input names, or a tuple in the spec's input order (the float arguments, then the module's
parameters in state_dict order), each in the tensor's own layout. At each trial the sizes the parameters do
not fix are drawn anew (the first trial small and pairwise different, as ``check`` does), entries are standard
normal rounded to one decimal, leading batch axes have length 1, and each gradient is compared with the
closed form ``derive`` gives (evaluated in float64 by symattn's own evaluator, not by torch) within check's
TOLERANCE · max(1, max|true|). The verdict per input is check's: right (evidence: every trial finite and
within tolerance), wrong (a counterexample: the sizes, the inputs, the claimed and true values), or cannot
be checked (a non-finite value, or the backward failed to run at some trial).
"""

from __future__ import annotations

import copy

import numpy as np
import sympy as sp

from symattn.autodiff.grad import default_seed
from symattn.derive.check import RIGHT, TOLERANCE, UNDECIDED, WRONG, CheckResult, Counterexample, true_gradient
from symattn.errors import SymattnError
from symattn.lang.naming.names import Names
from symattn.lang.piecewise import draws
from symattn.numeric.dag import DagValues
from symattn.numeric.verify import evaluate_finite

SIZES = (2, 9)  # the range a free dimension is drawn from (sizes stay small: the truth is evaluated exactly)


def check_backward(fn, backward, *example_inputs, trials: int = 5, seed: int = 0) -> dict[str, CheckResult]:
    """Each input's verdict on ``backward`` (see the module docstring), by the spec's input names."""
    import torch

    from symattn.trace.source import block_sources, trace

    first = trace(fn, example_inputs)
    blocks = block_sources(first)
    s = first.spec
    if draws(s.output):  # the truth would hold one fixed mask, the user's backward another
        raise SymattnError(
            "check_backward: the traced function drops out while training (a random mask); check it "
            "in eval() or with p = 0"
        )
    module = fn if isinstance(fn, torch.nn.Module) else None
    fixed = _fixed_sizes(first, fn, module, example_inputs)
    rng = np.random.default_rng(seed)
    truths = {name: true_gradient(s, name) for name in s.input_names}
    refuted: dict[str, Counterexample] = {}
    trouble: dict[str, str] = {}
    for trial in range(trials):
        args, target, sizes = _point(fn, module, example_inputs, first, fixed, rng, trial == 0)
        traced = trace(target, args)  # the constants (masks) at these sizes
        values = _values(traced, target, args, rng, s)
        claimed, failure = _claimed(backward, target, module, args, values, s)
        for name, (parent, axis, a, b) in blocks.items():  # a fused parameter's gradient given whole: its blocks
            if name not in claimed and parent in claimed and np.ndim(claimed[parent]) == 2:
                claimed[name] = claimed[parent][:, a:b] if axis == -1 else claimed[parent][a:b, :]
        dims = {str(d): v for d, v in sizes.items()}
        for name in (n for n in s.input_names if n not in refuted):
            truth, problem = evaluate_finite(DagValues(values, dims).value, [truths[name]])
            got = None if failure else claimed.get(name)
            if failure or problem or got is None or not np.all(np.isfinite(got)):
                trouble.setdefault(name, failure or (f"the closed form {problem}" if problem else "no finite gradient"))
                continue
            truth = np.asarray(truth, dtype=float)
            truth = truth.reshape(got.shape) if truth.size == got.size else truth
            example = Counterexample(dims, {str(k.name): v for k, v in values.items()}, got, truth)
            if got.shape != truth.shape or example.max_error > TOLERANCE * max(1.0, float(np.max(np.abs(truth)))):
                refuted[name] = example
    claim, names = sp.Symbol(_label(backward)), Names(s.intermediates)

    def verdict(name: str) -> CheckResult:
        if name in refuted:
            status, reason = WRONG, "it differs from the closed form at the values below"
        elif name in trouble:
            status, reason = UNDECIDED, f"{trouble[name]}, and no trial refuted it"
        else:
            status, reason = (
                RIGHT,
                f"it agrees with the closed form at {trials} random points (tolerance {TOLERANCE:.0e})",
            )
        return CheckResult(s.name, name, claim, truths[name], status, reason, refuted.get(name), names)

    return {name: verdict(name) for name in s.input_names}


def _label(backward) -> str:
    name = getattr(backward, "__qualname__", getattr(backward, "__name__", "backward"))
    return name.replace("<", "").replace(">", "").replace(".", "_") or "backward"


def _fixed_sizes(first, fn, module, examples) -> dict:
    """The dimensions that stay the example's: a module's parameters fix theirs; a mask argument its own."""
    from symattn.trace.constants import sizes_of, spec_layout
    from symattn.trace.source import spec_tensors

    fixed: dict = {}
    if module is not None:
        params = spec_tensors(first, [module.get_parameter(p) for p in first.parameters], len(first.arguments))
        params = [spec_layout(p) for p in params]
        symbols = first.spec.matrix_inputs[len(first.spec.matrix_inputs) - len(params) :]
        fixed = sizes_of(_Inputs(symbols), params)
    if first.constants:  # a mask's dimensions: the example's (a mask argument is not resized)
        everything = sizes_of(first.spec, [spec_layout(t) for t in _tensors(first, fn, examples)])
        for c in first.constants:
            for length in c.symbol.shape:
                for d in sp.sympify(length).free_symbols:
                    fixed[d] = everything[d]
    return fixed


class _Inputs:
    """The part of a spec sizes_of reads: its matrix inputs."""

    def __init__(self, symbols) -> None:
        self.matrix_inputs = tuple(symbols)


def _point(fn, module, examples, first, fixed, rng, small: bool):
    """New arguments (and a module copy with new parameters) at newly drawn sizes; the sizes."""
    import torch

    dims = sorted({d for x in first.spec.matrix_inputs for n in x.shape for d in sp.sympify(n).free_symbols}, key=str)
    free = [d for d in dims if d not in fixed]
    drawn = rng.permutation(np.arange(2, 2 + len(free))) if small else rng.integers(SIZES[0], SIZES[1] + 1, len(free))
    sizes = {**fixed, **{d: int(v) for d, v in zip(free, drawn)}}

    def tensor(symbol, like) -> torch.Tensor:
        rows, cols = (int(sp.sympify(n).xreplace(sizes)) for n in symbol.shape)
        shape = () if like.ndim == 0 else (cols,) if like.ndim == 1 else (*([1] * (like.ndim - 2)), rows, cols)
        return torch.tensor(rng.standard_normal(shape).round(1), dtype=torch.float64)

    symbols = iter(first.spec.inputs)
    args = []
    for e in examples:
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            symbol = next(symbols)
            args.append(tensor(symbol, e) if e.ndim else torch.tensor(rng.standard_normal().round(1)))
        else:
            args.append(e)
    target = fn
    if module is not None:
        target = copy.deepcopy(module)
        with torch.no_grad():
            for name in first.parameters:
                p = target.get_parameter(name)
                p.copy_(torch.tensor(rng.standard_normal(tuple(p.shape)).round(1), dtype=p.dtype))
    return tuple(args), target, sizes


def _values(traced, target, args, rng, s) -> dict:
    """The spec's leaves at this point: inputs (2-D, batch axes of length 1 dropped), constants, G."""
    from symattn.trace.constants import sizes_of, spec_layout, spec_value
    from symattn.trace.source import bound_arguments

    tensors = _tensors(traced, target, args)
    layouts = [spec_layout(t) for t in tensors]
    sizes = sizes_of(traced.spec, layouts)
    values: dict = {}
    for symbol, t in zip(s.inputs, layouts):
        a = t.detach().numpy()
        values[symbol] = float(a) if a.ndim == 0 else a.reshape(a.shape[-2:])
    buffers = dict(target.named_buffers()) if hasattr(target, "named_buffers") else {}
    raw = traced.program.replay(
        tuple(bound_arguments(target, args).values()), buffers, [c.ref for c in traced.constants]
    )
    for mine, c, tensor in zip(s.constants, traced.constants, raw):
        value = spec_value(c, tensor, layouts[0].dtype, sizes).numpy()
        if value[..., 0, 0].size != 1:  # the points have one sequence (leading axes of length 1)
            raise SymattnError(
                f"check_backward: the constant {mine} has {value[..., 0, 0].size} sequences at a point of one (a "
                "constant per sequence): check the backward of one sequence's forward"
            )
        values[mine] = value.reshape(value.shape[-2:])
    seed = default_seed(s.output, None)
    rows, cols = (int(sp.sympify(n).xreplace(sizes)) for n in seed.shape)
    values[seed] = rng.standard_normal((rows, cols)).round(1)
    return values


def _tensors(traced, target, args) -> list:
    from symattn.trace.source import bound_arguments, spec_tensors

    bound = bound_arguments(target, args)
    found = [bound[n] for n in traced.arguments]
    return spec_tensors(traced, found + [target.get_parameter(p) for p in traced.parameters])


def _claimed(backward, target, module, args, values, s) -> tuple[dict, str]:
    """The user's gradients at this point, by input name, as 2-D arrays (or numbers); or why none."""
    import torch

    with torch.no_grad():
        out = target(*args)
    g = torch.tensor(values[default_seed(s.output, None)]).reshape(out.shape)
    try:
        got = backward(target, *args, g) if module is not None else backward(*args, g)
    except Exception as err:  # the user's code: any failure makes the point undecided
        return {}, f"the backward raised {type(err).__name__}: {err}"
    if not isinstance(got, dict):
        got = dict(zip(s.input_names, got))
    claimed = {}
    for name, value in got.items():
        if value is None:
            continue
        a = np.asarray(value.detach().numpy() if isinstance(value, torch.Tensor) else value, dtype=float)
        claimed[str(name).replace(".", "_")] = a if a.ndim == 0 else a.reshape((1, -1) if a.ndim == 1 else a.shape[-2:])
    return claimed, ""
