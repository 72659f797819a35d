"""Product orders at a user's sizes: ``symattn generate --size`` (``render(..., sizes=)``) and the notes that name
the products whose order was fixed at typical sizes although it depends on them (issue 39, item 2)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.cli import main
from symattn.codegen.generate import render
from symattn.codegen.report.cost_report import schedule_counts
from symattn.optimize.cost import TYPICAL_SIZES, sizes_at
from symattn.specs import dim

SPEC_FILE = """
import sympy as sp
import symattn as sa
from symattn.specs import dim

n, g, d = dim("n"), dim("g"), dim("d")
X = sa.matrix("X", n, g)
W_Q, W_K, W_V, W_G = (sa.matrix(f"W_{c}", g, d) for c in "QKVG")
P = sa.softmax(X * W_Q * (X * W_K).T / sp.sqrt(d))
spec = sa.Spec("gated_g", "gated attention", (X, W_Q, W_K, W_V, W_G), sa.hadamard(P * X * W_V, sa.sigmoid(X * W_G)))
"""
SIZES = {"n": 1024, "g": 256, "d": 64}


def gated() -> sa.Spec:
    """Gated attention with the model width a dimension symattn has no size for (g: priced at 64)."""
    n, g, d = dim("n"), dim("g"), dim("d")
    x = sa.matrix("X", n, g)
    w_q, w_k, w_v, w_g = (sa.matrix(f"W_{c}", g, d) for c in "QKVG")
    p = sa.softmax(x * w_q * (x * w_k).T / sp.sqrt(d))
    return sa.Spec("gated_g", "gated attention", (x, w_q, w_k, w_v, w_g), sa.hadamard(p * x * w_v, sa.sigmoid(x * w_g)))


def test_the_schedule_at_the_users_sizes_costs_less_there():
    """At g = 4·d, (X W_Q W_Kᵀ) Xᵀ and (P X) W_V cost 2·n²·g where (X W_Q)(X W_K)ᵀ and P (X W_V) cost 2·n²·d:
    scheduled at the sizes the model runs at, forward and backward cost a third of the typical-size schedule
    (FLOPs counted on the generated schedule, no timing), and the table is restored after the block."""
    spec = gated()
    typical_forward, typical_backward, _ = schedule_counts(spec, SIZES)
    before = dict(TYPICAL_SIZES)
    with sizes_at(SIZES):
        forward, backward, _ = schedule_counts(gated(), SIZES)
    assert TYPICAL_SIZES == before
    assert forward < 0.4 * typical_forward and backward < 0.4 * typical_backward, (forward, typical_forward)  # 0.32


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_module_generated_at_the_users_sizes_matches_autograd(backend):
    """The reordered module computes the same function: output and every gradient against torch autograd of an
    independently written forward (float64)."""
    torch = pytest.importorskip("torch")
    spec = gated()
    made = types.ModuleType(f"gated_g_{backend}")
    exec(compile(render(spec, backend, sizes=SIZES, second_order=False), made.__name__, "exec"), made.__dict__)
    rng = np.random.default_rng(0)
    n, g, d = 5, 7, 3
    values = [rng.standard_normal((2, n, g))] + [rng.standard_normal((g, d)) / 2 for _ in range(4)]
    leaves = [torch.tensor(v, requires_grad=True) for v in values]
    x, w_q, w_k, w_v, w_g = leaves
    want_out = (torch.softmax((x @ w_q) @ (x @ w_k).mT / d**0.5, -1) @ (x @ w_v)) * torch.sigmoid(x @ w_g)
    cotangent = torch.tensor(rng.standard_normal((2, n, d)))
    want = torch.autograd.grad(want_out, leaves, cotangent)
    if backend == "numpy":
        out, saved = made.forward(*values)
        grads = made.backward(saved, cotangent.numpy())
        got = [grads[str(x.name)] for x in spec.inputs]
    else:
        out = made.forward(*leaves)
        got = [t.numpy() for t in torch.autograd.grad(out, leaves, cotangent)]
        out = out.detach().numpy()
    np.testing.assert_allclose(out, want_out.detach().numpy(), rtol=1e-10, atol=1e-12)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-10, atol=1e-12)


def test_generate_names_the_products_ordered_at_typical_sizes_and_takes_the_users(tmp_path, capsys):
    """Without --size: one note per product whose cheapest order depends on sizes (priced at g = 64), and how to
    state them; with every dimension stated: no note, the header's command repeats the sizes, --check agrees."""
    spec_file = tmp_path / "gated_g.py"
    spec_file.write_text(SPEC_FILE)
    out = tmp_path / "out"
    argv = ["generate", "--spec-file", str(spec_file), "--out", str(out), "--backend", "numpy", "--order", "1"]
    assert main(argv) == 0
    notes = capsys.readouterr().err.splitlines()
    assert any("P X W_V is ordered for d=64, g=64, n=512" in line for line in notes), notes
    assert notes[-1].endswith("state your model's sizes with --size DIM=SIZE")
    sized = [*argv, "--size", "g=256", "--size", "n=1024", "--size", "d=64"]
    assert main(sized) == 0
    assert capsys.readouterr().err == ""
    assert "--size=g=256 --size=n=1024 --size=d=64" in (out / "gated_g_numpy.py").read_text()
    assert main([*sized, "--check"]) == 0


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--size", "h=3"], "no dimension 'h' (d, g, n)"),
        (["--size", "g=0"], "positive integer"),
        (["--size", "g"], "DIM=SIZE"),
    ],
)
def test_a_bad_size_is_one_line_and_exit_2(tmp_path, capsys, extra, says):
    spec_file = tmp_path / "gated_g.py"
    spec_file.write_text(SPEC_FILE)
    assert main(["generate", "--spec-file", str(spec_file), "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err
    assert not list(tmp_path.glob("*.py"))[1:]  # only the spec file: nothing written


def test_size_applies_to_a_spec_file_only(capsys):
    assert main(["generate", "--size", "n=4"]) == 2
    assert "--spec-file only" in capsys.readouterr().err
