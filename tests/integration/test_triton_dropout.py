"""Dropout of the attention weights in the Triton kernels, under Triton's interpreter (CPU tensors, partial blocks):
O = (N(A) ⊙ Z_p) V with Z_p = Bernoulli(1 − p) / (1 − p) drawn in registers by Philox from a per-call seed and each
score's flat place (bh, i, j), no n × m mask in memory.

The mask the kernels apply is recovered from the kernels themselves (V = I: O = P ⊙ Z) and is the module's own
materialised draws (``_dropout_keep``); with those draws, an independent float64 forward differentiated by torch
autograd gives the module's output and gradients (the backward regenerates the forward's mask tile by tile, in its
transposed key part too), torch.func.jvp its JVP (the public jvp and the Function's jvp under torch.func.jvp), and a
second derivative its hvp (the eager core reads the same draws). torch.manual_seed reproduces a call, another seed or
generator draws another mask; the keep rate lies within 3σ of 1 − p; training=False (or eval()) is the spec without
dropout, bit for bit, and draws nothing. Every normaliser (softmax, row sums, none), causal or not, two cores (one
seed each) and grouped-query heads (each tile's draws its query head's); a dropout outside the cores draws as
F.dropout; dropout inside the scores' steps and vmap of a call that drew are refused in one line.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp
from triton_rendered import compare, torch, triton_module

import symattn as sa
from symattn.codegen.generate import render
from symattn.errors import SymattnError
from symattn.specs import dim

P_DROP = 0.25
n, m, d, d_v = dim("n"), dim("m"), dim("d"), dim("d_v")
Q, K, V = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", m, d), sp.MatrixSymbol("V", m, d_v)
ROWS, KEYS, WIDTH = 20, 18, 4  # two blocks of 16 each way, the last partial


def _spec(name: str, weights) -> sa.Spec:
    return sa.Spec(name=name, summary="attention, weights dropped", inputs=(Q, K, V), output=weights * V)


SCORES = Q * K.T / sp.sqrt(d)
SOFTPLUS = sa.softplus(SCORES)


def _softmax(a, hidden):
    return torch.softmax(a.masked_fill(hidden, -math.inf), -1)


def _sigmoid(a, hidden):
    return torch.sigmoid(a).masked_fill(hidden, 0.0)


def _row_sum(a, hidden):
    f = torch.nn.functional.softplus(a).masked_fill(hidden, 0.0)
    return f / f.sum(-1, keepdim=True)


SPECS = {  # name → (spec, its weights N(A) in float64 from the scores A and the keys a causal mask hides)
    "softmax": (_spec("dropped_softmax", sa.dropout(sa.softmax(SCORES), P_DROP)), _softmax),
    "sigmoid": (_spec("dropped_sigmoid", sa.dropout(sa.sigmoid(SCORES), P_DROP)), _sigmoid),
    "row_sum": (
        _spec(
            "dropped_row_sum",
            sa.dropout(sa.hadamard(SOFTPLUS, sp.HadamardPower(sa.rowsum(SOFTPLUS) * sa.ones(1, m), -1)), P_DROP),
        ),
        _row_sum,
    ),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_dropout_modules")


@pytest.fixture(scope="module")
def module(folder):
    return triton_module(SPECS["softmax"][0], folder)


def _inputs(seed=0, width=WIDTH, batch=(2,)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, r, width, generator=g, requires_grad=True) for r in (ROWS, KEYS, KEYS)]


def _keep(module, seed, batch=(2,)):
    """The module's draws for a call after torch.manual_seed(seed): its seed drawn as forward draws it, made whole."""
    torch.manual_seed(seed)
    drawn = module._seed(True, None, torch.empty(()))
    return module._dropout_keep(drawn, (*batch, ROWS, KEYS))


def _reference(weights, q, k, v, keep, causal):
    """(N(A) ⊙ Z) V in float64 with Z = keep / (1 − p), independent of symattn (causal: keys j > i hidden)."""
    a = q @ k.mT / math.sqrt(q.shape[-1])
    hidden = torch.ones(a.shape[-2:], dtype=torch.bool).triu(1) & causal
    return (weights(a, hidden) * keep / (1 - P_DROP)) @ v


def test_the_kernels_mask_is_the_modules_draws(module):
    # V = I (d_v = m): O = P ⊙ Z, so the kernels' own mask is where O is 0, and O = P / (1 − p) where kept
    q, k, _ = _inputs(1)
    eye = torch.eye(KEYS).expand(2, KEYS, KEYS)
    torch.manual_seed(7)
    out = module.forward(q, k, eye).detach().double()
    keep = _keep(module, 7)
    p = torch.softmax(q.detach().double() @ k.detach().double().mT / math.sqrt(WIDTH), -1)
    assert torch.equal(out != 0, keep)
    compare(out, p * keep / (1 - P_DROP), "O = P ⊙ Z")
    assert 0 < keep.double().mean().item() < 1  # some dropped, some kept


# the row softmax, the division by the row sums (O = (A ⊘ rowsum(A) 𝟏ᵀ ⊙ Z) V), none (sigmoid attention's)
@pytest.mark.parametrize("name, causal", [("softmax", False), ("softmax", True), ("row_sum", True), ("sigmoid", True)])
def test_the_backward_is_the_derivative_of_the_forward_with_the_same_draws(folder, name, causal):
    spec, weights = SPECS[name]
    module = triton_module(spec, folder)
    q, k, v = _inputs(2)
    torch.manual_seed(11)
    out = module.forward(q, k, v, causal=causal)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, (q, k, v), grad)
    keep = _keep(module, 11)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = _reference(weights, *exact, keep, causal)
    compare(out, want, f"{name} O")
    for x, g, label in zip(got, torch.autograd.grad(want, exact, grad.double()), "QKV"):
        compare(x, g, f"{name} d{label}")


def test_the_seed_reproduces_a_call_and_another_seed_or_generator_draws_another_mask(module):
    q, k, v = _inputs(3)
    runs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        out = module.forward(q, k, v)
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    state = torch.get_rng_state()
    first, again = (module.forward(q, k, v, rng=torch.Generator().manual_seed(9)) for _ in range(2))
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), state)  # a generator given: torch's default one untouched


def test_the_keep_rate_is_one_minus_p_within_three_sigma(module):
    torch.manual_seed(0)
    keep = module._dropout_keep(module._seed(True, None, torch.empty(())), (1, 400, 250))
    rate, count = keep.double().mean().item(), keep.numel()
    assert abs(rate - (1 - P_DROP)) <= 3 * math.sqrt(P_DROP * (1 - P_DROP) / count)


def test_training_false_and_eval_are_the_spec_without_dropout_and_draw_nothing(module, folder):
    plain = triton_module(_spec("undropped_softmax", sa.softmax(SCORES)), folder)
    q, k, v = _inputs(4)
    state = torch.get_rng_state()
    off = module.forward(q, k, v, training=False, causal=True)
    want = plain.forward(q, k, v, causal=True)
    assert torch.equal(off, want)
    grad = torch.randn(off.shape, generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad(off, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        assert torch.equal(a, b)
    layer = getattr(module, module.__all__[0])()  # the nn.Module: forward with its own self.training
    assert torch.equal(layer.eval()(q, k, v), plain.forward(q, k, v))
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn
    torch.manual_seed(2)
    trained = layer.train()(q, k, v)
    torch.manual_seed(2)
    assert torch.equal(trained, module.forward(q, k, v))
    with pytest.raises(ValueError, match="training must be True or False"):
        module.forward(q, k, v, training="yes")


def test_the_jvp_is_torch_func_jvp_of_the_forward_with_the_same_draws(module):
    q, k, v = _inputs(5)
    g = torch.Generator().manual_seed(8)
    tangents = [torch.randn(x.shape, generator=g) for x in (q, k, v)]
    keep = _keep(module, 13)
    exact = [x.detach().double() for x in (q, k, v)]
    want = torch.func.jvp(
        lambda *xs: _reference(_softmax, *xs, keep, True), tuple(exact), tuple(t.double() for t in tangents)
    )
    torch.manual_seed(13)
    public = module.jvp(*(x.detach() for x in (q, k, v)), dict(zip("QKV", tangents)), causal=True)
    torch.manual_seed(13)
    functional = torch.func.jvp(
        lambda *xs: module.forward(*xs, causal=True), tuple(x.detach() for x in (q, k, v)), tuple(tangents)
    )
    for got, label in ((public, "jvp"), (functional, "torch.func.jvp")):
        compare(got[0], want[0], f"{label} O")
        compare(got[1], want[1], f"{label} Ȯ")


def test_the_hvp_differentiates_the_same_draws_twice(module):
    q, k, v = _inputs(6)
    g = torch.Generator().manual_seed(4)
    grad_out = torch.randn(2, ROWS, WIDTH, generator=g)
    direction = {name: torch.randn(x.shape, generator=g) for name, x in zip("QKV", (q, k, v))}
    torch.manual_seed(17)
    got = module.hvp(*(x.detach() for x in (q, k, v)), grad_out, direction)
    keep = _keep(module, 17)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out = _reference(_softmax, *exact, keep, False)
    first = torch.autograd.grad(out, exact, grad_out.double(), create_graph=True)
    along = sum((f * direction[name].double()).sum() for f, name in zip(first, "QKV"))
    for name, want in zip("QKV", torch.autograd.grad(along, exact)):
        compare(got[name], want, f"hvp {name}", rtol=1e-4)


def test_the_rendered_module_is_ruff_clean(folder):
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))  # (a venv's)
    if ruff is None:
        pytest.skip("ruff (the formatter of generated code) is not installed")
    path = folder / "dropped_softmax_triton.py"
    path.write_text(render(SPECS["softmax"][0], "triton"), encoding="utf-8")
    for command in (["format", "--check"], ["check"]):
        done = subprocess.run([ruff, *command, str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_dropout_inside_the_scores_steps_is_refused_in_one_line():
    spec = _spec("dropped_scores", sa.softmax(sa.dropout(SCORES, P_DROP)))
    with pytest.raises(SymattnError) as caught:
        render(spec, "triton")
    assert "dropout inside the scores' steps" in str(caught.value) and "\n" not in str(caught.value)


def test_dropout_outside_the_core_is_torchs_draw_as_f_dropout_makes_it(folder):
    # dropout(softmax(Q Kᵀ/√d) V, p): the torch code after the core draws as F.dropout does, from the same state
    output = sa.dropout(sa.softmax(SCORES) * V, P_DROP)
    module = triton_module(sa.Spec(name="dropped_output", summary="O dropped", inputs=(Q, K, V), output=output), folder)
    q, k, v = _inputs(7)
    torch.manual_seed(19)
    out = module.forward(q, k, v)
    torch.manual_seed(19)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = torch.nn.functional.dropout(torch.softmax(exact[0] @ exact[1].mT / math.sqrt(WIDTH), -1) @ exact[2], P_DROP)
    compare(out, want, "O")
    for got, g, label in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), exact), "QKV"):
        compare(got, g, f"d{label}")


def test_two_cores_draw_two_masks_each_from_its_own_seed(folder):
    # (dropout(P₁) − λ dropout(P₂)) V, differential attention's two cores: one seed each, drawn in the cores' order
    k2 = sp.MatrixSymbol("K2", m, d)
    lam = sp.Symbol("lam", real=True)
    first, second = (sa.dropout(sa.softmax(Q * key.T / sp.sqrt(d)), P_DROP) for key in (K, k2))
    output = (first - lam * second) * V
    spec = sa.Spec(name="dropped_pair", summary="two cores", inputs=(Q, K, k2, V, lam), output=output)
    module = triton_module(spec, folder)
    q, k, v = _inputs(8)
    other = torch.randn(2, KEYS, WIDTH, generator=torch.Generator().manual_seed(9), requires_grad=True)
    weight = torch.tensor(0.7, requires_grad=True)
    torch.manual_seed(23)
    out = module.forward(q, k, other, v, weight)
    torch.manual_seed(23)
    like = torch.empty(())
    keeps = [module._dropout_keep1(module._seed(True, None, like), (2, ROWS, KEYS))]
    keeps.append(module._dropout_keep2(module._seed(True, None, like), (2, ROWS, KEYS)))
    assert not torch.equal(*keeps)
    exact = [x.detach().double().requires_grad_() for x in (q, k, other, v, weight)]
    eq, ek, ek2, ev, el = exact
    want = _reference(_softmax, eq, ek, ev, keeps[0], False) - el * _reference(_softmax, eq, ek2, ev, keeps[1], False)
    compare(out, want, "O")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(out, (q, k, other, v, weight), grad)
    for x, g, label in zip(got, torch.autograd.grad(want, exact, grad.double()), ("Q", "K", "K2", "V", "lam")):
        compare(x, g, f"d{label}")


def test_torch_func_grad_reads_the_same_draws_and_vmap_is_refused_while_training(module):
    # vmap's axis, merged into the batch·head the draws are keyed by, would shift them: refused in one line
    q, k, v = (x.detach() for x in _inputs(9))
    torch.manual_seed(29)
    got = torch.func.grad(lambda x: module.forward(x, k, v).sum())(q)
    torch.manual_seed(29)
    leaf = q.clone().requires_grad_()
    assert torch.equal(got, torch.autograd.grad(module.forward(leaf, k, v).sum(), leaf)[0])
    runs = {
        "vmap": lambda: torch.func.vmap(lambda x: module.forward(x, k, v), randomness="same")(q[None]),
        "jacrev": lambda: torch.func.jacrev(lambda x: module.forward(x, k, v))(q),
    }
    for name, run in runs.items():
        with pytest.raises(RuntimeError, match=r"dropout while training under torch\.func\.vmap") as caught:
            run()
        assert "\n" not in str(caught.value), name
    off = torch.func.vmap(lambda x: module.forward(x, k, v, training=False))(q[None])
    assert torch.equal(off[0], module.forward(q, k, v, training=False))


def test_grouped_query_heads_read_the_query_heads_draws(folder):
    # mha with 4 query heads sharing 2 key/value heads: the backward's key part steps through the query heads of its
    # group, each tile's draws those of its query head's batch·head bh = b·H + h
    from symattn.lang.graph import postorder
    from symattn.lang.ops import RowSoftmax
    from symattn.specs.attention import mha

    heads, kv_heads, d_k = 4, 2, 2
    base = mha(num_heads=heads, num_kv_heads=kv_heads)
    weights = next(x for x in postorder(base.output) if isinstance(x, RowSoftmax))
    output = base.output.xreplace({weights: sa.dropout(weights, P_DROP)})
    module = triton_module(sa.Spec("dropped_gqa", base.summary, base.inputs, output), folder)
    g = torch.Generator().manual_seed(10)
    d_model, d_kv = heads * d_k, kv_heads * d_k
    shapes = {"Q": (2, ROWS, d_model), "K": (2, KEYS, d_model), "V": (2, KEYS, d_model)}
    shapes |= {"W_Q": (d_model, d_model), "W_K": (d_model, d_kv), "W_V": (d_model, d_kv), "W_O": (d_model, d_model)}
    x = {name: torch.randn(shape, generator=g).requires_grad_() for name, shape in shapes.items()}
    torch.manual_seed(31)
    out = module.forward(*x.values())
    keep = _keep(module, 31, (2, heads))
    exact = {name: t.detach().double().requires_grad_() for name, t in x.items()}

    def split(y, count):
        return y.view(*y.shape[:-1], count, d_k).transpose(-2, -3)

    e = exact
    q = split(e["Q"] @ e["W_Q"], heads)
    k, v = (split(e[a] @ e[w], kv_heads).repeat_interleave(2, dim=-3) for a, w in (("K", "W_K"), ("V", "W_V")))
    o = _reference(_softmax, q, k, v, keep, False)
    want = o.transpose(-2, -3).reshape(2, ROWS, d_model) @ e["W_O"]
    compare(out, want, "O")
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, list(x.values()), grad)
    for name, a, b in zip(x, got, torch.autograd.grad(want, list(exact.values()), grad.double())):
        compare(a, b, f"d{name}")


def test_no_n_by_m_array_is_saved_for_the_backward_only_the_seed(module):
    # what autograd keeps between forward and backward: Q, K, V, O, the rows' statistics and the 0-d seed
    q, k, v = _inputs(10)
    saved = []

    def pack(x):
        saved.append((tuple(x.shape), x.dtype))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        module.forward(q, k, v)
    assert ((), torch.int64) in saved  # the seed
    assert all(shape[-2:] != (ROWS, KEYS) and math.prod(shape) < ROWS * KEYS for shape, _ in saved), saved
