"""from_torch reads masks computed per call from traced values: a comparison is a 0/1 matrix of step records with
derivative 0 (autograd's), masked_fill(cond, −inf) of it adds keep(K) (−∞ where filled), a finite fill or a where
chooses entrywise, and a row's k-th largest value (topk, sort, kthvalue) is the record kth_k. Each module is traced
at one length, and its drop-in (the generated torch module), its generated NumPy and JAX modules are compared with
autograd of the original at another length (float64); the derivation prints and verifies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

torch = pytest.importorskip("torch")

from rendered import load  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.codegen import generate as codegen  # noqa: E402
from symattn.lang.graph import postorder  # noqa: E402
from symattn.lang.rowwise import KthLargest  # noqa: E402
from symattn.trace import drop_in  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402

TOLERANCE = 1e-9  # relative, float64
NEG = float("-inf")


def _scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))


def above_mean(q, k, v):  # the A: keep the scores at or above their row mean
    s = _scores(q, k)
    return torch.softmax(s.masked_fill(s < s.mean(-1, keepdim=True), NEG), -1) @ v


def top_k(q, k, v):  # the B: keep the 3 largest scores of each row
    s = _scores(q, k)
    thr = s.topk(3, dim=-1).values[..., -1:]
    return torch.softmax(s.masked_fill(s < thr, NEG), -1) @ v


def top_k_where(q, k, v):  # where(s > thr, s, −inf): the 2 largest (thr the 3rd)
    s = _scores(q, k)
    thr = s.topk(3, dim=-1).values[..., -1:]
    return torch.softmax(torch.where(s > thr, s, NEG), -1) @ v


def top_k_ge_sorted(q, k, v):  # >= against a whole row sorted ascending, counted from its end: the 2nd largest
    s = _scores(q, k)
    with torch.no_grad():  # (a threshold under no_grad: the same mask)
        thr = s.sort(dim=-1).values[..., -2:-1]
    return torch.softmax(torch.where(s >= thr, s, NEG), -1) @ v


def above_constant(q, k, v):  # a constant threshold and a finite fill: where(s > 1/4, s, 0), and a gate s ⊙ [s > 0]
    s = _scores(q, k)
    return torch.softmax(torch.where(s > 0.25, s, 0.0) + s * (s > 0), -1) @ v


def kth_smallest(q, k, v):  # masked_fill of the smallest entry of each row, with a finite fill
    s = _scores(q, k)
    return torch.softmax(s.masked_fill(s <= s.kthvalue(1, -1, keepdim=True).values, -3.0), -1) @ v


def causal_top_k(q, k, v):  # & of a computed mask with a causal one: the 2 largest scores each query sees
    s = _scores(q, k)
    causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    seen = s.masked_fill(~causal, NEG)
    thr = seen.topk(2, dim=-1).values[..., -1:]  # row 0 sees one key: its 2nd largest is −inf
    keep = (seen >= thr) & causal
    return torch.softmax(s.masked_fill(~keep, NEG), -1) @ v


def hinge_to_kth(q, k, v):  # the k-th largest as a value: its derivative, the selected entry's (autograd's)
    s = _scores(q, k)
    return torch.relu(s - s.topk(2, dim=-1).values[..., -1:]) @ v


def two_sided(q, k, v):  # where between two traced tensors: a computed cond (a leaky ReLU), then a constant one
    s = _scores(q, k)
    causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    t = torch.where(s > 0, s, 0.1 * s)
    return torch.softmax(torch.where(causal, t, -t), -1) @ v


def _causal_scores(q, k):
    s = _scores(q, k)
    return s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))


def gate_masked(q, k, v):  # where(s > 1/2, s, −1) of causal scores: torch picks −1 at the −∞ entries
    s = _causal_scores(q, k)
    return torch.softmax(torch.where(s > 0.5, s, -1.0), -1) @ v


def zero_masked(q, k, v):  # a constant mask filling 0 over entries the causal mask made −∞
    s = _causal_scores(q, k)
    last = torch.zeros(s.shape[-2:], dtype=torch.bool)
    last[:, -1] = True
    return torch.softmax(s.masked_fill(last, 0.0), -1) @ v


def fill_kept_finite(q, k, v):  # the fill lands only where the scores are finite (the first key): read
    s = _causal_scores(q, k)
    first = torch.zeros(s.shape[-2:], dtype=torch.bool)
    first[:, 0] = True
    return torch.softmax(s.masked_fill(first, 0.0), -1) @ v


CASES = [above_mean, top_k, top_k_where, top_k_ge_sorted, above_constant, kth_smallest, causal_top_k, hinge_to_kth]
CASES += [two_sided]


def _qkv(n, m, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, r, 4, generator=g, dtype=torch.float64) for r in (n, m, m)]


def _autograd(function, inputs, seed=9):
    leaves = [x.clone().requires_grad_() for x in inputs]
    out = function(*leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return out.detach(), cotangent, torch.autograd.grad(out, leaves, cotangent)


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    error = np.max(np.abs(got - want))
    assert error <= TOLERANCE * max(1.0, np.max(np.abs(want))), f"{what}: differs by {error:.3g}"


def _drop_in_agrees(function, traced: tuple[int, int], called: tuple[int, int]) -> None:
    """The drop-in traced at the lengths traced (n, m) agrees with autograd of function at the lengths called."""
    closed = ClosedForm(function, _qkv(*traced, seed=0))
    inputs = _qkv(*called, seed=1)
    want, cotangent, grads = _autograd(function, inputs)
    leaves = [x.clone().requires_grad_() for x in inputs]
    got = closed(*leaves)
    _close(got.detach(), want, "output")
    for name, g, w in zip("qkv", torch.autograd.grad(got, leaves, cotangent), grads, strict=True):
        _close(g, w, f"∂f/∂{name}")


@pytest.mark.parametrize("function", CASES, ids=lambda f: f.__name__)
def test_the_drop_in_matches_autograd_at_a_new_length(function):
    _drop_in_agrees(function, (6, 5), (9, 8))


@pytest.mark.parametrize("function", CASES, ids=lambda f: f.__name__)
def test_the_drop_ins_second_order_matches_autograd(function):
    """∇ of ⟨∂f/∂q, W⟩ by the second closed form, against torch's double backward (the masks' derivative 0 again)."""
    closed = ClosedForm(function, _qkv(6, 5, seed=0))
    inputs = _qkv(7, 8, seed=1)
    found = []
    for call in (function, closed):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = call(*leaves)
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        (dq,) = torch.autograd.grad(out, leaves[:1], cotangent, create_graph=True)
        direction = torch.randn(dq.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        found.append(torch.autograd.grad((dq * direction).sum(), leaves))
    for name, got, want in zip("qkv", found[1], found[0], strict=True):
        _close(got, want, f"second order, ∂/∂{name}")


class TopK(torch.nn.Module):
    """The issue's B as a module with its projections: the drop-in replaces its forward."""

    def __init__(self, width=8, kept=3):
        super().__init__()
        self.q, self.k, self.kept = torch.nn.Linear(width, width), torch.nn.Linear(width, width), kept

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.size(-1))
        s = s.masked_fill(s < s.topk(self.kept, dim=-1).values[..., -1:], float("-inf"))
        return torch.softmax(s, -1) @ x


def test_drop_in_replaces_a_modules_forward_and_matches_autograd_at_a_new_length():
    torch.manual_seed(0)
    module = TopK().double()
    x = torch.randn(2, 11, 8, dtype=torch.float64, requires_grad=True)
    want = module(x)
    cotangent = torch.randn_like(want)
    leaves = [x, *module.parameters()]
    grads = torch.autograd.grad(want, leaves, cotangent)
    drop_in(module, torch.randn(2, 6, 8, dtype=torch.float64))
    got = module(x)
    _close(got.detach(), want.detach(), "output")
    for g, w in zip(torch.autograd.grad(got, leaves, cotangent), grads, strict=True):
        _close(g, w, "gradient")


class HeadsTopK(torch.nn.Module):
    """Per-head scores of a fused projection, a causal mask, then the top-k of each row among the keys it sees:
    (s < thr) & causal | ~causal, a computed mask combined with a constant one by & and |."""

    def __init__(self, width=8, heads=2, kept=2):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.heads, self.kept = heads, kept

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, dim=-1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        s = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(~causal, float("-inf"))
        thr = s.topk(self.kept, dim=-1).values[..., -1:]
        s = s.masked_fill((s < thr) & causal | ~causal, float("-inf"))
        return self.out((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, c))


def test_per_head_top_k_among_the_keys_each_query_sees_matches_autograd():
    torch.manual_seed(1)
    module = HeadsTopK().double()
    x = torch.randn(2, 9, 8, dtype=torch.float64, requires_grad=True)
    want = module(x)
    cotangent = torch.randn_like(want)
    leaves = [x, *module.parameters()]
    grads = torch.autograd.grad(want, leaves, cotangent)
    got = ClosedForm(module, [torch.randn(2, 6, 8, dtype=torch.float64)])(x)
    _close(got.detach(), want.detach(), "output")
    for g, w in zip(torch.autograd.grad(got, leaves, cotangent), grads, strict=True):
        _close(g, w, "gradient")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # causal_top_k: −∞ − (−∞), read as False
@pytest.mark.parametrize("function", [above_mean, top_k, causal_top_k, hinge_to_kth], ids=lambda f: f.__name__)
def test_the_generated_numpy_and_jax_modules_match_autograd(function):
    spec = sa.from_torch(function, *_qkv(6, 5, seed=0))
    inputs = _qkv(7, 9, seed=2)
    want, cotangent, grads = _autograd(function, inputs)
    arrays = [x.numpy() for x in inputs]
    numpy_module = load(spec, "numpy")
    out, saved = numpy_module.forward(*arrays)
    _close(out, want, "NumPy output")
    got = numpy_module.backward(saved, cotangent.numpy())
    for name, w in zip(spec.input_names, grads, strict=True):
        _close(got[name], w, f"NumPy ∂f/∂{name}")
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    out, pullback = jax.vjp(load(spec, "jax").forward, *arrays)
    _close(out, want, "JAX output")
    for name, g, w in zip(spec.input_names, pullback(cotangent.numpy()), grads, strict=True):
        _close(g, w, f"JAX ∂f/∂{name}")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("function", CASES, ids=lambda f: f.__name__)
def test_the_derivation_verifies(function):
    assert sa.derive(sa.from_torch(function, *_qkv(6, 5, seed=0))).verify().ok


def test_the_derivation_prints_the_mask_and_the_threshold_and_no_cotangent_passes_them():
    spec = sa.from_torch(top_k, *_qkv(6, 5, seed=0))
    assert any(isinstance(node, KthLargest) and node.k == 3 for node in postorder(spec.output))
    derivation = sa.derive(spec)
    text = derivation.text()
    assert "thr = kth_3(s)" in text and "keep(𝟏𝟏ᵀ − step(thr 𝟏ᵀ − s))" in text
    assert "\\operatorname{kth}_{3}" in derivation.latex() and "\\operatorname{keep}" in derivation.latex()
    assert "d(keep(" not in text and "d(thr" not in text  # derivative 0: the backward stops at the mask


def test_a_whole_row_of_a_computed_mask_is_zeros_as_a_constant_masks_are():
    """Every key of a row masked (s > its row max): torch's softmax of a row of −∞ is NaN; the drop-in's is zeros
    with zero gradients, as symattn gives for a row a mask argument or a mask of positions masks whole."""

    def nothing_kept(q, k, v):
        s = _scores(q, k)
        return torch.softmax(s.masked_fill(s <= s.topk(1, dim=-1).values[..., -1:], NEG), -1) @ v

    inputs = _qkv(4, 3, seed=3)
    assert torch.isnan(nothing_kept(*inputs)).all()
    leaves = [x.clone().requires_grad_() for x in inputs]
    got = ClosedForm(nothing_kept, inputs)(*leaves)
    assert torch.equal(got, torch.zeros_like(got))
    for g in torch.autograd.grad(got, leaves, torch.ones_like(got)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (lambda s: s.masked_fill(s < s.topk(2, dim=-1).indices[..., -1:], NEG), "the indices of topk"),
        (lambda s: s.masked_fill(s < s.median(-1, keepdim=True).values, NEG), "cannot trace median: an order"),
        (lambda s: s - s.topk(2, dim=-1, sorted=False).values[..., -1:], "sorted=False"),
        (lambda s: s - s.sort(dim=-1).values, "cannot trace sub: the values of topk or sort"),
        (lambda s: s - s.sort(dim=-1).values[..., 1:-1], "read: one, [..., j:j+1]"),
        (lambda s: s - s.kthvalue(2, -1).values, "keepdim=True"),
        (lambda s: s.masked_fill(s < 0, s.sum()), "a fill value that is a tensor"),
        (lambda s: (s < 0) + (s > 1), "cannot trace add"),
    ],
)
def test_what_is_not_read_is_one_line_naming_it(line, words):
    def function(q, k):
        return line(_scores(q, k))

    with pytest.raises(sa.SymattnError) as caught:
        sa.from_torch(function, *_qkv(5, 5, seed=0)[:2])
    message = str(caught.value)
    assert "\n" not in message and words in message, message


def test_the_triton_kernels_compute_a_comparison_in_the_scores(tmp_path):
    """where(s > 1/4, s, 0): step in the scores' tile (tl.where), float32 under Triton's interpreter, against float64
    autograd to float32's rounding; a −∞ fill computed per call, or a k-th largest, is refused in one line."""
    pytest.importorskip("triton")
    import triton_rendered as rendered

    def gated(q, k, v):
        s = _scores(q, k)
        return torch.softmax(torch.where(s > 0.25, s, 0.0), -1) @ v

    module = rendered.triton_module(sa.from_torch(gated, *_qkv(6, 5, seed=0)), tmp_path)
    inputs = [x.float().requires_grad_() for x in _qkv(9, 11, seed=4)]
    want, cotangent, grads = _autograd(gated, [x.detach().double() for x in inputs])
    got = module.forward(*inputs)
    assert (got.double() - want).abs().max() < 1e-5
    for g, w in zip(torch.autograd.grad(got, inputs, cotangent.float()), grads, strict=True):
        assert (g.double() - w).abs().max() < 1e-5
    for function in (top_k, above_mean):
        with pytest.raises(sa.SymattnError, match="no n × m core the Triton kernels cover"):
            rendered.render(sa.from_torch(function, *_qkv(6, 5, seed=0)), "triton")


def test_exact_evaluation_of_a_top_k_spec_agrees_with_torch():
    """The spec of a top-k mask evaluated exactly (rational inputs: kth_3 ordered by value, keep's −∞ exact, exp an
    atom) agrees with torch's float64 forward at those inputs."""
    spec = sa.from_torch(top_k, *_qkv(6, 5, seed=0))
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randint(-8, 9, (r, 4), generator=g).double() / 4 for r in (3, 5, 5)]
    rational = [np.vectorize(lambda x: sp.Rational(str(x)), otypes=[object])(x.numpy()) for x in inputs]
    exact = sa.lambdify(list(spec.inputs), spec.output, backend="exact")(*rational)
    want = top_k(*inputs).numpy()
    _close(np.vectorize(lambda x: float(x.evalf(30)), otypes=[float])(exact), want, "exact output")


def test_the_memory_efficient_variant_refuses_a_mask_computed_before_its_loop():
    """The causal top-k mask is made whole before the loop over blocks of rows, from the inputs: the variant's
    backward, which remakes P block by block, would read it unsaved; refused in one line (the standard one runs)."""
    spec = sa.from_torch(causal_top_k, *_qkv(6, 5, seed=0))
    for backend in ("numpy", "torch"):
        with pytest.raises(sa.SymattnError, match=r"made before its loop .*a mask computed from the inputs"):
            codegen.render(spec, backend, "memeff", second_order=False)


@pytest.mark.parametrize("function", [gate_masked, zero_masked], ids=lambda f: f.__name__)
def test_a_finite_fill_over_masked_scores_is_refused_not_nan(function):
    """A ⊙ K + c (𝟏𝟏ᵀ − K) would be 0·∞ = NaN where torch gives the fill: refused in one line."""
    with pytest.raises(sa.SymattnError, match="infinite where it fills") as caught:
        sa.from_torch(function, *_qkv(6, 6, seed=0))
    assert "\n" not in str(caught.value)


def test_a_finite_fill_where_the_scores_are_finite_is_read_and_right():
    _drop_in_agrees(fill_kept_finite, (6, 6), (9, 9))
