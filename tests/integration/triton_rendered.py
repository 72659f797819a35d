"""The Triton modules' test helpers: a module rendered and loaded under Triton's interpreter, the gallery's specs,
float64 eager references written from their formulas, random inputs and the comparison."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import runpy
from pathlib import Path

import pytest
import sympy as sp

# the Triton tests' modules import this first: without the interpreter, torch or triton, they skip
if os.environ.setdefault("TRITON_INTERPRET", "1") != "1":  # (before triton's first import; tests/conftest.py too)
    pytest.skip("TRITON_INTERPRET is set off: these tests run the kernels on CPU tensors", allow_module_level=True)
torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="the Triton backend's tests need triton (the main CI leg installs it)")

import symattn as sa  # noqa: E402
from symattn.codegen.generate import render  # noqa: E402
from symattn.specs import dim  # noqa: E402

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"
N, M, D, DV, D_MODEL = 37, 45, 24, 20, 28


@contextlib.contextmanager
def interpreted():
    """TRITON_INTERPRET=1 while a module's kernels are decorated (triton.jit reads it then): CPU tensors run."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_MODULES: dict[str, object] = {}


def triton_module(source, folder: Path):
    """The rendered Triton module of a built-in name or a Spec, written to a file (triton.jit reads its source)."""
    name = source if isinstance(source, str) else source.name
    if name not in _MODULES:
        path = folder / f"{name}_triton.py"
        path.write_text(render(source, "triton"), encoding="utf-8")
        spec = importlib.util.spec_from_file_location(f"{name}_triton", path)
        module = importlib.util.module_from_spec(spec)
        with interpreted():
            spec.loader.exec_module(module)
        _MODULES[name] = module
    return _MODULES[name]


def gallery(name: str) -> sa.Spec:
    return runpy.run_path(str(GALLERY / f"{name}_attention.py"))["spec"]


def attend(a, v, causal: bool, softmax: bool = True, summed: bool = False):
    """N(A) V in float64, causal: query i sees keys j <= i (−inf before a softmax, zero otherwise); summed: each
    row of A divided by its sum."""
    if causal:
        hidden = torch.ones(a.shape[-2:], dtype=torch.bool).triu(1)
        a = a.masked_fill(hidden, -math.inf) if softmax else a.masked_fill(hidden, 0.0)
    if summed:
        return (a / a.sum(-1, keepdim=True)) @ v
    return (torch.softmax(a, -1) if softmax else a) @ v


def _hidden(a, causal: bool):
    """a with −inf where causal hides a key (j > i)."""
    return a.masked_fill(torch.ones(a.shape[-2:], dtype=torch.bool).triu(1), -math.inf) if causal else a


def _unit_rows(x):
    return x / x.pow(2).sum(-1, keepdim=True).sqrt()


def _layer_norm(x, gamma, beta):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5) * gamma + beta


# the gallery specs the kernels cover (and the built-in self_attention), each with an eager forward written from its
# formula
REFERENCES = {
    "softcap": lambda x, c: attend(50 * torch.tanh(_qk(x) / (50 * math.sqrt(D))), x["X"] @ x["W_V"], c),
    "temperature": lambda x, c: attend(x["tau"] * _qk(x), x["X"] @ x["W_V"], c),
    "bias": lambda x, c: attend(_qk(x) / math.sqrt(D) + x["B"], x["X"] @ x["W_V"], c),
    "sigmoid": lambda x, c: attend(torch.sigmoid(_qk(x) / math.sqrt(D)), x["X"] @ x["W_V"], c, softmax=False),
    "relu": lambda x, c: attend(torch.relu(_qk(x) / math.sqrt(D)), x["X"] @ x["W_V"], c, softmax=False) / N,
    "softplus": lambda x, c: attend(
        torch.nn.functional.softplus(_qk(x) / math.sqrt(D)), x["X"] @ x["W_V"], c, softmax=False, summed=True
    ),
    "differential": lambda x, c: (
        attend(_qk(x, "1") / math.sqrt(D), x["X"] @ x["W_V"], c)
        - x["lam"] * attend(_qk(x, "2") / math.sqrt(D), x["X"] @ x["W_V"], c)
    ),
    "pointer": lambda x, c: torch.log_softmax(_hidden(_qk(x) / math.sqrt(D), c), -1),
    "gated": lambda x, c: attend(_qk(x) / math.sqrt(D), x["X"] @ x["W_V"], c) * torch.sigmoid(x["X"] @ x["W_G"]),
    "cosine": lambda x, c: attend(
        10 * _unit_rows(x["X"] @ x["W_Q"]) @ _unit_rows(x["X"] @ x["W_K"]).mT, x["X"] @ x["W_V"], c
    ),
    "self_attention": lambda x, c: attend(_qk(x) / math.sqrt(D), x["X"] @ x["W_V"], c),  # the built-in
    "qk_norm": lambda x, c: attend(
        _layer_norm(x["X"] @ x["W_Q"], x["gamma_Q"], x["beta_Q"])
        @ _layer_norm(x["X"] @ x["W_K"], x["gamma_K"], x["beta_K"]).mT
        / math.sqrt(D),
        x["X"] @ x["W_V"],
        c,
    ),
}


def _qk(x, which: str = ""):
    return (x["X"] @ x[f"W_Q{which}"]) @ (x["X"] @ x[f"W_K{which}"]).mT


def random_inputs(spec: sa.Spec, generator) -> dict:
    """Random float32 inputs of the spec: X batched (2, 2, n, d_model), weights unbatched, B per batch·head."""
    shapes = {"X": (2, 2, N, D_MODEL), "W_V": (D_MODEL, DV), "W_G": (D_MODEL, DV), "B": (2, 2, N, N)}
    shapes |= {name: (D_MODEL, D) for name in ("W_Q", "W_K", "W_Q1", "W_K1", "W_Q2", "W_K2")}
    shapes |= {name: (1, D) for name in ("gamma_Q", "beta_Q", "gamma_K", "beta_K")}
    out = {}
    for name in spec.input_names:
        value = torch.randn(shapes.get(name, ()), generator=generator) / (2 if name.startswith("W") else 1)
        out[name] = (
            value + 1 if name.startswith("gamma") else value.abs() if name in ("tau", "lam") else value
        ).requires_grad_()
    return out


def compare(got, want, what: str, rtol: float = 1e-5) -> float:
    """got (float32) against want (float64) to rtol of want's largest entry, or absolutely where that is below 1
    (an identically zero gradient: dβ_K, the softmax being shift-invariant); the error, relative to that."""
    finite = want[want.isfinite()]  # a log-probability is −inf where a key is hidden: got must be so too
    scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    error = torch.where(got.double() == want, 0.0, got.double() - want).abs().max().item() / scale
    assert error <= rtol, f"{what}: error {error:.2e} of {scale:.2e}"
    return error


def features_spec() -> sa.Spec:
    """Every kind of step the kernels print in one core: a function, a trainable scalar, an n × m input (its
    gradient written tile by tile) and the additive mask (a constant, optional)."""
    n, m, d_k, d_v = dim("n"), dim("m"), dim("d_k"), dim("d_v")
    q, k, v = sa.matrix("Q", n, d_k), sa.matrix("K", m, d_k), sa.matrix("V", m, d_v)
    b, mask, tau = sa.matrix("B", n, m), sa.matrix("M", n, m), sp.Symbol("tau", real=True)
    a = tau * sa.tanh(q * k.T / sp.sqrt(d_k)) + b + mask
    summary = "softmax(τ tanh(Q Kᵀ / √d_k) + B + M) V"
    return sa.Spec("kernel_features", summary, (q, k, v, b, tau), sa.softmax(a) * v, constants=(mask,))


def counted(module, monkeypatch) -> tuple[list[int], dict[bool, int]]:
    """([the interpreter's tl.dot calls], {flag: the module's _kept calls with its mask flag on, off}) from now on:
    the tiles a kernel visits (its dots per tile) and those it reads without the mask (a full tile's pass)."""
    from triton.runtime.interpreter import InterpreterBuilder

    dots, flags = [0], {True: 0, False: 0}
    create_dot, kept = InterpreterBuilder.create_dot, module._kept

    def counted_dot(self, *args, **kwargs):
        dots[0] += 1
        return create_dot(self, *args, **kwargs)

    def counted_kept(value, valid, fill, masked):
        flags[bool(getattr(masked, "value", masked))] += 1
        return kept(value, valid, fill, masked)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", counted_dot)
    monkeypatch.setattr(module, "_kept", counted_kept)
    return dots, flags
