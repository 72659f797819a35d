"""Random specs over the whole language of CONTRACT.md, each with an independently written torch forward.

``random_case(seed)`` draws one spec: inputs with any identifier as a name (``dX`` beside ``X``, ``t1``,
``out``), batched inputs beside parameters (``W_…``, ``b_…``, no batch dimensions), trainable scalars,
and a DAG of every node of the language: products (with transposes), sums and differences, scalar
multiples (numbers, 1/√d, τ, exp(τ), 1/τ, τ²), softmax, exp, log, tanh, sigmoid, Hadamard products
(``sa.hadamard`` and SymPy's ``HadamardProduct``), ``sa.rowsum``, ``sa.sum`` and ``Trace`` as scalar
factors, ``Identity`` and ``OneMatrix`` (a bias broadcast along rows), named intermediates with any
label (``dY`` beside an input ``Y``), and an output that may be transposed.

The torch forward is built from the same random choices with torch's own operations, never from
symattn's expression: it is what the generated modules are compared with (values and autograd).
"""

from __future__ import annotations

import random
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import sympy as sp

import symattn as sa
from symattn.errors import SymattnError
from symattn.specs import dim

SIZES = {"n": 4, "d": 3, "m": 5}
BATCH = (2,)
DIMS = {name: dim(name) for name in SIZES}
MATRIX_NAMES = ["X", "Y", "Z", "U", "dX", "dY", "dZ", "t1", "out", "Q", "K", "V", "P", "S", "x_in", "dQ"]
PARAMETER_NAMES = ["W_Q", "W_K", "W_1", "W_O", "W_dX", "b_1", "b_Q"]
SCALAR_NAMES = ["tau", "lam"]
CONSTANTS = {"E_pos": ("n", "d"), "C": ("d", "d"), "Dist": ("n", "n")}  # fixed matrices, no batch dimensions
# every node and form of the language (products thrice as likely: the shapes stay interesting)
OPS = (
    "matmul matmul matmul transpose add sub scale neg softmax exp log tanh sigmoid hadamard rowsum sum_factor "
    "trace_factor identity bias"
).split()
LABELS = [
    "S",
    "A",
    "P",
    "H",
    "T",
    "O",
    "D",
    "Y",
    "dX",
    "dY",
    "dQ",
    "dS",
    "t1",
    "t2",
    "c1",
    "f2",
    "Z2",
    "G_X",
    "W_h",
    "b_x",
]


@dataclass
class Term:
    """A value of the spec: its SymPy expression, its torch function of the inputs, its shape (dimension names)."""

    expr: sp.Basic
    torch: Callable[[dict], object]
    shape: tuple[str, str]


@dataclass
class Case:
    seed: int
    spec: sa.Spec
    reference: Callable[..., object]  # torch forward of the inputs, in spec order
    shapes: list[tuple[int, ...]]  # concrete shapes of the inputs, batch dimensions included ((), a scalar)
    description: str = ""
    kinds: list[str] = field(default_factory=list)
    constants: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (name, concrete shape)


def _concrete(shape: tuple[str, str], batched: bool) -> tuple[int, ...]:
    core = tuple(1 if s == "1" else SIZES[s] for s in shape)
    return (*BATCH, *core) if batched else core


def _dim(s: str) -> sp.Basic:
    return sp.Integer(1) if s == "1" else DIMS[s]


def random_case(seed: int) -> Case:
    """One random spec over the language, and its torch reference."""
    import torch

    rng = random.Random(seed)
    names = rng.sample(MATRIX_NAMES, rng.randint(1, 3))
    if rng.random() < 0.3:  # a name and its "differential" side by side
        base = rng.choice([n for n in names if not n.startswith("d")] or ["X"])
        names = list(dict.fromkeys([base, "d" + base, *names]))[:3]
    params = rng.sample(PARAMETER_NAMES, rng.randint(0, 2))
    scalars = rng.sample(SCALAR_NAMES, rng.choice([0, 0, 1, 2]))
    inputs: list[tuple[str, tuple[str, str] | None]] = []
    leaves: list[Term] = []
    kinds: list[str] = []
    for i, name in enumerate(names):
        shape = ("n", "d") if i == 0 else (rng.choice(["n", "m"]), rng.choice(["d", "n"]))
        inputs.append((name, shape))
    for name in params:
        if name.startswith("b_"):
            shape = ("1", "d")
        else:
            shape = ("d", rng.choice(["d", "m", "n"]))
        inputs.append((name, shape))
    symbols: dict[str, sp.Basic] = {}
    for name, shape in inputs:
        symbols[name] = sp.MatrixSymbol(name, _dim(shape[0]), _dim(shape[1]))
        leaves.append(Term(symbols[name], (lambda k: lambda env: env[k])(name), shape))
    for name in scalars:
        symbols[name] = sp.Symbol(name, real=True)
        inputs.append((name, None))
    constants = rng.sample(sorted(CONSTANTS), rng.choice([0, 0, 0, 1, 2]))
    for name in constants:
        symbols[name] = sp.MatrixSymbol(name, *map(_dim, CONSTANTS[name]))
        leaves.append(Term(symbols[name], (lambda k: lambda env: env[k])(name), CONSTANTS[name]))

    def scalar_factor() -> tuple[sp.Basic, Callable, str]:
        choice = rng.choice(["number", "sqrt", *(["tau"] * 3 if scalars else [])])
        if choice == "number":
            c = rng.choice([2, -1, sp.Rational(1, 2), 3])
            return c, (lambda env, c=float(c): c), f"{c}·"
        if choice == "sqrt":
            return 1 / sp.sqrt(DIMS["d"]), (lambda env: SIZES["d"] ** -0.5), "1/√d·"
        name = rng.choice(scalars)
        t = symbols[name]
        form = rng.choice(["plain", "exp", "inv", "square"])
        if form == "plain":
            return t, (lambda env: env[name]), f"{name}·"
        if form == "exp":
            return sp.exp(t), (lambda env: torch.exp(env[name])), f"exp({name})·"
        if form == "inv":
            return 1 / t, (lambda env: 1 / env[name]), f"1/{name}·"
        return t**2, (lambda env: env[name] ** 2), f"{name}²·"

    terms = [leaves[0]]
    steps = rng.randint(2, 6)
    for _ in range(steps):
        a = rng.choice(terms[-3:])
        op = rng.choice(OPS)
        r, c = a.shape
        new = None
        if op == "matmul":
            pool = terms + leaves
            fits = [(b, False) for b in pool if b.shape[0] == c] + [(b, True) for b in pool if b.shape[1] == c]
            fits = [(b, t) for b, t in fits if (b.shape[0] if t else b.shape[1]) != "1"]
            if fits:
                b, transposed = rng.choice(fits)
                if transposed:
                    new = Term(a.expr * b.expr.T, lambda env, a=a, b=b: a.torch(env) @ b.torch(env).mT, (r, b.shape[0]))
                else:
                    new = Term(a.expr * b.expr, lambda env, a=a, b=b: a.torch(env) @ b.torch(env), (r, b.shape[1]))
        elif op == "transpose" and r != "1":
            new = Term(a.expr.T, lambda env, a=a: a.torch(env).mT, (c, r))
        elif op in ("add", "sub", "hadamard"):
            same = [b for b in terms + leaves if b.shape == a.shape and b.expr != a.expr] or [a]
            b = rng.choice(same)
            if op == "add":
                new = Term(a.expr + b.expr, lambda env, a=a, b=b: a.torch(env) + b.torch(env), a.shape)
            elif op == "sub" and b is not a:  # not X − X: a spec whose output is 0 is refused
                new = Term(a.expr - b.expr, lambda env, a=a, b=b: a.torch(env) - b.torch(env), a.shape)
            else:
                made = sa.hadamard(a.expr, b.expr) if rng.random() < 0.7 else sp.HadamardProduct(a.expr, b.expr)
                new = Term(made, lambda env, a=a, b=b: a.torch(env) * b.torch(env), a.shape)
        elif op == "scale":
            c_expr, c_fn, _ = scalar_factor()
            new = Term(c_expr * a.expr, lambda env, a=a, c_fn=c_fn: c_fn(env) * a.torch(env), a.shape)
        elif op == "neg":
            new = Term(-a.expr, lambda env, a=a: -a.torch(env), a.shape)
        elif op == "softmax" and c != "1":
            new = Term(sa.softmax(a.expr), lambda env, a=a: torch.softmax(a.torch(env), dim=-1), a.shape)
        elif op in ("exp", "tanh", "sigmoid"):
            fn = {"exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[op]
            node = {"exp": sa.exp, "tanh": sa.tanh, "sigmoid": sa.sigmoid}[op]
            inner = sa.tanh(a.expr) if op == "exp" else a.expr  # bounded: no overflow at any size
            inner_fn = (lambda env, a=a: torch.tanh(a.torch(env))) if op == "exp" else a.torch
            new = Term(node(inner), lambda env, f=inner_fn, fn=fn: fn(f(env)), a.shape)
        elif op == "log":  # of a positive value
            new = Term(sa.log(sa.sigmoid(a.expr)), lambda env, a=a: torch.log(torch.sigmoid(a.torch(env))), a.shape)
        elif op == "rowsum" and c != "1":
            new = Term(sa.rowsum(a.expr), lambda env, a=a: a.torch(env).sum(-1, keepdim=True), (r, "1"))
        elif op == "sum_factor":
            b = rng.choice(terms + leaves)
            new = Term(
                sa.sum(b.expr) * a.expr,
                lambda env, a=a, b=b: b.torch(env).sum((-2, -1), keepdim=True) * a.torch(env),
                a.shape,
            )
        elif op == "trace_factor":
            square = [b for b in terms + leaves if b.shape[0] == b.shape[1] and b.shape[0] != "1"]
            if square:
                b = rng.choice(square)
                new = Term(
                    sp.Trace(b.expr) * a.expr,
                    lambda env, a=a, b=b: (
                        torch.diagonal(b.torch(env), dim1=-2, dim2=-1).sum(-1)[..., None, None] * a.torch(env)
                    ),
                    a.shape,
                )
        elif op == "identity" and r == c and r != "1":
            new = Term(a.expr + sp.Identity(_dim(r)), lambda env, a=a, r=r: a.torch(env) + torch.eye(SIZES[r]), a.shape)
        elif op == "bias" and r != "1":
            biases = [b for b in leaves if b.shape == ("1", c)]
            if biases:
                b = rng.choice(biases)
                ones = sp.OneMatrix(_dim(r), 1)
                new = Term(a.expr + ones * b.expr, lambda env, a=a, b=b: a.torch(env) + b.torch(env), a.shape)
        if new is not None:
            kinds.append(op)
            terms.append(new)
    output = terms[-1]
    if output.shape == ("1", "1") or output is leaves[0]:  # a matrix output that is not an input
        output = Term(
            output.expr * sp.OneMatrix(1, _dim("n")) if output.shape == ("1", "1") else sa.tanh(output.expr),
            (lambda env, o=output: o.torch(env).expand(*o.torch(env).shape[:-1], SIZES["n"]))
            if output.shape == ("1", "1")
            else (lambda env, o=output: torch.tanh(o.torch(env))),
            ("1", "n") if output.shape == ("1", "1") else output.shape,
        )
    batched = {symbols[name] for name in names}
    # SymPy folded away every batched input (X − X, A + I − A, (X + 𝟏b) − X): the spec's output is a constant or a
    # function of the parameters alone, without the batch axes that the torch forward's X − X keeps
    if not output.expr.free_symbols & batched:
        x = leaves[0]
        output = Term(sa.tanh(x.expr), lambda env, x=x: torch.tanh(x.torch(env)), x.shape)
    if rng.random() < 0.2 and output.shape[0] != "1":
        output = Term(output.expr.T, lambda env, o=output: o.torch(env).mT, output.shape[::-1])
        kinds.append("transposed output")
    labels = rng.sample(LABELS, len(LABELS))
    taken = {name for name, _ in inputs}
    intermediates = []
    for t in terms[1:]:
        if t.expr == output.expr or t.shape == ("1", "1") or rng.random() < 0.5:
            continue
        label = next((x for x in labels if x not in taken), None)
        if label is None:
            break
        taken.add(label)
        intermediates.append((label, t.expr))
    spec_inputs = tuple(symbols[name] for name, _ in inputs)
    used = [c for c in constants if symbols[c] in output.expr.free_symbols]  # SymPy may have folded one away
    fixed = tuple(symbols[c] for c in used)
    spec = sa.Spec(f"fuzz{seed}", "", spec_inputs, output.expr, tuple(intermediates), constants=fixed)
    order = [name for name, _ in inputs] + used

    folded = {c: torch.zeros(_concrete(CONSTANTS[c], False), dtype=torch.float64) for c in constants if c not in used}

    def reference(*values):  # a constant SymPy folded away (E − E) is read by the torch forward: any value
        return output.torch({**folded, **dict(zip(order, values))})

    shapes = [
        () if shape is None else _concrete(shape, not name.startswith(("W_", "b_", "gamma_", "beta_")))
        for name, shape in inputs
    ]
    concrete = [(c, _concrete(CONSTANTS[c], False)) for c in used]
    return Case(seed, spec, reference, shapes, str(output.expr), kinds, concrete)


BACKENDS = ("numpy", "torch", "jax")


def load(spec, backend: str) -> types.ModuleType:
    from symattn.codegen import generate as codegen

    module = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(codegen.render(spec, backend), module.__name__, "exec"), module.__dict__)
    return module


def run_case(seed: int, backends: tuple[str, ...] = BACKENDS, verify: bool = True) -> tuple[str, str]:
    """(outcome, detail) of the case drawn from seed: derive --verify, generate, compare with torch autograd.

    outcome: ok; refused (symattn's own error); crash (any other exception, in symattn or a generated module);
    wrong (a verified step, an output or a gradient that differs from torch autograd of the reference).
    """
    import torch

    try:
        case = random_case(seed)
    except SymattnError as e:
        return "refused", f"spec: {e}"
    spec = case.spec
    try:
        if verify:
            v = sa.derive(spec).verify()
            if not v.ok:
                return "wrong", f"derive --verify: {v.text()[:300]}"
        modules = {b: load(spec, b) for b in backends}
    except SymattnError as e:
        return "refused", str(e)
    except Exception as e:
        return "crash", f"{type(e).__name__}: {e}"
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in case.shapes]
    fixed = {name: torch.randn(s, generator=g, dtype=torch.float64) for name, s in case.constants}
    targs = [a.clone().requires_grad_(True) for a in args]
    expected = case.reference(*targs, *fixed.values())
    go = torch.randn(expected.shape, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad(expected, targs, go, allow_unused=True)
    ref = [torch.zeros_like(a) if r is None else r for a, r in zip(targs, ref)]
    names = [str(x.name) for x in spec.inputs]
    for backend, module in modules.items():
        try:
            out, grads = _run(module, backend, args, go, names, _constants(spec, fixed))
        except Exception as e:
            return "crash", f"{backend} module: {type(e).__name__}: {e}"
        scale = max(1.0, float(expected.detach().abs().max()))
        if tuple(out.shape) != tuple(expected.shape) or float((out - expected.detach()).abs().max()) > 1e-9 * scale:
            return "wrong", f"{backend} output"
        for name, got, want in zip(names, grads, ref):
            tol = 1e-8 * max(1.0, float(want.abs().max()))
            if tuple(got.shape) != tuple(want.shape) or float((got - want).abs().max()) > tol:
                return "wrong", f"{backend} d{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
    return "ok", ""


def _constants(spec: sa.Spec, values: dict) -> tuple[list, dict]:
    """The constants as generated forward takes them: after the inputs, in the spec's order (the additive mask
    among them, in its position), no keywords."""
    return [values[str(c.name)] for c in spec.constants], {}


def _run(module, backend, args, go, names, constants):
    import torch

    fixed, keywords = constants
    if backend == "numpy":
        keywords = {k: v.numpy() for k, v in keywords.items()}
        out, saved = module.forward(*[a.numpy() for a in args], *[c.numpy() for c in fixed], **keywords)
        gr = module.backward(saved, go.numpy())
        return torch.as_tensor(np.asarray(out)), [torch.as_tensor(np.asarray(gr[n])) for n in names]
    if backend == "torch":
        targs = [a.clone().requires_grad_(True) for a in args]
        out = module.forward(*targs, *fixed, **keywords)
        grads = torch.autograd.grad(out, targs, go, allow_unused=True)
        return out.detach(), [torch.zeros_like(a) if r is None else r for a, r in zip(targs, grads)]
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    constant_arrays = [jnp.asarray(c.numpy()) for c in fixed]
    keywords = {k: jnp.asarray(v.numpy()) for k, v in keywords.items()}

    def forward(*xs):  # the inputs differentiated, the constants held
        return module.forward(*xs, *constant_arrays, **keywords)

    out, vjp = jax.vjp(forward, *[jnp.asarray(a.numpy()) for a in args])
    grads = vjp(jnp.asarray(go.numpy()))
    return torch.as_tensor(np.asarray(out)), [torch.as_tensor(np.asarray(x)) for x in grads]
