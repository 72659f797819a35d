"""Every spec a user writes over the language: never a silent wrong number, every form generates.

- Regression cases (issue 25), each once silently wrong or broken: an intermediate labelled dY beside
  an input Y, an input dX beside X, a masked softmax as a term of a sum, batched inputs beside
  parameters (an unused batched input, a per-batch scalar factor in a weight's gradient), Trace and
  sa.sum as scalar factors (derived step by step too), transposed outputs, exp(τ) of a trainable
  scalar, a value whose double transpose named itself ("cyclic schedule").
- Regression cases (issue 39), each found by the fuzz over thousands of seeds: σ(Z)'s saved output named Z over
  an input Z, a batched value written into a value of the weights alone, torch's in-place chain written into
  its last operand, softmax into strided memory, a bias's gradient through a row sum, two gradients each
  written as the other's negation, sum(X − X) as a factor, τ times a sum with a trace.
- The language fuzz (``language_fuzz``): random specs over every node and form, derive --verify,
  generated NumPy, torch and JAX modules against torch autograd of an independently written forward.
  Every outcome must be success.
"""

from __future__ import annotations

import functools

import pytest
import sympy as sp

import symattn as sa
from symattn.errors import SymattnError
from symattn.specs import dim

torch = pytest.importorskip("torch", reason="the references are torch autograd")
pytest.importorskip("jax", reason="the fuzz generates the JAX backend too")

from language_fuzz import BACKENDS, load, run_case  # noqa: E402

QUICK_SEEDS = 60
SLOW_SEEDS = 300  # seeds QUICK_SEEDS … SLOW_SEEDS − 1 are slow-marked: 300 in all, about 0.15 s each

n, d, m = dim("n"), dim("d"), dim("m")
X, Y, V = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("Y", n, d), sp.MatrixSymbol("V", m, d)
W_Q, W_K, W_V = (sp.MatrixSymbol(f"W_{k}", d, d) for k in "QKV")
tau = sp.Symbol("tau", real=True)


def _compare(spec: sa.Spec, reference, shapes, keywords=None, constants=()) -> None:
    """Every backend's output and gradients against torch autograd of reference, float64; constants: the
    shapes of the fixed constants, passed after the inputs; keywords: the shapes of keyword arrays."""
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    fixed = [torch.randn(s, generator=gen, dtype=torch.float64) for s in constants]
    extra = {k: torch.randn(s, generator=gen, dtype=torch.float64) for k, s in (keywords or {}).items()}
    inputs = [a.clone().requires_grad_(True) for a in args]
    expected = reference(*inputs, *fixed, **extra)
    g = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    want = [
        torch.zeros_like(a) if r is None else r
        for a, r in zip(inputs, torch.autograd.grad(expected, inputs, g, allow_unused=True))
    ]
    names = [str(x.name) for x in spec.inputs]
    for backend in BACKENDS:
        module = load(spec, backend)
        if backend == "numpy":
            arrays = [a.numpy() for a in (*args, *fixed)]
            out, saved = module.forward(*arrays, **{k: v.numpy() for k, v in extra.items()})
            grads = module.backward(saved, g.numpy())
            got = [torch.as_tensor(np.asarray(grads[k])) for k in names]
        elif backend == "torch":
            leaves = [a.clone().requires_grad_(True) for a in args]
            out = module.forward(*leaves, *fixed, **extra)
            got = torch.autograd.grad(out, leaves, g, allow_unused=True)
            got = [torch.zeros_like(a) if r is None else r for a, r in zip(leaves, got)]
        else:
            import jax.numpy as jnp

            jextra = {k: jnp.asarray(v.numpy()) for k, v in extra.items()}
            held = [jnp.asarray(c.numpy()) for c in fixed]
            forward = functools.partial(_with_constants, module.forward, held, jextra)
            out, vjp = jax.vjp(forward, *(jnp.asarray(a.numpy()) for a in args))
            got = [torch.as_tensor(np.asarray(x)) for x in vjp(jnp.asarray(g.numpy()))]
        out = torch.as_tensor(np.asarray(out.detach() if isinstance(out, torch.Tensor) else out))
        torch.testing.assert_close(out, expected.detach(), rtol=1e-10, atol=1e-12, msg=f"{backend} output")
        for name, a, b in zip(names, got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{backend} d{name}")


def _with_constants(forward, constants, keywords, *inputs):
    return forward(*inputs, *constants, **keywords)


def test_an_intermediate_labelled_like_an_inputs_gradient_keeps_its_value():
    q = X * W_Q
    p = sa.softmax(q * Y.T)
    spec = sa.Spec("labels_d", "", (X, Y, W_Q), p * Y, (("dX", q), ("dY", p)))
    _compare(spec, lambda x, y, w: torch.softmax(x @ w @ y.mT, -1) @ y, [(2, 4, 3), (2, 4, 3), (3, 3)])


def test_an_intermediate_labelled_like_a_parameter_keeps_its_batch():
    """W_h = X W_Q, b_x = its softmax: values of the batch, not weights (their cotangents were summed over it)."""
    h = X * W_Q
    p = sa.softmax(h * X.T)
    spec = sa.Spec("labels_w", "", (X, W_Q), p * h, (("W_h", h), ("b_x", p)))
    _compare(spec, lambda x, w: torch.softmax(x @ w @ x.mT, -1) @ x @ w, [(2, 4, 3), (3, 3)])


def test_an_input_named_like_another_inputs_gradient():
    dx = sp.MatrixSymbol("dX", n, d)
    spec = sa.Spec("inputs_d", "", (X, dx, W_Q), sa.softmax(X * W_Q * dx.T) * X)
    assert sa.derive(spec).verify().ok
    _compare(spec, lambda x, dx, w: torch.softmax(x @ w @ dx.mT, -1) @ x, [(2, 4, 3), (2, 4, 3), (3, 3)])


def test_a_masked_softmax_inside_a_sum_keeps_every_term():
    """(B + softmax(X W Xᵀ + M)) X: the masked softmax's conditional is bracketed (the sum lost B before)."""
    mask, b = sp.MatrixSymbol("M", n, n), sp.MatrixSymbol("B", n, n)
    spec = sa.Spec("masked_term", "", (X, W_Q, b), (b + sa.softmax(X * W_Q * X.T + mask)) * X, constants=(mask,))

    def reference(x, w, b, attn_mask):
        return (b + torch.softmax(x @ w @ x.mT + attn_mask, -1)) @ x

    _compare(spec, reference, [(2, 4, 3), (3, 3), (2, 4, 4)], keywords={"attn_mask": (4, 4)})


def test_a_softmax_the_forward_computes_is_saved_not_recomputed():
    """softmax(X W Xᵀ + M), unnamed inside (B + softmax(…)) X: the backward reads it saved (it recomputed the
    GEMM and the softmax)."""
    from symattn.codegen.schedule.build import schedule_spec
    from symattn.lang.graph import nodes
    from symattn.lang.ops import RowSoftmax

    mask, b = sp.MatrixSymbol("M", n, n), sp.MatrixSymbol("B", n, n)
    spec = sa.Spec("saved_softmax", "", (X, W_Q, b), (b + sa.softmax(X * W_Q * X.T + mask)) * X, constants=(mask,))
    sched = schedule_spec(spec)
    assert not any(isinstance(node, RowSoftmax) for a in sched.backward for node in nodes(a.value))
    assert any(isinstance(a.value, RowSoftmax) for a in sched.forward)


def test_batched_inputs_beside_parameters():
    """An unused batched input gets zeros of its batched shape (not a shared unbatched array); a weight whose
    gradient has a per-batch scalar factor (𝟏ᵀV𝟏) sums it batch by batch."""
    u = sp.MatrixSymbol("U", m, d)
    out = sa.sum(V) * sa.softmax(X * W_Q * X.T) * X * W_V
    spec = sa.Spec("batched", "", (X, V, u, W_Q, W_V), out)

    def reference(x, v, u, wq, wv):
        return v.sum((-2, -1), keepdim=True) * torch.softmax(x @ wq @ x.mT, -1) @ x @ wv

    _compare(spec, reference, [(2, 4, 3), (2, 5, 3), (2, 5, 3), (3, 3), (3, 3)])


def test_a_weights_gradient_is_not_read_as_a_per_batch_value():
    """dW = Σ_batch Y ⊙ G; dY's term Y ⊙ G (per batch) was read as dW (the batch's sum)."""
    w = sp.MatrixSymbol("W_Q", d, n)
    y = sa.sum(sp.MatrixSymbol("C", n, n)) * X.T
    spec = sa.Spec(
        "weight_reuse", "", (X, w), sa.hadamard(y, y + w), (("Y", y),), constants=(sp.MatrixSymbol("C", n, n),)
    )

    def reference(x, w, c):
        y = c.sum() * x.mT
        return y * (y + w)

    _compare(spec, reference, [(2, 4, 3), (3, 4)], constants=[(4, 4)])


def test_fixed_constants_are_arguments_without_a_gradient():
    """A positional table added to X, a fixed matrix multiplied in, ALiBi's distances scaled by a trainable
    slope: forward takes them after the inputs; the additive mask keeps attn_mask."""
    e, c, dist, mask = (
        sp.MatrixSymbol(k, *s) for k, s in (("E", (n, d)), ("C", (d, d)), ("Dist", (n, n)), ("M", (n, n)))
    )
    slope = sp.Symbol("slope", real=True)
    h = X + e
    out = sa.softmax(h * W_Q * c * h.T - slope * dist + mask) * X
    spec = sa.Spec("fixed", "", (X, W_Q, slope), out, constants=(e, c, dist, mask))

    def reference(x, w, s, e, c, dist, attn_mask):
        h = x + e
        return torch.softmax(h @ w @ c @ h.mT - s * dist + attn_mask, -1) @ x

    shapes = [(2, 4, 3), (3, 3), ()]
    _compare(spec, reference, shapes, constants=[(4, 3), (3, 3), (4, 4)], keywords={"attn_mask": (4, 4)})


def test_trace_as_a_scalar_factor_derives_and_generates():
    out = sp.Trace(W_Q) * sa.softmax(X * W_Q * X.T) * X
    spec = sa.Spec("trace_factor", "", (X, W_Q), out)
    assert sa.derive(spec).verify().ok
    _compare(spec, lambda x, w: torch.diagonal(w).sum() * torch.softmax(x @ w @ x.mT, -1) @ x, [(2, 4, 3), (3, 3)])


def test_a_transposed_output():
    p = sa.softmax(X * W_Q * X.T)
    spec = sa.Spec("transposed", "", (X, W_Q, W_V), (p * X * W_V).T, (("P", p),))
    _compare(spec, lambda x, w, v: (torch.softmax(x @ w @ x.mT, -1) @ x @ v).mT, [(2, 4, 3), (3, 3), (3, 3)])


def test_functions_of_a_trainable_scalar():
    out = sa.softmax(sp.exp(tau) * X * W_Q * X.T + X * W_K * X.T / tau**2) * X
    spec = sa.Spec("scalar_functions", "", (X, W_Q, W_K, tau), out)

    def reference(x, wq, wk, t):
        return torch.softmax(torch.exp(t) * x @ wq @ x.mT + x @ wk @ x.mT / t**2, -1) @ x

    _compare(spec, reference, [(2, 4, 3), (3, 3), (3, 3), ()])


def test_a_value_whose_double_transpose_is_its_own_name():
    q = sp.MatrixSymbol("Q", n, d)
    t = sa.exp(sa.tanh(q * q.T)) / 2
    spec = sa.Spec("double_transpose", "", (q,), sa.sigmoid(t).T, (("T", t),))
    _compare(spec, lambda q: torch.sigmoid(torch.exp(torch.tanh(q @ q.mT)) / 2).mT, [(2, 4, 3)])


def test_an_entrywise_functions_saved_output_never_takes_an_inputs_name():
    """σ(Z) saved for the backward is named by σ's letter, Z, unless taken: it overwrote the input Z that
    sum(Z) reads after it (a wrong output), and with σ(W_Q) of a weight the unbatched σ(W_Q) stood where the
    batched input was expected (the output and the arrays written into lost their batch axes)."""
    z, w = sp.MatrixSymbol("Z", n, d), sp.MatrixSymbol("W_Q", d, n)
    spec = sa.Spec("sigmoid_of_z", "", (z,), sa.sum(z) * sa.sigmoid(z))
    _compare(spec, lambda z: z.sum((-2, -1), keepdim=True) * torch.sigmoid(z), [(2, 4, 3)])
    spec = sa.Spec("sigmoid_of_w", "", (z, w), sa.sum(z) * sa.sigmoid(sa.sigmoid(w)))
    _compare(spec, lambda z, w: z.sum((-2, -1), keepdim=True) * torch.sigmoid(torch.sigmoid(w)), [(2, 4, 3), (3, 4)])


def test_a_batched_value_is_never_written_into_a_value_of_the_weights():
    """sum(X)·σ(W Wᵀ): dW reads (𝟏𝟏ᵀ − F) ⊙ F ⊙ dF with F = σ(W Wᵀ) of the weights alone (d × d) and dF = sum(X)·G
    per batch; F, a name but no input, counted as batched, so the product was written into 𝟏𝟏ᵀ − F (NumPy:
    non-broadcastable output operand with shape (3,3) doesn't match the broadcast shape (2,3,3))."""
    w = sp.MatrixSymbol("W_K", d, m)
    spec = sa.Spec("weights_alone", "", (X, w), sa.sum(X) * sa.sigmoid(w * w.T))
    _compare(spec, lambda x, w: x.sum((-2, -1), keepdim=True) * torch.sigmoid(w @ w.mT), [(2, 4, 3), (3, 5)])


def test_an_in_place_chain_writes_into_the_whole_value():
    """dW = s·((𝟏𝟏ᵀ + T₁ − D 𝟏ᵀ) ⊙ P), P = softmax(W): torch's chain called mul_ on its last operand (1 + T₁ −
    D.mul_(P)), writing the d × d product into D, a d × 1 column; the method is called on the bracketed sum."""
    spec = sa.Spec("tanh_softmax", "", (X, W_Q), sa.sum(sa.tanh(sa.softmax(W_Q))) * X)
    _compare(spec, lambda x, w: torch.tanh(torch.softmax(w, -1)).sum() * x, [(2, 4, 3), (3, 3)])


def test_a_softmax_of_a_transposed_value():
    """softmax(−Xᵀ): −Xᵀ keeps Xᵀ's strides, and torch's softmax written into strided memory is wrong."""
    spec = sa.Spec("softmax_transposed", "", (X,), sa.softmax(-X.T))
    _compare(spec, lambda x: torch.softmax(-x.mT, -1), [(2, 4, 3)])


def test_a_bias_gradient_through_a_row_sum_keeps_its_shape():
    """d/db rowsum(X + 𝟏b) = 𝟏ᵀ G 𝟏_{1×d}, a row (1 × d): it was summed to a 0-d scalar like 𝟏ᵀ G 𝟏 (a trainable
    scalar's gradient)."""
    b = sp.MatrixSymbol("b_1", 1, d)
    spec = sa.Spec("rowsum_bias", "", (X, b), sa.rowsum(X + sp.OneMatrix(n, 1) * b))
    _compare(spec, lambda x, b: (x + b).sum(-1, keepdim=True), [(2, 4, 3), (1, 3)])


def test_gradients_equal_up_to_sign_are_not_written_by_each_other():
    """dX = 3 G 𝟏ᵀ and d(dX) = −3 G 𝟏ᵀ: each was found as the other's negation (dX = −ddX, ddX = −dX), a cycle
    ("cyclic schedule"); a value may read another only where that one does not read it back."""
    dx = sp.MatrixSymbol("dX", n, d)
    spec = sa.Spec("negations", "", (X, dx), sa.rowsum(3 * X - 3 * dx))
    _compare(spec, lambda x, dx: (3 * x - 3 * dx).sum(-1, keepdim=True), [(2, 4, 3), (2, 4, 3)])


def test_a_trainable_scalar_times_a_sum_with_a_trace():
    """τ tr(I + C) X = τ (d + tr C) X: dτ = (d + tr C) tr(Gᵀ X), whose first traced factor, d + tr C, was taken
    for the trace (refused: "a scalar gradient that is not linear in traces of matrices: d")."""
    c = sp.MatrixSymbol("C", d, d)
    spec = sa.Spec("trace_sum", "", (X, tau), tau * sp.Trace(sp.Identity(d) + c) * X, constants=(c,))

    def reference(x, t, c):
        return t * (3 + torch.diagonal(c).sum()) * x

    _compare(spec, reference, [(2, 4, 3), ()], constants=[(3, 3)])


@pytest.mark.parametrize("output", [X - X, X * X.T + sp.Identity(n) - X * X.T, sa.sum(X - X) * X])
def test_an_output_that_depends_on_no_input_is_refused(output):
    with pytest.raises(SymattnError, match="depends on no input"):
        sa.Spec("constant", "", (X,), output)


def _fuzz(seed: int) -> None:
    outcome, detail = run_case(seed)
    assert outcome == "ok", f"seed {seed}: {outcome}: {detail}"


@pytest.mark.parametrize("seed", range(QUICK_SEEDS))
def test_language_fuzz(seed):
    _fuzz(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(QUICK_SEEDS, SLOW_SEEDS))
def test_language_fuzz_more_seeds(seed):
    _fuzz(seed)
