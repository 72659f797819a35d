"""User-defined specs: `symattn derive --spec-file FILE` and `symattn generate --spec-file FILE --out DIR`."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import numpy as np
import pytest

from symattn.cli import main
from symattn.specs.files import load_spec_file

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "specs" / "sigmoid_attention.py"
NAMES = ("X", "W_Q", "W_K", "W_V")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(rng) -> dict[str, np.ndarray]:
    # X: (2, n=4, d_model=3); W_Q, W_K: 3 × d_k=2; W_V: 3 × d_v=5
    shapes = {"X": (2, 4, 3), "W_Q": (3, 2), "W_K": (3, 2), "W_V": (3, 5)}
    return {name: rng.standard_normal(shape) for name, shape in shapes.items()}


def test_example_spec_derives_and_every_step_verifies(capsys):
    assert main(["derive", "--spec-file", str(EXAMPLE), "--wrt", "W_Q"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Gradients of sigmoid_attention")
    assert "P = σ(A)" in out and "∂f/∂W_Q" in out
    assert main(["derive", "--spec-file", str(EXAMPLE), "--verify"]) == 0
    assert "all equalities agree" in capsys.readouterr().out


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("user_modules")
    assert main(["generate", "--spec-file", str(EXAMPLE), "--out", str(out)]) == 0
    return out


def test_example_spec_generates_both_backends_and_check_sees_them_fresh(generated, capsys):
    assert sorted(p.name for p in generated.glob("*.py")) == [
        "sigmoid_attention_jax.py",
        "sigmoid_attention_numpy.py",
        "sigmoid_attention_torch.py",
    ]
    assert main(["generate", "--spec-file", str(EXAMPLE), "--out", str(generated), "--check"]) == 0
    assert "stale" not in capsys.readouterr().out


def test_generated_torch_backend_passes_gradcheck(generated, rng):
    torch = pytest.importorskip("torch", reason="gradcheck needs torch")
    module = _load(generated / "sigmoid_attention_torch.py")
    tensors = tuple(torch.tensor(a, requires_grad=True) for a in _inputs(rng).values())
    assert torch.autograd.gradcheck(module.forward, tensors, eps=1e-6, atol=1e-8)


def test_generated_numpy_backend_matches_finite_differences(generated, rng):
    module = _load(generated / "sigmoid_attention_numpy.py")
    inputs = _inputs(rng)
    out, saved = module.forward(*inputs.values())
    grad_out = rng.standard_normal(out.shape)
    grads = module.backward(saved, grad_out)
    eps = 1e-6
    for name in NAMES:
        direction = rng.standard_normal(inputs[name].shape)
        plus = module.forward(*{**inputs, name: inputs[name] + eps * direction}.values())[0]
        minus = module.forward(*{**inputs, name: inputs[name] - eps * direction}.values())[0]
        numeric = float(np.sum(grad_out * (plus - minus))) / (2 * eps)
        analytic = float(np.sum(grads[name] * direction))
        assert abs(analytic - numeric) / max(1.0, abs(numeric)) < 1e-7, name


def test_a_spec_function_takes_the_options(tmp_path, capsys):
    path = tmp_path / "scaled.py"
    path.write_text(
        "import sympy as sp\nimport symattn as sa\nfrom symattn.specs import dim\n\n\n"
        "def spec(scale=1):\n"
        "    n, d = dim('n'), dim('d')\n"
        "    X = sp.MatrixSymbol('X', n, d)\n"
        "    return sa.Spec('scaled', 'softmax(scale X Xᵀ) X', (X,), sa.softmax(scale * X * X.T) * X)\n"
    )
    assert load_spec_file(path, scale=2).output.has(2)
    assert main(["derive", "--spec-file", str(path), "--option", "scale=3", "--verify"]) == 0


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "no such file"),
        ("x = 1\n", "defines no `spec`"),
        ("raise RuntimeError('broken on purpose')\n", "RuntimeError: broken on purpose"),
        ("spec = 42\n", "not a symattn.Spec"),
        ("import sympy as sp\nimport symattn as sa\nn = sp.Symbol('n')\nX = sp.MatrixSymbol('X', n, 2)\n"
         "spec = sa.Spec('bad', 'X X', (X,), X * X)\n", "shape mismatch"),
    ],
)  # fmt: skip
def test_a_bad_spec_file_exits_2_with_one_line(tmp_path, capsys, source, message):
    path = tmp_path / "user_spec.py"
    if source is not None:
        path.write_text(source)
    assert main(["derive", "--spec-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert main(["generate", "--spec-file", str(path), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_a_free_scalar_symbol_cannot_be_generated(tmp_path, capsys):
    path = tmp_path / "tau.py"
    path.write_text(
        "import sympy as sp\nimport symattn as sa\nfrom symattn.specs import dim\n\n"
        "X = sp.MatrixSymbol('X', dim('n'), dim('d'))\n"
        "spec = sa.Spec('tau', 'softmax(tau X Xᵀ) X', (X,), sa.softmax(sp.Symbol('tau') * X * X.T) * X)\n"
    )
    assert main(["derive", "--spec-file", str(path), "--verify"]) == 0  # derivable: tau is a number there
    assert main(["generate", "--spec-file", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "scalar symbol(s) tau" in capsys.readouterr().err


def test_spec_and_spec_file_are_exclusive(tmp_path, capsys):
    assert main(["derive", "attention", "--spec-file", str(EXAMPLE)]) == 2
    assert main(["derive"]) == 2
    assert main(["generate", "--spec-file", str(EXAMPLE)]) == 2  # needs --out
    err = capsys.readouterr().err
    assert "either SPEC or --spec-file" in err and "--spec-file needs --out" in err


def test_generated_files_name_the_command_that_regenerates_them(tmp_path, capsys):
    out = tmp_path / "my modules"
    argv = ["generate", "--spec-file", str(EXAMPLE), "--out", str(out), "--backend", "numpy"]
    assert main(argv) == 0
    header = (out / "sigmoid_attention_numpy.py").read_text().splitlines()[:3]
    command = header[2].removeprefix("#   ")
    assert header[1].startswith("# Do not edit") and command.startswith("symattn generate --spec-file")
    assert main(shlex.split(command)[1:] + ["--check"]) == 0  # the named command renders the file as it is
    assert "stale" not in capsys.readouterr().out


def test_check_and_cost_take_a_spec_file(capsys):
    # the user path is the built-in path: check and derive --cost work on a spec file too
    assert main(["check", "--spec-file", str(EXAMPLE), "--wrt", "W_V", "X.T * P.T * G"]) == 0
    assert capsys.readouterr().out.startswith("right: ∂f/∂W_V for sigmoid_attention")
    assert main(["check", "--spec-file", str(EXAMPLE), "--wrt", "W_V", "X.T * G"]) == 1
    assert "counterexample" in capsys.readouterr().out
    assert main(["derive", "--spec-file", str(EXAMPLE), "--cost"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cost of sigmoid_attention") and "generated backward" in out


def test_order_1_generates_the_first_closed_form_only(tmp_path, capsys):
    """--order 1: no hvp, a torch module that refuses double backward, and a header that regenerates it as it is."""
    out = tmp_path / "first"
    assert main(["generate", "--spec-file", str(EXAMPLE), "--out", str(out), "--order", "1"]) == 0
    numpy_module = _load(out / "sigmoid_attention_numpy.py")
    assert hasattr(numpy_module, "backward") and not hasattr(numpy_module, "hvp")
    full = tmp_path / "full"
    assert main(["generate", "--spec-file", str(EXAMPLE), "--out", str(full), "--backend", "numpy"]) == 0
    assert hasattr(_load(full / "sigmoid_attention_numpy.py"), "hvp")
    command = (out / "sigmoid_attention_numpy.py").read_text().splitlines()[2].removeprefix("#   ")
    assert command.endswith("--order=1")
    assert main(shlex.split(command)[1:] + ["--check"]) == 0
    torch = pytest.importorskip("torch", reason="the torch backend needs torch")
    module = _load(out / "sigmoid_attention_torch.py")
    x = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((4, 3), (3, 2), (3, 2), (3, 5))]
    (g,) = torch.autograd.grad(module.forward(*x).sum(), [x[1]], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        g.sum().backward()
