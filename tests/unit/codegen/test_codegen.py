"""Code generation: printers, schedules, templates, and `symattn generate` (bytes, atomic writes, --check)."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from sympy import MatrixSymbol
from sympy.matrices.expressions import HadamardPower, Identity, OneMatrix, Trace, ZeroMatrix

import symattn as sa
from symattn.autodiff.vjp import VJP_RULES
from symattn.cli import main
from symattn.codegen import generate as codegen
from symattn.codegen.backends import OPTIONAL_BACKENDS
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
from symattn.codegen.schedule.build import schedule
from symattn.lang.ops import MergeHeads, RowSoftmax, SplitHeads

ROOT = Path(__file__).resolve().parents[3]
n, d = sp.symbols("n d", positive=True, integer=True)


def test_generated_folder_is_up_to_date():
    # generated/ is what the templates render now: regenerate with `symattn generate`, never edit
    assert codegen.default_out_dir().resolve() == (ROOT / "generated").resolve()
    assert codegen.generate(check=True) == []
    assert main(["generate", "--check"]) == 0


def test_every_matrix_node_has_a_printer_method_for_each_backend():
    for node in VJP_RULES:
        if issubclass(node, sp.MatrixExpr) and node.__name__ not in ("MatPow",):
            for printer in (GeneratedNumPyPrinter, TorchMatrixPrinter):
                assert any(hasattr(printer, f"_print_{c.__name__}") for c in node.__mro__[:2]), (printer, node)


def test_torch_printer_prints_every_node_as_working_torch():
    torch = pytest.importorskip("torch", reason="torch is needed to run printed torch code")
    a, b = MatrixSymbol("a", n, n), MatrixSymbol("b", n, n)
    c = MatrixSymbol("c", n, 2 * d)
    exprs = [
        a.T * b / sp.sqrt(n),  # square transpose and a scalar of dimensions (SymPy's TorchPrinter fails both)
        sa.exp(a) + sa.log(sa.sigmoid(b)) - sa.tanh(a),
        sa.hadamard(RowSoftmax(a), HadamardPower(b, 2)),
        sa.rowsum(a) * OneMatrix(1, n) + a,
        Trace(a) * Identity(n) + sa.sum(b) * OneMatrix(n, n) + ZeroMatrix(n, n),
        MergeHeads(SplitHeads(c, 2) * SplitHeads(c, 2).T * SplitHeads(c, 2), 2),
    ]
    rng = np.random.default_rng(0)
    values = {
        "a": rng.normal(size=(2, 4, 4)),
        "b": rng.uniform(0.5, 1, size=(2, 4, 4)),
        "c": rng.normal(size=(2, 4, 6)),
    }
    for expr in exprs:
        printer = TorchMatrixPrinter()
        text = printer.doprint(expr)
        namespace = {"torch": torch, "n": 4, "d": 3, "dtype": torch.float64, "device": "cpu"}
        exec(printer.helper_source(), namespace)
        got = eval(text, namespace, {k: torch.tensor(v) for k, v in values.items()})
        args = sorted(expr.atoms(MatrixSymbol), key=str)
        expected = sa.lambdify(args, expr, dims={"n": 4, "d": 3})(*(values[str(s)] for s in args))
        np.testing.assert_allclose(got.numpy(), np.broadcast_to(expected, got.shape), rtol=1e-12, err_msg=text)


def test_printers_put_scalars_on_the_smallest_factor_and_broadcast_row_sums():
    q, k = MatrixSymbol("Q", sp.Symbol("n"), sp.Symbol("d_k")), MatrixSymbol("K", sp.Symbol("m"), sp.Symbol("d_k"))
    p = RowSoftmax(q * k.T)
    # (the scores by the runtime's wide_matmul: float32 of float16 factors, a @ b of wider ones)
    assert GeneratedNumPyPrinter().doprint(sp.Symbol("scale") * q * k.T) == "wide_matmul(scale * Q, K.mT)"
    text = GeneratedNumPyPrinter().doprint(sa.hadamard(p, p - sa.rowsum(p) * OneMatrix(1, sp.Symbol("m"))))
    assert "repeat" not in text and "ones" not in text  # u 𝟏ᵀ broadcasts: no n × m array of row sums
    z, m = MatrixSymbol("Z", sp.Symbol("n"), 1), sp.Symbol("m")
    text = GeneratedNumPyPrinter().doprint(sa.hadamard(q * k.T, HadamardPower(z * OneMatrix(1, m), -1)))
    assert text == "(wide_matmul(Q, K.mT)) * (Z**-1)"  # (Z 𝟏ᵀ)^∘-1 = Z^∘-1 𝟏ᵀ: a power of the column, broadcast
    text = GeneratedNumPyPrinter().doprint(q * k.T + OneMatrix(sp.Symbol("n"), 1) * z.T * q * k.T)
    assert "ones" not in text  # 𝟏 (Zᵀ Q Kᵀ): the row, broadcast in the sum


def test_attention_schedule_computes_each_value_once():
    sched = schedule("attention")
    forward = {str(a.target.name): a.value for a in sched.forward}
    backward = {str(a.target.name): a.value for a in sched.backward}
    assert list(forward) == ["A", "P", "O"]  # S = Q Kᵀ folded into A = scale·Q Kᵀ
    assert list(backward) == ["D", "dP", "dA", "dQ", "dK", "dV"]
    softmaxes = [
        a
        for a in (*sched.forward, *sched.backward)
        for e in sp.preorder_traversal(a.value)
        if isinstance(e, RowSoftmax)
    ]
    assert len(softmaxes) == 1  # P once, in the forward; the backward reads it
    assert {str(s) for s in sched.saved} >= {"Q", "K", "V", "P", "scale"}
    assert "A" not in {str(s) for s in sched.saved}
    names = {str(s) for s in backward["dQ"].free_symbols} | {str(s) for s in backward["dK"].free_symbols}
    assert "dA" in names  # dA computed once, read by dQ and dK (transposed)


def test_self_attention_fuses_projections_and_reuses_their_cotangents():
    sched = schedule("self_attention")
    forward = {str(a.target.name): a.value for a in sched.forward}
    backward = {str(a.target.name): a.value for a in sched.backward}
    # one product X [W_Q | W_K | W_V] forward; dX = [dQ | dK | dV] [W_Q | W_K | W_V]ᵀ and Xᵀ [dQ | dK | dV] backward
    assert {str(s) for s in forward["QKV"].free_symbols} == {"X", "W_QKV"}
    assert {str(s) for s in backward["dQKV"].free_symbols} == {"dQ", "dK", "dV"}
    assert {str(s) for s in backward["dX"].free_symbols} == {"dQKV", "W_QKV"}
    assert {str(s) for s in backward["dW_QKV"].free_symbols} == {"X", "dQKV"}
    products = [a for a in sched.forward if isinstance(a.value, sp.MatMul) and "X" in str(a.value)]
    assert len(products) == 1


def test_simplifier_turns_the_softmax_row_sum_into_the_output_form():
    pytest.importorskip("symattn.optimize.simplify", reason="the simplifier module is not present")
    from symattn.optimize.simplify import simplify

    if simplify is None:  # pragma: no cover
        pytest.skip("no simplify()")
    backward = {str(a.target.name): a.value for a in schedule("attention").backward}
    # FlashAttention's D: rowsum(dP ⊙ P) = rowsum(dO ⊙ O), an n × d_v product instead of n × m
    assert "D" in {str(s) for s in backward["dA"].free_symbols}
    assert {str(s) for s in backward["D"].free_symbols} == {"O", "grad_out"}


def test_rendering_is_deterministic_and_headed():
    from symattn import __version__

    for spec in sa.specs():
        for backend in codegen.BACKENDS:
            text = codegen.render(spec, backend)
            assert text == codegen.render(spec, backend)
            header = text.splitlines()[:2]
            assert f"symattn {__version__}" in header[0] and f'spec "{spec}"' in header[0]
            assert "Do not edit" in header[1]


def test_generated_modules_import_only_numpy_or_only_torch():
    # at the top, the backend alone; inside a helper, the standard library (ctypes' madvise, os.environ) and, for
    # NumPy, numba where an ImportError falls back to the NumPy passes (the fused softmax: optional); for torch,
    # symattn where an ImportError is refused in one line (the drop-in encoder layer rendering a configuration of
    # its family other than the module's own: dropin_block._closed_form)
    for path in sorted(p for p in (ROOT / "generated").glob("*.py") if p.name != "__init__.py"):
        backend = next(b for b in ("numpy", "torch", "jax", "triton") if f"_{b}" in path.name)
        tree = ast.parse(path.read_text())
        top = {a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for a in node.names}
        top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom)}
        # a Triton module: torch and triton (its kernels and the torch code around them)
        assert top == ({"__future__", "torch", "triton"} if backend == "triton" else {"__future__", backend}), path.name
        inner = {_imported(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))}
        optional = {_imported(node) for node in ast.walk(tree) if isinstance(node, ast.Try) for node in node.body}
        guarded = (
            {"numba"} & optional if backend == "numpy" else {"symattn"} & optional if backend == "torch" else set()
        )
        assert inner - top - guarded <= set(sys.stdlib_module_names), path.name


def _imported(node: ast.AST) -> str:
    if isinstance(node, ast.Import):
        return node.names[0].name.split(".")[0]
    return (getattr(node, "module", None) or "").split(".")[0]


def test_templates_hold_no_math():
    # every expression comes from a printer: no products, transposes or nonlinearities in templates/
    for path in (ROOT / "templates").glob("*.j2"):
        text = path.read_text()
        for token in (" @ ", ".mT", "exp(", "softmax(", "sqrt", "** 0.5", "**0.5"):
            assert token not in text, (path.name, token)


def test_templates_come_from_the_installed_package_with_strict_undefined():
    import jinja2

    env = codegen.environment()
    assert env.undefined is jinja2.StrictUndefined and env.trim_blocks and env.lstrip_blocks
    assert env.keep_trailing_newline
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ missing }}").render()
    assert "{% include" in env.loader.get_source(env, "numpy_module.py.j2")[0]


def test_generate_writes_identical_bytes_and_check_names_stale_files(tmp_path, capsys):
    assert main(["generate", "--spec", "attention", "--backend", "numpy", "--out", str(tmp_path)]) == 0
    files = sorted(tmp_path.glob("*.py"))
    assert [f.name for f in files] == ["attention_numpy.py", "attention_numpy_memeff.py"]
    before = {f: f.read_bytes() for f in files}
    assert codegen.generate(["attention"], ["numpy"], out=tmp_path) == []  # nothing to rewrite
    assert {f: f.read_bytes() for f in files} == before
    edited = tmp_path / "attention_numpy.py"
    edited.write_text(edited.read_text() + "# hand edit\n")
    capsys.readouterr()
    assert main(["generate", "--spec", "attention", "--backend", "numpy", "--out", str(tmp_path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "attention_numpy.py" in out and "attention_numpy_memeff.py" not in out
    assert edited.read_text().endswith("# hand edit\n")  # --check writes nothing


def test_check_on_an_empty_folder_names_every_missing_module_and_writes_nothing(tmp_path, capsys):
    assert main(["generate", "--check", "--out", str(tmp_path), "--variant", "standard"]) == 1
    out = capsys.readouterr().out
    # every built-in: its module of each backend, the optional ones (Triton) included
    assert out.count("stale:") == len(sa.specs()) * (len(codegen.BACKENDS) + len(OPTIONAL_BACKENDS))
    assert list(tmp_path.iterdir()) == []


def test_a_failure_midway_leaves_every_file_as_it_was(tmp_path, monkeypatch):
    codegen.generate(["attention"], ["numpy"], ["standard"], out=tmp_path)
    target = tmp_path / "attention_numpy.py"
    target.write_text("old contents\n")
    real_fdopen = codegen.os.fdopen
    calls = []

    def failing_fdopen(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_fdopen(*args, **kwargs)

    monkeypatch.setattr(codegen.os, "fdopen", failing_fdopen)
    with pytest.raises(OSError, match="disk full"):
        codegen.generate(["attention", "mha"], ["numpy"], ["standard"], out=tmp_path)
    assert target.read_text() == "old contents\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention_numpy.py"]  # no temporary files left


def test_generate_rejects_bad_arguments_with_one_line(capsys):
    assert main(["generate", "--spec", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err
    assert main(["generate", "--backend", "tensorflow"]) == 2
    capsys.readouterr()
    assert main(["generate", "--out", "/proc/no-such-folder"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write the generated modules" in err


def test_written_module_imports_from_any_folder(tmp_path):
    codegen.generate(["self_attention"], ["numpy"], ["standard"], out=tmp_path)
    spec = importlib.util.spec_from_file_location("sa_numpy", tmp_path / "self_attention_numpy.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, saved = mod.forward(np.ones((3, 4)), np.eye(4), np.eye(4), np.eye(4)[:, :2])
    assert out.shape == (3, 2) and set(mod.backward(saved, np.ones((3, 2)))) == {"X", "W_Q", "W_K", "W_V"}


@pytest.mark.slow  # a subprocess that renders every module
def test_generated_bytes_do_not_depend_on_hash_randomisation():
    # set iteration order changes with PYTHONHASHSEED; the generated files must not. This process (pytest's
    # own random seed) renders them in test_generated_folder_is_up_to_date: a fixed seed is the second one
    env = {**os.environ, "PYTHONHASHSEED": "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"}
    done = subprocess.run(
        [sys.executable, "-m", "symattn", "generate", "--check"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_generate_removes_the_leftovers_of_a_killed_run_and_only_those(tmp_path):
    # kill -9 during a write leaves .<module>.py.<random>.tmp beside the module: the next run deletes it
    codegen.generate(["attention"], ["numpy"], ["standard"], out=tmp_path)
    leftover = tmp_path / ".attention_numpy.py.k3x9q1.tmp"
    leftover.write_text("half a module")
    foreign = [tmp_path / ".notes.tmp", tmp_path / ".attention_numpy.py.keep", tmp_path / "attention_numpy.py.x.tmp"]
    for path in foreign:
        path.write_text("not generate's")
    assert codegen.generate(["attention"], ["numpy"], ["standard"], out=tmp_path, check=True) == []  # ignored
    assert leftover.exists()  # --check writes nothing, deletes nothing
    assert codegen.generate(["attention"], ["numpy"], ["standard"], out=tmp_path) == []  # up to date: no write
    assert not leftover.exists()
    assert all(path.read_text() == "not generate's" for path in foreign)
    assert (tmp_path / "attention_numpy.py").read_text() == codegen.render("attention", "numpy")


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_a_failure_mid_write_leaves_no_temporary_file(tmp_path, monkeypatch, failing):
    real_replace = codegen.os.replace
    calls = []

    class Broken:
        def __init__(self, fd, mode):
            codegen.os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            raise OSError("disk full")

    def failing_replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_replace(src, dst)

    if failing == "write":
        monkeypatch.setattr(codegen.os, "fdopen", Broken)
    else:
        monkeypatch.setattr(codegen.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        codegen.generate(["attention"], ["numpy"], out=tmp_path)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_source_checkout_that_was_never_installed_finds_its_templates_and_modules(monkeypatch):
    # without the install's mapping, symattn.templates and symattn.generated are the top-level folders
    from symattn.codegen import generate as codegen_generate

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(codegen_generate.resources, "files", not_installed)
    assert codegen_generate.default_out_dir() == ROOT / "generated"
    assert codegen_generate.generate(check=True) == []  # renders every module from ROOT/templates: all fresh
