"""sa.from_torch: every corpus entry traced, derived (every step verified), generated, and compared with torch
autograd of the original at new inputs and sizes (float64, within 1e-9), gradients in the parameters' own
layouts; the drop-in replaces a module's forward; unsupported operations are one-line errors naming the
operation and the line."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch_corpus import ENTRIES, EXAMPLE_SIZES, NEW_SIZES  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.trace.dropin import ClosedForm, drop_in, generated_module, undo  # noqa: E402
from symattn.trace.source import trace  # noqa: E402

TOLERANCE = 1e-9
ENTRY = {e.name: e for e in ENTRIES}
TIMES: dict[str, tuple[float, float, float]] = {}


def _float_leaves(fn, args):
    """The tensors autograd differentiates: the float arguments, then the module's parameters."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    return tensors + params


def _gradients(call, fn, args, cotangent):
    leaves = _float_leaves(fn, args)
    for leaf in leaves:
        leaf.requires_grad_(True)
        leaf.grad = None
    out = call(*args)
    grads = torch.autograd.grad(out, leaves, cotangent)
    return out.detach(), [g.detach() for g in grads]


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    error = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert error <= TOLERANCE * scale, f"{what}: differs by {error:.3g}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_corpus_entry_traces_derives_generates_and_matches_autograd(entry):
    fn, args = entry.make(EXAMPLE_SIZES, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    traced = trace(fn, args)
    traced_at = time.perf_counter()
    verification = sa.derive(traced.spec).verify()
    derived_at = time.perf_counter()
    generated = generated_module(traced.spec)
    generated_at = time.perf_counter()
    TIMES[entry.name] = (traced_at - start, derived_at - traced_at, generated_at - derived_at)
    assert verification.ok, verification.text()

    # new sizes, new inputs (and for a module a new instance at the new widths): the generated code of the
    # first trace against autograd of the original
    fn2, args2 = entry.make(NEW_SIZES, torch.Generator().manual_seed(1))
    closed = ClosedForm(fn2, args2, generated=generated)
    with torch.no_grad():
        probe = fn2(*args2)
    cotangent = torch.randn(probe.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want_out, want = _gradients(fn2, fn2, args2, cotangent)
    got_out, got = _gradients(closed, fn2, args2, cotangent)
    _close(got_out, want_out, "output")
    assert len(got) == len(want)
    names = [*closed.spec.input_names]  # a fused weight is several inputs (its blocks) but one leaf
    names = names if len(names) == len(got) else [f"leaf {i}" for i in range(len(got))]
    for name, g, w in zip(names, got, want):
        _close(g, w, f"∂f/∂{name}")


def test_times_are_reported():
    """Trace, derive (with verification) and generate times per entry (seconds), for the closing note."""
    for name, (t, d, g) in TIMES.items():
        print(f"{name:28s} trace {t:6.3f}  derive+verify {d:6.3f}  generate {g:6.3f}")


def test_drop_in_replaces_forward_and_keeps_training_loop():
    """A module's forward swapped for the closed form: same outputs and parameter gradients at a new length;
    state_dict and parameters untouched; undo restores the original."""
    fn, args = ENTRY["causal_self_attention"].make(
        EXAMPLE_SIZES, torch.Generator().manual_seed(3)
    )  # nanoGPT style, causal buffer
    keys = list(fn.state_dict())
    x = torch.randn(4, 8, args[0].shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cotangent = torch.randn(4, 8, args[0].shape[-1], dtype=torch.float64)
    want_out, want = _gradients(fn, fn, (x,), cotangent)
    replacement = drop_in(fn, *args)
    assert fn.forward is replacement and list(fn.state_dict()) == keys
    got_out, got = _gradients(fn, fn, (x,), cotangent)
    _close(got_out, want_out, "output")
    for g, w in zip(got, want):
        _close(g, w, "gradient")
    # double backward: the gradient of ⟨∂f/∂W_out, V⟩ runs the second closed form
    direction = torch.randn_like(want[-2])
    second = []
    for _ in range(2):
        out = fn(x)
        (g,) = torch.autograd.grad(out, [fn.c_proj.weight], cotangent, create_graph=True)
        second.append(torch.autograd.grad((g * direction).sum(), [fn.q_attn.weight])[0])
        undo(fn)  # the second time round: the original forward
    _close(second[0], second[1], "second order")
    assert "forward" not in fn.__dict__


def test_parameters_are_named_by_state_dict_and_intermediates_by_variables():
    fn, args = ENTRY["bert_self_attention"].make(EXAMPLE_SIZES, torch.Generator().manual_seed(0))
    spec = sa.from_torch(fn, *args)
    assert spec.input_names[:3] == ("hidden_states", "query_weight", "query_bias")
    labels = [label for label, _ in spec.intermediates]
    assert {"query_layer", "attention_scores", "attention_probs", "context_layer"} <= set(labels)
    assert spec.parameters == tuple(name.replace(".", "_") for name, _ in fn.named_parameters())


# unsupported operations: one line naming the operation and the user's line


def chunked(x, w):
    q, k = (x @ w).chunk(2, dim=-2)  # rows: the pieces of a fused projection are its features' (dim=-1)
    return q @ k.mT


def einsum_rowwise_dot(q, k):
    return torch.einsum("bnd,bnd->bn", q, k)


def softmax_over_rows(q, k):
    return torch.softmax(q @ k.mT, dim=-2)


def erf_attention(q, k, v):
    return torch.erf(q @ k.mT) @ v


def clamped_scale(q, k, s):
    return q @ k.mT * torch.clamp(s, max=0.5)


def median_mask(q, k):  # (a mask computed from the scores is read: test_from_torch_computed_masks.py; the median's
    scores = q @ k.mT  # place changes with the length)
    return scores.masked_fill(scores < scores.median(-1, keepdim=True).values, float("-inf")).softmax(-1)


def indexing(q, k):
    return (q @ k.mT)[:2]  # rows (a slice of the last axis is a product with a selection: forms.rotary)


UNSUPPORTED = [
    (chunked, ("chunk", "dim=-2"), lambda: (torch.randn(2, 3, 4), torch.randn(4, 6))),
    (einsum_rowwise_dot, ("einsum", "leading axes"), lambda: (torch.randn(2, 3, 4), torch.randn(2, 3, 4))),
    (softmax_over_rows, ("softmax", "dim=-2"), lambda: (torch.randn(3, 4), torch.randn(5, 4))),
    (erf_attention, ("erf", "torch.erf("), lambda: (torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 2))),
    (clamped_scale, ("clamp", "active"), lambda: (torch.randn(3, 4), torch.randn(5, 4), torch.tensor(2.0))),
    (median_mask, ("median", "order statistic"), lambda: (torch.randn(3, 4), torch.randn(5, 4))),
    (indexing, ("__getitem__", "slicing"), lambda: (torch.randn(3, 4), torch.randn(5, 4))),
]


@pytest.mark.parametrize("function, words, make", UNSUPPORTED, ids=[u[0].__name__ for u in UNSUPPORTED])
def test_an_unsupported_operation_is_one_line_naming_it_and_the_line(function, words, make):
    with pytest.raises(sa.SymattnError) as caught:
        sa.from_torch(function, *make())
    message = str(caught.value)
    assert "\n" not in message
    op, context = words
    assert f"cannot trace {op}" in message and "test_from_torch.py:" in message, message
    assert context in message, message


def test_a_function_of_numbers_only_is_refused():
    with pytest.raises(sa.SymattnError, match="returns a float"):
        sa.from_torch(lambda x: math.pi, torch.randn(2, 2))


# check_backward: a hand-written backward against the traced closed form


def attention(q, k, v):
    scores = q @ k.mT / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


def attention_backward(q, k, v, g):
    """∂/∂q = dS k/√d, ∂/∂k = dSᵀ q/√d, ∂/∂v = Pᵀ G with dS = P ⊙ (G vᵀ − rowsum(P ⊙ G vᵀ) 𝟏ᵀ)."""
    scale = 1 / math.sqrt(q.shape[-1])
    p = torch.softmax(q @ k.mT * scale, dim=-1)
    dp = g @ v.mT
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    return {"q": ds @ k * scale, "k": ds.mT @ q * scale, "v": p.mT @ g}


def test_check_backward_says_right_for_a_right_backward_and_shows_a_counterexample_for_a_wrong_one():
    examples = (torch.randn(2, 5, 3), torch.randn(2, 6, 3), torch.randn(2, 6, 4))
    verdicts = sa.check_backward(attention, attention_backward, *examples)
    assert all(v.right for v in verdicts.values()), [v.text() for v in verdicts.values()]

    def slightly_off(q, k, v, g):  # ∂/∂k off by a factor 1 + 10⁻⁶: above the tolerance, below a glance
        found = attention_backward(q, k, v, g)
        found["k"] = found["k"] * (1 + 1e-6)
        return found

    verdicts = sa.check_backward(attention, slightly_off, *examples)
    assert verdicts["k"].wrong and verdicts["q"].right
    assert "counterexample" in verdicts["k"].text()

    def broken(q, k, v, g):
        raise RuntimeError("not written yet")

    verdicts = sa.check_backward(attention, broken, *examples)
    assert all(v.undecided for v in verdicts.values())
    assert "cannot be checked" in verdicts["q"].text() and "not written yet" in verdicts["q"].text()


def test_check_backward_of_a_module_covers_its_parameters():
    fn, args = ENTRY["relative_bias_attention"].make(EXAMPLE_SIZES, torch.Generator().manual_seed(5))

    def autograd_backward(module, x, g):  # the reference: right by construction
        x = x.detach().requires_grad_()
        out = module(x)
        grads = torch.autograd.grad(out, [x, *module.parameters()], g)
        return dict(zip(["x", *(n for n, _ in module.named_parameters())], grads))

    verdicts = sa.check_backward(fn, autograd_backward, *args, trials=3)
    assert set(verdicts) == {"x", "to_q_weight", "to_k_weight", "to_v_weight", "rel_bias"}
    assert all(v.right for v in verdicts.values()), [v.text() for v in verdicts.values() if not v.right]


def test_a_spec_file_that_calls_from_torch_works_with_derive(capsys):
    from symattn.cli import main

    path = Path(__file__).resolve().parents[2] / "examples" / "from_torch" / "attention_module.py"
    assert main(["derive", "--spec-file", str(path), "--wrt", "q_proj_weight"]) == 0
    printed = capsys.readouterr().out
    assert "scores = " in printed and "q_proj_weight" in printed


def test_example_sizes_that_coincide_stay_distinct_dimensions():
    """Traced where n = m = d = d_k = d_v = 3, the spec still has one dimension per role, and its generated
    code is right where they all differ (the lengths are merged only where an operation needs them equal)."""
    same = dict.fromkeys(EXAMPLE_SIZES, 3)
    fn, args = ENTRY["weights_attention"].make(same, torch.Generator().manual_seed(6))
    spec = sa.from_torch(fn, *args)
    assert {str(d) for x in spec.matrix_inputs for d in x.shape} == {"n", "d_x", "d_w_q", "d_w_v"}
    fn2, args2 = ENTRY["weights_attention"].make(NEW_SIZES, torch.Generator().manual_seed(7))
    closed = ClosedForm(fn2, args2, generated=generated_module(spec))
    cotangent = torch.randn(NEW_SIZES["B"], NEW_SIZES["n"], NEW_SIZES["dv"], dtype=torch.float64)
    want_out, want = _gradients(fn2, fn2, args2, cotangent)
    got_out, got = _gradients(closed, fn2, args2, cotangent)
    _close(got_out, want_out, "output")
    for g, w in zip(got, want):
        _close(g, w, "gradient")


def test_a_scale_computed_from_a_size_is_read_as_that_dimension():
    fn, args = ENTRY["softcap_attention"].make(EXAMPLE_SIZES, torch.Generator().manual_seed(0))
    spec = sa.from_torch(fn, *args)  # head_dim ** -0.5 with head_dim = 3
    assert "sqrt(d_head)" in str(spec.output)  # not the number 1/√3: the spec is right at every head width


def sigmoid_attention(q, k, v):
    """Sigmoid attention with its bias −log m (Ramapuram et al., 2024), computed from the keys' length."""
    return torch.sigmoid(q @ k.mT / math.sqrt(q.shape[-1]) - math.log(k.shape[-2])) @ v


def length_scaled_attention(q, k, v):
    """Attention scaled by log m / √d, one float computed from two sizes."""
    return torch.softmax(q @ k.mT * (math.log(k.shape[-2]) / math.sqrt(q.shape[-1])), dim=-1) @ v


@pytest.mark.parametrize(
    "fn, form", [(sigmoid_attention, "log(m)"), (length_scaled_attention, "log(m)/sqrt(d_q)")], ids=["bias", "scale"]
)
def test_a_number_computed_from_sizes_is_read_as_their_expression(fn, form):
    """−math.log(m) at m = 6 is −log m, log(m)/√d at d = 4 is log m/√d, not the numbers −1.79…, 0.895…: the drop-in
    is right at other sizes."""
    generator = torch.Generator().manual_seed(3)
    args = [torch.randn(2, rows, 4, generator=generator, dtype=torch.float64) for rows in (5, 6, 6)]
    spec = sa.from_torch(fn, *args)
    assert form in str(spec.output), spec.output
    closed = ClosedForm(fn, args)
    new = [torch.randn(3, rows, 3, generator=generator, dtype=torch.float64) for rows in (7, 9, 9)]
    cotangent = torch.randn(3, 7, 3, generator=generator, dtype=torch.float64)
    want_out, want = _gradients(fn, fn, new, cotangent)
    got_out, got = _gradients(closed, fn, new, cotangent)
    _close(got_out, want_out, "output")
    for g, w in zip(got, want):
        _close(g, w, "gradient")


def test_the_generated_module_holds_the_original_state_dict():
    """nanoGPT style (a causal buffer): the generated nn.Module with the module's weights, called with
    causal=True, gives the original's output."""
    from symattn.trace import generated_instance

    fn, args = ENTRY["causal_self_attention"].make(EXAMPLE_SIZES, torch.Generator().manual_seed(8))
    generated = generated_instance(fn, *args)
    assert {k for k, _ in generated.named_parameters()} == {k.replace(".", "_") for k, _ in fn.named_parameters()}
    x = torch.randn(3, 7, args[0].shape[-1], dtype=torch.float64)
    _close(generated(x, causal=True).detach(), fn(x).detach(), "output")


def test_forward_mode_runs_through_the_closed_form():
    """torch.func.jvp of the closed form (the generated JVP) equals the original's, multi-head and pre-LN."""
    for name in ("bert_self_attention", "pre_ln_block"):
        fn, args = ENTRY[name].make(EXAMPLE_SIZES, torch.Generator().manual_seed(9))
        closed = ClosedForm(fn, args)
        tangent = torch.randn_like(args[0])
        _, want = torch.func.jvp(fn, args, (tangent,))
        _, got = torch.func.jvp(closed, args, (tangent,))
        _close(got, want, f"{name}: jvp")
