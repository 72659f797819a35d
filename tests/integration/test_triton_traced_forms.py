"""Every ``from_torch`` corpus of the tests reaches the fused kernels where its spec has a core: each case traced as its
own test traces it (float64), dropped in, and called at new inputs (another batch or length) routed to the Triton
module under the interpreter (float32), against the torch ops of the same generated module (float64): output and
every gradient (``test_triton_traced``'s check). A case whose spec the kernels do not cover keeps the torch ops,
``path`` says so, and the reason is one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # first; without triton, test_triton_traced's import skips this module

from test_triton_traced import _floating, _kernels_give_the_torch_ops_values, _routed_calls  # noqa: E402

from symattn.codegen.backends.triton.core import WHAT  # noqa: E402
from symattn.codegen.generate import render  # noqa: E402
from symattn.errors import SymattnError  # noqa: E402
from symattn.trace.dropin import ClosedForm  # noqa: E402


def _forms():
    import test_from_torch_forms as t

    functions = [*t.FORMS, t.gated, t.clamped, t.clamped_method, t.clamped_min, t.hardtanh, t.leaky, t.relu_squared]
    return {f.__name__: (f, t._qkv((5, 6, 6), 4, 0), t._qkv((7, 9, 9), 3, 1)) for f in functions}


def _heads_forms():
    import test_from_torch_heads_forms as t

    def case(name):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        example = (torch.randn(2, 5, t.C, dtype=torch.float64, generator=g), *t._args(name, [5, 3], 5))
        args = (torch.randn(3, 7, t.C, dtype=torch.float64, generator=g), *t._args(name, [7, 2, 5], 7))
        return t.CASES[name][0]().double().eval(), example, args

    def transformers(name):  # transformers' own BloomAttention and FalconAttention (ALiBi), as their test builds them
        pytest.importorskip("transformers")
        torch.manual_seed(0)
        model, args, _, _ = t._bloom() if name == "bloom" else t._falcon(name == "falcon_multi_query")
        return model.double().eval(), args(2, 5), args(3, 7)

    cases = {name: lambda name=name: case(name) for name in t.CASES}
    return cases | {name: lambda name=name: transformers(name) for name in ("bloom", "falcon_multi_query", "falcon")}


def _per_sequence():
    import test_from_torch_per_sequence as t

    def buffer(name):
        c, op, per_key = t.BUFFERS[name]
        return t.Scaled(c.double(), op), tuple(t._qkv(t.B, 5, 0)), tuple(t._qkv(t.B, 5 if per_key else 7, 1))

    def mask(name):
        make, example, new = t.MASKS[name]
        return make(), (*t._qkv(t.B, 5, 0), example), (*t._qkv(t.B, 7, 1), torch.tensor(new))

    def heads(name):
        c, op = t.HEADS[name]
        torch.manual_seed(0)
        x = torch.randn(t.B, 7, t.H * t.D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        return t.HeadsScaled(c.double(), op).double(), (torch.randn(t.B, 5, t.H * t.D, dtype=torch.float64),), (x,)

    cases = {f"buffer {n}": lambda n=n: buffer(n) for n in t.BUFFERS}
    cases |= {f"mask {n}": lambda n=n: mask(n) for n in t.MASKS}
    cases |= {f"heads {n}": lambda n=n: heads(n) for n in t.HEADS}
    prefix, temperature = (
        (torch.tensor([2, 4]), torch.tensor([6, 0, 3])),
        (torch.tensor([2, 4]), torch.tensor([3, 1, 5])),
    )
    cases["prefix_weighted"] = lambda: (
        t.PrefixWeighted(),
        (*t._qkv(t.B, 5, 0), prefix[0]),
        (*t._qkv(3, 7, 2), prefix[1]),
    )
    cases["tempered"] = lambda: (t.Tempered(), (*t._qkv(t.B, 5, 0), temperature[0]), (*t._qkv(3, 7, 2), temperature[1]))
    return cases


def _computed_masks():
    import test_from_torch_computed_masks as t

    cases = {f.__name__: (f, t._qkv(6, 5, 0), t._qkv(9, 8, 1)) for f in [*t.CASES, t.fill_kept_finite]}

    def module(make, seed):
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(2)
        return (
            make().double(),
            (torch.randn(2, 6, 8, dtype=torch.float64),),
            (torch.randn(3, 9, 8, dtype=torch.float64, generator=g),),
        )

    cases["TopK"] = lambda: module(t.TopK, 0)
    cases["HeadsTopK"] = lambda: module(t.HeadsTopK, 1)
    return cases


def _head_constants():
    import test_from_torch_head_constants as t

    def case(make, kind):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        example = (torch.randn(2, 5, t.D, dtype=torch.float64), t._keep([5, 4], 5))
        return (
            make(kind).double(),
            example,
            (torch.randn(3, 7, t.D, dtype=torch.float64, generator=g), t._keep([7, 2, 5], 7)),
        )

    cases = {kind: lambda kind=kind: case(t.HeadsAttention, kind) for kind in t.KINDS}
    cases |= {
        f"{make.__name__} per head and sequence": lambda make=make: case(make, "") for make in (t.Both, t.KeptBoth)
    }
    return cases


def _float_masks():
    import test_from_torch_float_masks as t

    def case(make, sliced):
        g = torch.Generator().manual_seed(1)
        example = (torch.randn(2, 5, t.D, dtype=torch.float64), make([5, 4], 5))
        return t._model(sliced), example, (torch.randn(3, 7, t.D, dtype=torch.float64, generator=g), make([7, 2, 5], 7))

    cases = {kind: lambda make=make, sliced=sliced: case(make, sliced) for kind, make, sliced in t.MASKS}
    cases["per_head"] = lambda: case(t._per_head, False)
    return cases


def _rotary():
    import test_from_torch_rotary as t

    def llama(**config):
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        args = (torch.randn(3, 7, 16, dtype=torch.float64), t.causal([7, 2, 5], 7))
        return t._llama(**config), (x, t.causal([5, 3], 5)), args

    def plain(make):
        torch.manual_seed(0)
        return (
            make().double(),
            (torch.randn(2, 5, 16, dtype=torch.float64),),
            (torch.randn(3, 7, 16, dtype=torch.float64),),
        )

    return {
        "llama": lambda: llama(num_key_value_heads=4),
        "llama_grouped": lambda: llama(),
        "interleaved_partial": lambda: plain(t.InterleavedRotary),
        "sdpa_enable_gqa": lambda: plain(t.SdpaGroupedQuery),
    }


def _fused():
    import test_from_torch_fused as t

    def case(name):
        g = torch.Generator().manual_seed(1)
        example = (torch.randn(2, 5, t.C, dtype=torch.float64), *t._args(name, [5, 3], 5))
        return (
            t._model(name),
            example,
            (torch.randn(3, 7, t.C, dtype=torch.float64, generator=g), *t._args(name, [7, 2, 5], 7)),
        )

    return {name: lambda name=name: case(name) for name in t.CASES}


def _torch_attention():
    import test_from_torch_torch_attention as t

    def case(make, example, args):
        torch.manual_seed(0)
        return make(), example, args

    def padding(n, last):
        mask = torch.zeros(2, n, dtype=torch.bool)
        mask[last, -2:] = True
        return mask

    def encoder(norm_first):
        layer = torch.nn.TransformerEncoderLayer(
            t.E, t.H, 16, dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu", dtype=t.F64
        )
        return torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()  # (its test's: 2 layers)

    x5, x7 = t._x(2, 5, t.E), t._x(3, 7, t.E, seed=1)
    return {
        "self_bias": lambda: case(t.SelfAttention, (x5,), (x7,)),
        "self_no_bias": lambda: case(lambda: t.SelfAttention(bias=False), (x5,), (x7,)),
        "causal_key_padding": lambda: case(t.Masked, (x5, padding(5, 0)), (t._x(2, 7, t.E, seed=1), padding(7, 1))),
        "cross_packed": lambda: case(t.Cross, (x5, t._x(2, 6, t.E, seed=1)), (x7, t._x(3, 4, t.E, seed=3))),
        "cross_separate": lambda: case(
            lambda: t.Cross(kdim=6, vdim=6), (x5, t._x(2, 6, 6, seed=1)), (x7, t._x(3, 4, 6, seed=3))
        ),
        "encoder_post_ln": lambda: case(lambda: encoder(False), (x5,), (x7,)),
        "encoder_pre_ln": lambda: case(lambda: encoder(True), (x5,), (x7,)),
        "sequence_first": lambda: case(t.SequenceFirst, (t._x(5, 2, t.E),), (t._x(7, 3, t.E, seed=2),)),
    }


def _surprises():
    import test_from_torch_surprises as t

    functions = [t._normalised, t._detached, t._masked_under_no_grad, t._mean_over_keys, t._literal_six]
    return {f.__name__.strip("_"): (f, t._qkv(), t._qkv(n=9, seed=1)) for f in functions}


def _arguments():
    import test_from_torch_arguments as t

    cases = {
        f"{fn.__name__}{'_batched' if batch else ''}": (fn, t.tensors(0, allowed, batch), t.tensors(1, allowed, batch))
        for fn, _, _, allowed, batch in t.MASKED
    }
    cases["causal_and_masked"] = (t.causal_and_masked, t.tensors(0, False, ()), t.tensors(1, False, ()))

    def projected():
        model, x = t._model()
        return model, (x,), (torch.randn(3, 7, t.D, dtype=torch.float64),)

    cases["projected"] = projected
    return cases


CORPORA = {
    "forms": _forms,
    "heads_forms": _heads_forms,
    "per_sequence": _per_sequence,
    "computed_masks": _computed_masks,
    "head_constants": _head_constants,
    "float_masks": _float_masks,
    "rotary": _rotary,
    "fused": _fused,
    "torch_attention": _torch_attention,
    "surprises": _surprises,
    "arguments": _arguments,
}


def build(case) -> tuple:
    """(fn, example, args) of a case: a tuple, or a builder of one (models made at the case's seed)."""
    return case() if callable(case) else case


ROW_STATISTIC = "A reads a row's k-th largest of the scores, which the kernels never hold whole"
WEIGHTED = "the weights multiplied by a matrix after the softmax, (P ⊙ C) V"
REFUSED = {  # the cases whose spec has no core the kernels compute (the torch ops run), and why
    "computed_masks/above_mean": "A reads a row's sum of the scores, which the kernels never hold whole",
    **{
        f"computed_masks/{name}": ROW_STATISTIC
        for name in ("top_k", "top_k_where", "top_k_ge_sorted", "kth_smallest", "causal_top_k", "hinge_to_kth")
    },
    "computed_masks/TopK": ROW_STATISTIC,
    "computed_masks/HeadsTopK": ROW_STATISTIC,
    "head_constants/keep_per_head": WEIGHTED,
    "head_constants/KeptBoth per head and sequence": WEIGHTED,
    "arguments/dropped_weights": WEIGHTED,
}
CASES = [f"{corpus}/{name}" for corpus, make in CORPORA.items() for name in make()]


def _case(name: str) -> tuple:
    corpus, _, case = name.partition("/")
    return build(CORPORA[corpus]()[case])


@pytest.mark.parametrize("name", [c for c in CASES if c not in REFUSED])
def test_a_corpus_case_dropped_in_runs_the_kernels(name, monkeypatch):
    _kernels_give_the_torch_ops_values(*_case(name), monkeypatch)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_case_without_a_core_keeps_the_torch_ops_and_says_why_in_one_line(name, monkeypatch):
    fn, example, _ = _case(name)
    closed = ClosedForm(fn, example, second_order=False)
    with pytest.raises(SymattnError) as refused:
        render(closed.spec, "triton", second_order=False)
    assert str(refused.value) == f"{closed.spec.name}: {WHAT} ({REFUSED[name]})"
    args = tuple(_floating(a) for a in example)  # float32 (a module's parameters too): what the kernels take
    if isinstance(fn, torch.nn.Module):
        fn.float()
    assert _routed_calls(closed, args, monkeypatch) is None
    path = closed.generated.path(*closed.inputs(args))
    assert path == f"torch: no {closed.spec.name}_triton module imports beside this one"


def test_every_case_is_counted_once():
    assert set(REFUSED) <= set(CASES) and len(set(CASES)) == len(CASES)


@pytest.mark.parametrize("batched", [False, True], ids=["parameter", "per_sequence"])
def test_a_per_head_bias_input_is_a_learned_table_of_the_kernels(batched, tmp_path):
    """softmax(Q_h K_hᵀ + B_h) V_h with B an input n × (H·n) split into the heads (a parameter, or one per sequence):
    read at positions in the kernels, its gradient theirs; against autograd of the per-head formula (float64)."""
    import sympy as sp
    from triton_rendered import compare, triton_module

    import symattn as sa
    from symattn.lang.ops import SplitHeads
    from symattn.specs import dim

    n, d = dim("n"), dim("d")
    q, k, v = (sp.MatrixSymbol(name, n, 2 * d) for name in "QKV")
    bias = sp.MatrixSymbol("B", n, 2 * n)
    qh, kh, vh = (SplitHeads(x, 2) for x in (q, k, v))
    output = sa.merge_heads(sa.softmax(qh * kh.T + SplitHeads(bias, 2)) * vh, 2)
    spec = sa.Spec(
        "head_bias", "a learned bias per head", (q, k, v, bias), output, parameters=() if batched else ("B",)
    )
    module = triton_module(spec, tmp_path)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(3, 7, 8, generator=g, dtype=torch.float64) for _ in "QKV"]
    inputs.append(torch.randn(*((3,) if batched else ()), 7, 14, generator=g, dtype=torch.float64))

    def reference(q, k, v, b):
        heads = [x.unflatten(-1, (2, -1)).transpose(-3, -2) for x in (q, k, v, b)]  # (…, H, n, ·)
        out = torch.softmax(heads[0] @ heads[1].mT + heads[3], -1) @ heads[2]
        return out.transpose(-3, -2).flatten(-2)

    results = []
    for call, cast in ((module.forward, torch.Tensor.float), (reference, torch.Tensor.clone)):
        leaves = [cast(x).requires_grad_() for x in inputs]
        out = call(*leaves)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    for name, got, want in zip(["output", *"QKVB"], *results):
        compare(got, want.detach(), name, rtol=1e-4)
