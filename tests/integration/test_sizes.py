"""Product orders at a user's sizes: one schedule per size regime, chosen at call time from the arrays' shapes
(``schedule.regimes``), or the one schedule of the sizes stated with ``symattn generate --size``
(``render(..., sizes=)``)."""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.cli import main
from symattn.codegen.generate import render
from symattn.codegen.report.cost_report import schedule_counts
from symattn.codegen.schedule.build import schedule_spec
from symattn.codegen.schedule.regimes import regimes
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


def test_generate_takes_the_users_sizes_and_dispatches_without_them(tmp_path, capsys):
    """Without --size the module holds one schedule per size regime and says nothing; with every dimension stated,
    one schedule: the header's command repeats the sizes, --check agrees."""
    spec_file = tmp_path / "gated_g.py"
    spec_file.write_text(SPEC_FILE)
    out = tmp_path / "out"
    argv = ["generate", "--spec-file", str(spec_file), "--out", str(out), "--backend", "numpy", "--order", "1"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""
    assert "def _schedule_at(d, g, n):" in (out / "gated_g_numpy.py").read_text()
    sized = [*argv, "--size", "g=256", "--size", "n=1024", "--size", "d=64"]
    assert main(sized) == 0
    assert capsys.readouterr().err == ""
    text = (out / "gated_g_numpy.py").read_text()
    assert "--size=g=256 --size=n=1024 --size=d=64" in text and "_schedule_at" not in text
    assert main([*sized, "--check"]) == 0


def test_the_schedule_dispatched_at_call_time_costs_what_the_stated_sizes_cost():
    """At g = 256, n = 1024, d = 64 the cheapest regime's FLOPs (what ``_schedule_at`` picks) are the FLOPs of the
    schedule made with those sizes stated, a third of the typical-size schedule's."""
    sizes = {sp.Symbol(k, positive=True, integer=True): v for k, v in SIZES.items()}
    found = regimes(lambda: schedule_spec(gated()))
    assert len(found) == 3
    at = [float(r.flops.subs({s: sizes[s] for s in r.flops.free_symbols})) for r in found]
    with sizes_at(SIZES):
        forward, backward, _ = schedule_counts(gated(), SIZES)
    assert min(at) == forward + backward
    assert min(at) < 0.4 * at[0]


def _reference(x, w_q, w_k, w_v, w_g):
    return (torch_module().softmax((x @ w_q) @ (x @ w_k).mT / w_q.shape[-1] ** 0.5, -1) @ (x @ w_v)) * (
        torch_module().sigmoid(x @ w_g)
    )


def torch_module():
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("backend", "variant"),
    [("numpy", "standard"), ("torch", "standard"), ("jax", "standard"), ("numpy", "memeff"), ("torch", "memeff")],
)
def test_every_regime_of_the_dispatching_module_matches_autograd(backend, variant):
    """The module generated without sizes runs each of its schedules at sizes where that one is cheapest, and each
    gives the output and every gradient of torch autograd of an independent forward (float64); torch's second
    order (hvp) and forward mode (jvp) too. The memory-efficient variant's loops over blocks of rows take every
    regime's orders (Xᵀ dF = Σ_b X_bᵀ dF_b with X read whole as keys too)."""
    torch = torch_module()
    if backend == "jax":
        pytest.importorskip("jax")
        import jax

        jax.config.update("jax_enable_x64", True)
    spec = gated()
    made = types.ModuleType(f"gated_g_{backend}")
    second = backend == "torch" and variant == "standard"
    exec(compile(render(spec, backend, variant, second_order=second), made.__name__, "exec"), made.__dict__)
    at = {0: (5, 7, 3)}  # the memory-efficient variant: the regimes whose orders its blocks of rows can take
    for n, g, d in itertools.product(range(3, 10), repeat=3) if hasattr(made, "_schedule_at") else ():
        at.setdefault(made._schedule_at(d, g, n), (n, g, d))
    assert variant == "memeff" or sorted(at) == [0, 1, 2], at
    rng = np.random.default_rng(0)
    for n, g, d in at.values():
        values = [rng.standard_normal((2, n, g))] + [rng.standard_normal((g, d)) / 2 for _ in range(4)]
        leaves = [torch.tensor(v, requires_grad=True) for v in values]
        want_out = _reference(*leaves)
        cotangent = torch.tensor(rng.standard_normal((2, n, d)))
        want = torch.autograd.grad(want_out, leaves, cotangent, create_graph=True)
        blocks = {"block_size": 2} if variant == "memeff" else {}  # n ≥ 3: two blocks or more
        if backend == "torch":
            out = made.forward(*leaves, **blocks)
            got = [t.numpy() for t in torch.autograd.grad(out, leaves, cotangent)]
            out = out.detach().numpy()
        elif backend == "numpy":
            out, saved = made.forward(*values, **blocks)
            grads = made.backward(saved, cotangent.numpy())
            got = [grads[str(x.name)] for x in spec.inputs]
        else:
            out, pullback = jax.vjp(made.forward, *values)
            got = pullback(cotangent.numpy())
        if second:
            direction = {str(x.name): torch.tensor(rng.standard_normal(v.shape)) for x, v in zip(spec.inputs, values)}
            hvp = made.hvp(*[t.detach() for t in leaves], cotangent, direction)
            inner = sum((w * direction[str(x.name)]).sum() for w, x in zip(want, spec.inputs))
            want_hvp = torch.autograd.grad(inner, leaves, retain_graph=True)
            for x, h in zip(spec.inputs, want_hvp):
                np.testing.assert_allclose(hvp[str(x.name)].numpy(), h.numpy(), rtol=1e-9, atol=1e-11)
            tangents = tuple(direction[str(x.name)] for x in spec.inputs)
            _, tangent = made.jvp(*[t.detach() for t in leaves], direction)
            _, want_tangent = torch.func.jvp(_reference, tuple(t.detach() for t in leaves), tangents)
            np.testing.assert_allclose(tangent.numpy(), want_tangent.numpy(), rtol=1e-9, atol=1e-11)
        np.testing.assert_allclose(np.asarray(out), want_out.detach().numpy(), rtol=1e-10, atol=1e-12)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=1e-10, atol=1e-12)


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


def test_the_dispatching_module_compiles_whole_at_new_sizes():
    """torch.compile(fullgraph=True) of the module: the second call, at sizes of another regime, recompiles with
    symbolic shapes (the choice guarded, the scale 1/√d made again in the backward from the saved d, not saved as a
    float) and gives autograd's output and gradients."""
    torch = torch_module()
    made = types.ModuleType("gated_g_torch")
    exec(compile(render(gated(), "torch", second_order=False), made.__name__, "exec"), made.__dict__)
    compiled = torch.compile(made.forward, fullgraph=True)
    chosen = []
    for n, g, d in ((6, 5, 3), (9, 4, 7)):
        chosen.append(made._schedule_at(d, g, n))
        leaves = [torch.randn(2, n, g, dtype=torch.float64, requires_grad=True)]
        leaves += [torch.randn(g, d, dtype=torch.float64, requires_grad=True) for _ in range(4)]
        out = compiled(*leaves)
        want = _reference(*leaves)
        got, expected = torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(want.sum(), leaves)
        np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)
    assert len(set(chosen)) == 2, chosen
