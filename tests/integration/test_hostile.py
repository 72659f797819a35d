"""Hostile input: every entry point refuses bad input with one line of symattn's own, and runs no user text.

Each case is a regression test of issue 9 (a hostile user's ~110 tries): user text that
SymPy's ``sympify`` would have evaluated, malformed specs, and command lines that used to
end in a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.cli import main
from symattn.specs import dim
from symattn.specs.validate import SpecError

n, d = dim("n"), dim("d")
X = sp.MatrixSymbol("X", n, d)
W = sp.MatrixSymbol("W", d, d)


def _injections(marker: Path) -> list[str]:
    """Strings that run `touch marker` if anything evaluates them as Python."""
    call = f'__import__("os").system("touch {marker}")'
    return [call, f"{call} or 1", f"exec('import os; os.system(\"touch {marker}\")')", f"({call}, 1)[1]"]


def _one_line_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_no_entry_point_evaluates_user_text(tmp_path, capsys):
    marker = tmp_path / "ran"
    for text in _injections(marker):
        for argv in (
            ["derive", "attention", "--option", f"scale={text}"],
            ["derive", "attention", "--option", f"scale={text}", "--verify"],
            ["derive", "mha", "--option", f"num_heads={text}"],
            ["derive", "transformer_block", "--option", f"eps={text}"],
            ["check", "attention", "--wrt", "V", "--option", f"scale={text}", "P.T * G"],
            ["check", "self_attention", "--wrt", "W_V", text],
        ):
            _one_line_error(argv, capsys)
        for call in (
            lambda t=text: sa.grad(t, [X]),
            lambda t=text: sa.grad(X * W, [W], cotangent=t),
            lambda t=text: sa.lambdify([X], t),
            lambda t=text: sa.simplify(t),
            lambda t=text: sa.simplify_all([t]),
            lambda t=text: sa.softmax(t),
            lambda t=text: sa.hadamard(X, t),
            lambda t=text: sa.check("attention", "V", "P.T * G", scale=t),
            lambda t=text: sa.derive("attention", scale=t),
            lambda t=text: sa.check("self_attention", "W_V", t),
        ):
            with pytest.raises(sa.SymattnError):
                call()
    assert not marker.exists(), "user text was run as code"


def test_text_is_refused_with_a_reason():
    with pytest.raises(sa.SymattnError, match=r"str 'X' .*never evaluated"):
        sa.grad("X", [X])


def test_scale_text_is_read_by_the_safe_parser():
    s = sa.spec("attention", scale="1/sqrt(d_k)")
    assert s.output == sa.spec("attention").output
    assert sa.spec("attention", scale="2*n").options["scale"] == "2*n"  # a dimension is allowed
    for bad, reason in (("a=b", "cannot parse"), ("(", "cannot parse"), ("x", "unknown name"), ("0", "nonzero")):
        with pytest.raises(sa.SymattnError, match=reason):
            sa.spec("attention", scale=bad)


@pytest.mark.parametrize("scale", ["n", "1/sqrt(d_k)", "0.5"])
def test_verify_accepts_every_scale_the_parser_accepts(scale, capsys):
    assert main(["derive", "attention", "--option", f"scale={scale}", "--verify"]) == 0
    assert "all equalities agree" in capsys.readouterr().out


def test_numpy_scalars_are_accepted_as_options():
    assert sa.spec("mha", num_heads=np.int64(2)).options["num_heads"] == 2
    assert sa.spec("attention", causal=np.True_).options["causal"] is True
    assert sa.spec("attention", scale=np.float32(0.5)).output == sa.spec("attention", scale=0.5).output
    for bad in (np.float64(2.0), np.bool_(True), 0, -1, "2x"):
        with pytest.raises(sa.SymattnError, match="num_heads"):
            sa.spec("mha", num_heads=bad)


# Spec validation: each malformed field is one SpecError naming it.
BAD_SPECS = {
    "keyword input": (
        dict(inputs=(sp.MatrixSymbol("lambda", n, d),), output=sp.MatrixSymbol("lambda", n, d)),
        "not a Python identifier",
    ),
    "indexed input": (
        dict(inputs=(sp.MatrixSymbol("X[0]", n, d),), output=sp.MatrixSymbol("X[0]", n, d)),
        "not a Python identifier",
    ),
    "paren input": (
        dict(inputs=(sp.MatrixSymbol("a)", n, d),), output=sp.MatrixSymbol("a)", n, d)),
        "not a Python identifier",
    ),
    "duplicate": (dict(inputs=(X, sp.MatrixSymbol("X", d, d)), output=X), "named more than once"),
    "missing input": (dict(inputs=(X,), output=X * W), "output uses W"),
    "reserved G": (dict(inputs=(sp.MatrixSymbol("G", n, d),), output=sp.MatrixSymbol("G", n, d)), "reserved"),
    "scalar output": (dict(inputs=(X,), output=sa.sum(X)), "output must be a matrix expression"),
    "trace output": (dict(inputs=(W,), output=sp.Trace(W)), "output must be a matrix expression"),
    "None output": (dict(inputs=(X,), output=None), "output must be a matrix expression, got a NoneType"),
    "array output": (dict(inputs=(X,), output=np.zeros((2, 2))), "got a ndarray"),
    "bad intermediate": (dict(inputs=(X,), output=X, intermediates=(("S", 3),)), "intermediate S must be a matrix"),
    "intermediate name": (dict(inputs=(X,), output=X, intermediates=(("if", X),)), "not a Python identifier"),
    "shadowing intermediate": (dict(inputs=(X,), output=X, intermediates=(("X", X),)), "already the name"),
    "dimension input": (dict(inputs=(X, n), output=X), "(a dimension)"),
    "scalar constant": (dict(inputs=(X,), output=X, constants=(sp.Symbol("tau"),)), "constants are MatrixSymbols"),
    "string inputs": (dict(inputs="X", output=X), "tuple of MatrixSymbols"),
    "unknown node": (dict(inputs=(W,), output=sp.Inverse(W)), "Inverse is not in the language"),
    "shape": (dict(inputs=(X,), output=sp.MatMul(X, X, evaluate=False)), "shape mismatch"),
    "bad name": (dict(name="my-spec", inputs=(X,), output=X), "spec name 'my-spec'"),
    "summary": (dict(summary=None, inputs=(X,), output=X), "summary must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_spec_validation_names_the_field(case):
    fields, message = BAD_SPECS[case]
    fields = {"name": "user", "summary": "s"} | fields
    with pytest.raises(SpecError, match=message) as info:
        sa.Spec(**fields)
    assert "\n" not in str(info.value)


def test_spec_accepts_lists_and_stores_tuples():
    s = sa.Spec("user", "s", [X, W], sa.tanh(X * W), [["T", sa.tanh(X * W)]])
    assert s.inputs == (X, W) and s.intermediates == (("T", sa.tanh(X * W)),)


def test_matrix_power_derivation_names_one_cotangent(capsys, tmp_path):
    # d(A³) = dA A A + A dA A + A A dA: the three terms are parts of one Ā, not three Ā's
    spec_file = tmp_path / "power.py"
    spec_file.write_text(
        textwrap.dedent(
            """
            import sympy as sp
            import symattn as sa
            from symattn.specs import dim
            n, d = dim("n"), dim("d")
            X, W_A = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W_A", d, d)
            spec = sa.Spec("power", "X W_A^3", (X, W_A), X * sp.MatPow(W_A, 3))
            """
        )
    )
    assert main(["derive", "--spec-file", str(spec_file), "--wrt", "W_A"]) == 0
    out = capsys.readouterr().out
    assert out.count("W̄_A :=") == 1
    assert "tr(W̄_Aᵀ dW_A) + tr(W̄_Aᵀ dW_A)" not in out
    assert main(["derive", "--spec-file", str(spec_file), "--verify"]) == 0
    assert "all equalities agree" in capsys.readouterr().out


PREAMBLE = "import sympy as sp\nimport symattn as sa\n"
SPEC_FILES = {
    "exit.py": ("import sys\nsys.exit(3)\n", "called sys.exit(3)"),
    "shape.py": (
        'import sympy as sp\nX = sp.MatrixSymbol("X", 4, 3)\nY = X * X\n',
        "line 3: shape mismatch for matrix product X*X: (4, 3) and (4, 3)",
    ),
    "none.py": (
        PREAMBLE + 'X = sp.MatrixSymbol("X", 4, 3)\nspec = sa.Spec("a", "s", (X,), None)\n',
        "output must be a matrix expression",
    ),
    "nospec.py": ("x = 1\n", "defines no `spec`"),
    "raises.py": ("raise ValueError('boom')\n", "line 1: ValueError: boom"),
    "trace.py": (
        PREAMBLE + 'W = sp.MatrixSymbol("W", 3, 3)\nspec = sa.Spec("t", "s", (W,), sp.Trace(W))\n',
        "output must be a matrix expression",
    ),
}


@pytest.mark.parametrize("name", sorted(SPEC_FILES))
@pytest.mark.parametrize("command", ["derive", "derive --verify", "generate"])
def test_bad_spec_files_are_one_line(name, command, tmp_path, capsys):
    text, message = SPEC_FILES[name]
    path = tmp_path / name
    path.write_text(text)
    argv = (
        command.split()
        + ["--spec-file", str(path)]
        + (["--out", str(tmp_path / "out")] if command == "generate" else [])
    )
    assert message in _one_line_error(argv, capsys)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "path, message", [("/dev/null", "not a regular file"), ("/", "a directory"), ("/no/such", "no such file")]
)
def test_spec_file_that_is_not_a_file(path, message, capsys):
    assert message in _one_line_error(["derive", "--spec-file", path], capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["derive", "attention", "--option", "scale=a=b"],
        ["derive", "attention", "--option", "scale=("],
        ["derive", "attention", "--option", "scale=0", "--verify"],
        ["derive", "attention", "--option", "bogus=1"],
        ["derive", "attention", "--option", "novalue"],
        ["generate", "--spec", "mha", "--option", "num_heads=3"],
        ["check", "self_attention", "--wrt", "W_V", "--seed", "-5", "X.T * P.T * G"],
        ["check", "self_attention", "--wrt", "W_V", "--trials", "0", "X.T * P.T * G"],
    ],
)
def test_bad_command_lines_are_one_line(argv, capsys):
    _one_line_error(argv, capsys)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "symattn", *args], capture_output=True, text=True, check=False, **kwargs
    )


@pytest.mark.slow  # a subprocess deriving a 150-deep spec
def test_deep_spec_is_one_line_not_a_recursion_traceback(tmp_path):
    path = tmp_path / "deep.py"
    path.write_text(
        textwrap.dedent(
            """
            import sympy as sp
            import symattn as sa
            from symattn.specs import dim
            n, d = dim("n"), dim("d")
            X, W = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W", d, d)
            Y = X
            for _ in range(150):
                Y = sa.tanh(Y * W)
            spec = sa.Spec("deep", "150 tanh layers", (X, W), Y)
            """
        )
    )
    done = _run(["derive", "--spec-file", str(path), "--verify"])
    assert done.returncode in (0, 2)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 1


@pytest.mark.slow  # subprocesses
def test_full_or_closed_stdout_exits_quietly_with_failure():
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "symattn", "derive", "mha"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=120,
        )
    assert done.returncode == 1 and done.stderr == ""
    closed = subprocess.run(
        [sys.executable, "-c", "import os, sys; os.close(1); from symattn.cli import main; sys.exit(main(['list']))"],
        stderr=subprocess.PIPE,
        text=True,
        check=False,
        timeout=120,
    )
    assert closed.returncode == 1 and "Traceback" not in closed.stderr


@pytest.mark.slow  # a subprocess
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    started = tmp_path / "started"
    slow = tmp_path / "slow.py"
    slow.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\ntime.sleep(60)\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "symattn", "derive", "--spec-file", str(slow)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:  # interrupt while the spec file runs
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130
    assert err.strip() == "symattn: interrupted"
