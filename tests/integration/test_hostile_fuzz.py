"""A seeded fuzz of random spec files: every run ends in success or one line of symattn's own error.

Each case writes a spec file with random names, shapes and ops, some of it deliberately
malformed (bad names, duplicates, a wrong product, a scalar or None output, a summary with
quotes and backslashes, a syntax error). `derive`, `derive --verify` and `generate` must
each exit 0 or 2 with one line on stderr; a spec that generates must import, and its
NumPy backward must match a central finite difference (⟨G, dY⟩ against ⟨∂f/∂x, dx⟩ in a
random direction, float64) and its torch backward the NumPy one.
"""

from __future__ import annotations

import importlib.util
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from symattn.cli import main

CASES = 80
SECONDS_PER_CASE = 120  # a hang is a failure, not a stuck suite
SIZES = {"n": 3, "d": 4, "m": 2}
BATCH = 2
GOOD_NAMES = ["X", "Y", "Z", "W_A", "W_B", "b_C", "U"]
BAD_NAMES = ["lambda", "X[0]", "a)", "1X", "G", "class", "x-y"]


@dataclass
class Term:
    code: str
    shape: tuple[str, str]


@dataclass
class Case:
    text: str
    valid: bool  # True when no part was deliberately malformed
    inputs: dict[str, tuple[str, str]] = field(default_factory=dict)


def _shape_code(shape: tuple[str, str]) -> str:
    return f"{shape[0]}, {shape[1]}"


def _random_case(rng: random.Random) -> Case:
    """The text of one spec file, and whether it should be accepted."""
    flaw = rng.choice([None] * 6 + ["name", "dup", "product", "none", "array", "scalar", "missing", "inter", "syntax"])
    count = rng.randint(1, 3)
    names = rng.sample(GOOD_NAMES, count)
    if flaw == "name":
        names[rng.randrange(count)] = rng.choice(BAD_NAMES)
    if flaw == "dup" and count > 1:
        names[1] = names[0]
    inputs: dict[str, tuple[str, str]] = {}
    for i, name in enumerate(names):
        shape = ("n", "d") if i == 0 else (rng.choice(["d", "m"]), rng.choice(["d", "m", "n"]))
        if name.startswith(("W_", "b_")):
            shape = ("d", rng.choice(["d", "m"])) if name.startswith("W_") else ("1", "d")
        inputs.setdefault(name, shape)
    lines = ["import numpy as np", "import sympy as sp", "import symattn as sa", "from symattn.specs import dim", ""]
    lines.append('n, d, m = dim("n"), dim("d"), dim("m")')
    symbols = []
    for i, (name, shape) in enumerate(zip(names, [inputs.get(nm) for nm in names])):
        lines.append(f"x{i} = sp.MatrixSymbol({name!r}, {_shape_code(shape)})")
        symbols.append(Term(f"x{i}", shape))
    terms = [symbols[0]]
    for _ in range(rng.randint(1, 5)):
        a = rng.choice(terms)
        op = rng.choice(["matmul", "matmul", "tanh", "sigmoid", "softmax", "hadamard", "add", "scale"])
        new = None
        if op == "matmul":
            fits = [(b, False) for b in terms + symbols if b.shape[0] == a.shape[1] and b.shape[0] != "1"]
            fits += [(b, True) for b in terms + symbols if b.shape[1] == a.shape[1] and b.shape[1] != "1"]
            if fits:
                b, transposed = rng.choice(fits)
                other = f"{b.code}.T" if transposed else b.code
                new = Term(f"({a.code}) * ({other})", (a.shape[0], b.shape[0] if transposed else b.shape[1]))
        elif op in ("tanh", "sigmoid", "softmax"):
            new = Term(f"sa.{op}({a.code})", a.shape)
        elif op in ("hadamard", "add"):
            same = [b for b in terms if b.shape == a.shape]
            b = rng.choice(same)
            new = Term(f"sa.hadamard({a.code}, {b.code})" if op == "hadamard" else f"{a.code} + {b.code}", a.shape)
        else:
            new = Term(f"({a.code}) / sp.sqrt(d)", a.shape)
        if new is not None:
            lines.append(f"t{len(terms)} = {new.code}")
            terms.append(Term(f"t{len(terms)}", new.shape))
    output = terms[-1].code
    if flaw == "product":
        output = f"({output}) * ({output})"  # fits only when square; SymPy silently folds it into a power
    if flaw == "none":
        output = "None"
    elif flaw == "array":
        output = "np.zeros((2, 2))"
    elif flaw == "scalar":
        output = f"sa.sum({output})"
    elif flaw == "missing":
        lines.append('stray = sp.MatrixSymbol("stray", n, n)')
        output = f"stray * {output}" if terms[-1].shape[0] == "n" else f"{output} * stray.T"
        if terms[-1].shape[0] != "n" and terms[-1].shape[1] != "n":
            output = f"stray * {output}"  # a product that does not fit: still an error, of another kind
    intermediates = ", ".join(f'("T{i}", t{i})' for i in range(1, len(terms)) if rng.random() < 0.5)
    if flaw == "inter":
        intermediates = '("S", 3)'
    summary = rng.choice(["plain", 'quotes """ and \\\\ backslash', "unicode ⊙ σ"])
    syms = ", ".join(t.code for t in symbols)
    lines.append(
        f"spec = sa.Spec('fuzz', {summary!r}, ({syms},), {output}, ({intermediates}{',' if intermediates else ''}))"
    )
    if flaw == "syntax":
        lines.append("spec = (")
    valid = (
        flaw is None
        or (flaw == "dup" and count == 1)
        or (flaw == "product" and terms[-1].shape[0] == terms[-1].shape[1])
    )
    return Case("\n".join(lines) + "\n", valid, inputs)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"a case ran past {SECONDS_PER_CASE} s")


def _run(argv: list[str], capsys) -> int:
    status = main(argv)
    err = capsys.readouterr().err
    assert status in (0, 2), (argv, status, err)
    if status == 2:
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("symattn"), err
    return status


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _values(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def concrete(shape):
        return tuple(1 if s == "1" else SIZES[s] for s in shape)

    return {
        name: rng.standard_normal(concrete(shape) if name.startswith(("W_", "b_")) else (BATCH, *concrete(shape)))
        for name, shape in case.inputs.items()
    }


def _check_generated(out: Path, case: Case, seed: int) -> None:
    """The NumPy module against finite differences, the torch module against the NumPy one."""
    rng = np.random.default_rng(seed)
    numpy_module = _load(out / "fuzz_numpy.py", f"fuzz_numpy_{seed}")
    values = _values(case, rng)
    y, saved = numpy_module.forward(*values.values())
    g = rng.standard_normal(np.shape(y))
    grads = numpy_module.backward(saved, g)
    assert set(grads) == set(values)
    directions = {k: rng.standard_normal(v.shape) for k, v in values.items()}
    h = 1e-6

    def f(t: float) -> float:
        moved = [v + t * directions[k] for k, v in values.items()]
        return float(np.sum(g * numpy_module.forward(*moved)[0]))

    numeric = (f(h) - f(-h)) / (2 * h)
    analytic = sum(float(np.sum(grads[k] * directions[k])) for k in values)
    for k, v in values.items():
        assert np.shape(grads[k]) == v.shape, (k, np.shape(grads[k]), v.shape)
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (numeric, analytic, case.text)
    torch = pytest.importorskip("torch", reason="the torch backend needs torch")
    torch_module = _load(out / "fuzz_torch.py", f"fuzz_torch_{seed}")
    tensors = [torch.tensor(v, requires_grad=True) for v in values.values()]
    out_t = torch_module.forward(*tensors)
    assert np.allclose(out_t.detach().numpy(), y, rtol=1e-10, atol=1e-12)
    out_t.backward(torch.tensor(g))
    for k, t in zip(values, tensors):
        assert np.allclose(t.grad.numpy(), grads[k], rtol=1e-8, atol=1e-10), k


@pytest.mark.parametrize("seed", range(CASES))
def test_random_spec_file_ends_in_success_or_one_line(seed, tmp_path, capsys):
    case = _random_case(random.Random(seed))
    path = tmp_path / "fuzz_spec.py"
    path.write_text(case.text)
    out = tmp_path / "out"
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS_PER_CASE)
    try:
        derived = _run(["derive", "--spec-file", str(path)], capsys)
        assert (derived == 0) == case.valid, case.text
        if derived == 0:
            assert _run(["derive", "--spec-file", str(path), "--verify"], capsys) == 0
        generated = _run(["generate", "--spec-file", str(path), "--out", str(out)], capsys)
        assert generated == derived, case.text
        if generated == 0:
            _check_generated(out, case, seed)
        else:
            assert not out.exists() or not any(out.iterdir())  # nothing half-written
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.modules.pop(f"fuzz_numpy_{seed}", None)
        sys.modules.pop(f"fuzz_torch_{seed}", None)
