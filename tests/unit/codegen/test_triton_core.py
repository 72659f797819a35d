"""The Triton backend's core detection (O = N(E(Q Kᵀ)) V in a spec) and its printer of the entrywise steps."""

from __future__ import annotations

import math
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import sympy as sp

import symattn as sa
from symattn.codegen.backends import BACKENDS, backend_named
from symattn.codegen.backends.triton.core import find_cores
from symattn.codegen.backends.triton.printer import TilePrinter, print_core
from symattn.errors import SymattnError
from symattn.lang.functions import TRITON
from symattn.lang.lazy import plain
from symattn.lang.ops import RepeatHeads, SplitHeads
from symattn.lang.positions import make
from symattn.specs import dim, family

GALLERY = Path(__file__).resolve().parents[3] / "examples" / "specs"


def gallery(name: str) -> sa.Spec:
    return runpy.run_path(str(GALLERY / f"{name}_attention.py"))["spec"]


def builtin(name: str) -> sa.Spec:
    found = family(name)
    return found.generated_spec(found.masks)[0]


def find_core(spec: sa.Spec):
    """The spec's one core."""
    (core,) = find_cores(spec).cores
    return core


@pytest.mark.parametrize(
    "name, normaliser, tiles, scalars",
    [
        ("softcap", "row softmax", (), ()),
        ("temperature", "row softmax", (), ("tau",)),
        ("bias", "row softmax", ("B",), ()),
        ("sigmoid", "none", (), ()),
        ("gated", "row softmax", (), ()),
        ("cosine", "row softmax", (), ()),
        ("qk_norm", "row softmax", (), ()),
        ("softplus", "row sum", (), ()),
        ("pointer", "log-softmax", (), ()),
    ],
)
def test_a_gallery_core_is_found_with_its_normaliser_tiles_and_scalars(name, normaliser, tiles, scalars):
    core = find_core(gallery(name))
    assert core.normaliser == normaliser
    assert tuple(str(t.name) for t in core.tiles) == tiles
    assert tuple(map(str, core.scalars)) == scalars
    assert core.scores in core.logits.free_symbols
    assert core.query.shape[0] == core.scores.shape[0] and core.key.shape[0] == core.scores.shape[1]


def test_the_scores_product_is_cut_between_its_thin_factors():
    core = find_core(builtin("self_attention"))  # 1/√d_k · X W_Q W_Kᵀ Xᵀ, one flattened product
    x, w_q, w_k = (sp.MatrixSymbol(name, *shape) for name, shape in _shapes(builtin("self_attention")).items())
    assert core.query == x * w_q and core.key == x * w_k
    assert str(core.logits) == "1/sqrt(d_k)*S"


def test_projections_in_torchs_layout_are_the_thin_factors_not_scores_products():
    """softmax((X W_Qᵀ + 𝟏 b_Q)(X W_Kᵀ + 𝟏 b_Kᵀ)ᵀ/√d)(X W_Vᵀ) as from_torch reads nn.Linear: X W_Qᵀ has the shape of
    a scores product of thin factors, but it lies inside the outer product's factor: Q, not a second core."""
    n, e, d = dim("n"), dim("e"), dim("d")
    x = sp.MatrixSymbol("x", n, e)
    w_q, w_k, w_v = (sp.MatrixSymbol(name, d, e) for name in ("W_Q", "W_K", "W_V"))
    b_q, b_k = (sp.MatrixSymbol(name, 1, d) for name in ("b_Q", "b_K"))
    ones = sp.OneMatrix(n, 1)
    q, k = x * w_q.T + ones * b_q, x * w_k.T + ones * b_k
    spec = sa.Spec(
        "linear", "nn.Linear projections", (x, w_q, b_q, w_k, b_k, w_v), sa.softmax(q * k.T / sp.sqrt(d)) * (x * w_v.T)
    )
    core = find_core(spec)
    assert core.query == q and core.key == k and core.value == x * w_v.T
    assert str(core.logits) == "1/sqrt(d)*S" and core.normaliser == "row softmax"


def test_log_of_a_softmax_is_the_log_softmax_map():
    """log(softmax(A)), as code writes log-probabilities in two calls: the kernels' map log-softmax(A)."""
    n, d = dim("n"), dim("d")
    q, k = sp.MatrixSymbol("Q", n, d), sp.MatrixSymbol("K", n, d)
    core = find_core(sa.Spec("pointer", "log-probabilities", (q, k), sa.log(sa.softmax(q * k.T))))
    assert core.normaliser == "log-softmax" and core.value is None and core.query == q and core.key == k


def _shapes(spec: sa.Spec) -> dict:
    return {str(x.name): x.shape for x in spec.matrix_inputs[:3]}


def test_what_the_output_makes_of_o_stays_outside_the_core():
    found = find_cores(gallery("gated"))
    assert found.cores[0].output in found.rest.free_symbols and "Sigmoid" in str(found.rest)


def test_a_sum_of_normalised_maps_times_v_is_one_core_per_map():
    """(P₁ − λ P₂) V = P₁ V − λ P₂ V: two cores, λ outside them, in the order the spec names them."""
    found = find_cores(gallery("differential"))
    assert [str(c.output) for c in found.cores] == ["O1", "O2"]
    assert [str(c.query) for c in found.cores] == ["X*W_Q1", "X*W_Q2"]
    assert all(c.normaliser == "row softmax" and str(c.value) == "X*W_V" for c in found.cores)
    assert str(found.rest) == "(-lam)*O2 + O1"


def test_the_output_reading_p_besides_p_v_is_refused():
    n, d = dim("n"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", n, d), sa.matrix("V", n, d)
    p = sa.softmax(q * k.T)
    spec = sa.Spec("reads_p", "P V + rowsum(P) 𝟏ᵀ", (q, k, v), p * v + sa.rowsum(p) * sa.ones(1, d))
    with pytest.raises(SymattnError, match="reads P or the scores besides P V"):
        find_cores(spec)


@pytest.mark.parametrize("name, normaliser", [("softcap", "row softmax"), ("softplus", "row sum"), ("sigmoid", "none")])
def test_dropped_out_weights_are_the_cores_with_their_p_and_the_undropped_n_a(name, normaliser):
    """O = (N(A) ⊙ Z_p(N(A))) V: the core of N(A) V, its p recorded; the weights' own factors beside Z (the row sums'
    division, A ⊙ (rowsum(A) 𝟏ᵀ)^∘−1, flattened with it) peeled off too."""
    spec = gallery(name)
    (core,) = find_cores(spec).cores
    (p_v,) = [
        x for x in sp.preorder_traversal(spec.output) if isinstance(x, sp.MatMul) and x.shape == core.output.shape
    ]
    weights = p_v.args[0] if p_v.args[0].shape == core.scores.shape else p_v.args[-2]
    dropped = sa.Spec(
        f"{name}_dropped", "dropped", spec.inputs, spec.output.xreplace({weights: sa.dropout(weights, 0.2)})
    )
    (found,) = find_cores(dropped).cores
    assert found.normaliser == normaliser and found.dropout == sp.Rational(1, 5) and core.dropout is None
    assert found.logits == core.logits


def test_dropout_inside_the_scores_steps_is_refused_naming_it():
    n, d = dim("n"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", n, d), sa.matrix("V", n, d)
    spec = sa.Spec("inside", "softmax(dropout(S)) V", (q, k, v), sa.softmax(sa.dropout(q * k.T, 0.1)) * v)
    with pytest.raises(SymattnError, match=r"^inside: dropout inside the scores' steps \(Q\*K\.T\)"):
        find_cores(spec)
    in_q = sa.Spec("in_q", "softmax(dropout(Q) Kᵀ) V", (q, k, v), sa.softmax(sa.dropout(q, 0.1) * k.T) * v)
    # a thin factor's dropout: torch code before the kernels
    assert "DropoutMask" in str(find_cores(in_q).cores[0].query)


@pytest.mark.parametrize("name", ["linear"])
def test_a_spec_without_a_core_is_refused_in_one_line_naming_it(name):
    with pytest.raises(SymattnError, match=rf"^{name}_attention: no n × m core the Triton kernels cover \(.+\)$"):
        find_cores(gallery(name))


def test_the_printed_backward_is_the_librarys_differential():
    """Softcap's A = 50 tanh(c S), c = 1/(50√d_k): the kernels' A₂ = log₂e · A (their exp2), tanh's call printed once
    (f0) and shared; dS = (1/√d_k) · G ⊙ (1 − T²), its scalar (c1) applied once to dQ and dK."""
    printed = print_core(find_core(gallery("softcap")), frozenset())
    assert printed.logits_lines == ("f0 = (2.0 * tl.sigmoid(2.0 * (c0 * s)) - 1.0)",)  # tanh's Triton call, on c·S
    assert printed.logits == f"({50 * (1 / math.log(2))!r} * f0)"
    assert printed.scores_gradient == "(g * ((-1.0 * (f0 * f0)) + 1.0))" and printed.scores_scale == "c1"
    assert [str(c) for c in printed.coefficients] == ["1/(50*sqrt(d_k))", "1/sqrt(d_k)"]


def test_an_n_by_m_input_and_the_mask_get_their_gradient_tiles():
    log2e = f"{1 / math.log(2)!r}"  # (A₂ = log₂e · A: the kernels' exp2)
    bias = print_core(find_core(gallery("bias")), frozenset())
    assert bias.tile_gradients == {"B": "g"} and bias.logits == f"((c0 * s) + ({log2e} * tile_B))"
    attention = print_core(find_core(builtin("attention")), frozenset({"M"}))  # made where M requires grad
    assert attention.tile_gradients == {"M": "g"} and attention.logits == f"((c0 * s) + ({log2e} * tile_M))"


def test_a_trainable_scalar_gets_its_partial():
    printed = print_core(find_core(gallery("temperature")), frozenset())
    assert printed.scalar_partials == {"tau": "(1.0 * s)"}


def test_the_printed_tangent_is_the_librarys_differential_along_every_input():
    """Ȧ along Ṡ (s_dot), an n × m input's tangent tile and a trainable scalar's τ̇ (a new scalar argument)."""
    temperature = print_core(find_core(gallery("temperature")), frozenset())
    assert temperature.logits_tangent == "((c1 * s_dot) + (c2 * s))"  # d(τ S) = τ Ṡ + τ̇ S (c0: τ/ln 2, A₂'s)
    assert [str(c) for c in temperature.coefficients] == ["tau/log(2)", "tau"]
    assert [str(c) for c in temperature.tangent_coefficients] == ["tau_t"]
    bias = print_core(find_core(gallery("bias")), frozenset())
    assert bias.logits_tangent == "((c1 * s_dot) + tile_B_dot)" and bias.tangent_coefficients == {}
    attention = print_core(find_core(builtin("attention")), frozenset({"M"}))
    assert attention.logits_tangent == "(c1 * s_dot)"  # the mask does not move


def test_powers_print_as_products_or_roots_and_others_are_refused():
    s = sp.MatrixSymbol("S", 3, 4)
    printer = TilePrinter({s: "s"})
    assert printer.doprint(plain(sp.HadamardPower(s, 2))) == "(s * s)"
    assert printer.doprint(plain(sp.HadamardPower(s, -1))) == "(1.0 / (s))"
    assert printer.doprint(plain(sp.HadamardPower(s, sp.Rational(1, 2)))) == "tl.sqrt(s)"
    with pytest.raises(SymattnError, match="no entrywise power 1/3"):
        printer.doprint(plain(sp.HadamardPower(s, sp.Rational(1, 3))))


def test_triton_is_optional_and_written_for_the_builtins(tmp_path):
    """A plain generate writes a built-in's Triton module beside its others (a user's spec: numpy, torch, jax only)."""
    from symattn.codegen.generate import generate, render

    assert TRITON not in BACKENDS and backend_named(TRITON).variants == ("standard",)
    assert tmp_path / "attention_triton.py" in generate(["attention"], out=tmp_path)
    with pytest.raises(SymattnError, match="no memeff variant"):
        render("attention", TRITON, "memeff")


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff (the formatter of generated code) is not installed")
def test_the_builtins_triton_modules_are_ruff_clean(tmp_path):
    """Laid out as ruff format lays them out and lint-clean, as the committed generated modules are."""
    from symattn.codegen.generate import generate

    written = [p for p in generate(out=tmp_path, backends=[TRITON]) if p.name.endswith("_triton.py")]
    assert len(written) == len(sa.specs())
    for command in (["format", "--check"], ["check"]):
        done = subprocess.run([shutil.which("ruff"), *command, *map(str, written)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_multi_head_spec_binds_its_head_counts_then_d_k():
    """mha's sizes are H·d_k and H_kv·d_k: H and H_kv are its options (checked, H_kv dividing H), d_k the axis over H,
    and H_kv·d_k checked against its axis; the mask and the biases are keywords as in the torch module."""
    from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
    from symattn.codegen.backends.triton.bindings import binding_lines
    from symattn.codegen.backends.triton.module import triton_spec

    spec, options = triton_spec("mha")
    lines = binding_lines(spec, options, TorchMatrixPrinter().doprint, {"H", "H_kv", "d_k"})
    assert lines == [
        'H = _count("num_heads", num_heads)',
        'H_kv = _count("num_kv_heads", H if num_kv_heads is None else num_kv_heads)',
        '_divides("num_kv_heads", H_kv, "num_heads", H)',
        'd_k = _share(dims, "H*d_k", H)',
        '_product(dims, "H_kv*d_k", H_kv * d_k)',
    ]
    assert binding_lines(spec, options, TorchMatrixPrinter().doprint, set())[:1] == [lines[0]]  # checks stay


def test_only_the_dimensions_the_code_reads_are_bound():
    from symattn.codegen.backends.torch.backend import TorchMatrixPrinter
    from symattn.codegen.backends.triton.bindings import binding_lines
    from symattn.codegen.backends.triton.module import triton_spec

    spec, options = triton_spec("attention")
    assert binding_lines(spec, options, TorchMatrixPrinter().doprint, {"scale"}) == [
        'd_k = dims["d_k"]',
        "scale = 1 / d_k**0.5 if scale is None else scale",
    ]


def _window_of(formula, normaliser=sa.softmax, heads=None, scalar=False):
    """The printed tile window of softmax(Q Kᵀ + E) V (or E per head), E = sa.entries(n, m, formula)."""
    n, m, d = dim("n"), dim("m"), dim("d")
    width = d if heads is None else heads * d
    q, k, v = sa.matrix("Q", n, width), sa.matrix("K", m, width), sa.matrix("V", m, width)
    if heads is None:
        output = normaliser(q * k.T + sa.entries(n, m, formula)) * v
    else:
        qh, kh, vh = (sa.split_heads(x, heads) for x in (q, k, v))
        output = sa.merge_heads(sa.softmax(qh @ kh.T + sa.entries(n, m, formula, heads=heads)) @ vh, heads)
    inputs = (q, k, v, sa.scalar("tau")) if scalar else (q, k, v)
    core = find_cores(sa.Spec("windowed", "a mask of positions", inputs, output)).cores[0]
    return print_core(core, frozenset())


def _masked(condition):
    return sp.Piecewise((0, condition), (-sp.oo, True))


def test_a_causal_window_prints_its_tiles_bounds_and_its_formula_without_the_mask():
    # rows row0 … row1 − 1 of a window of 5 keys see keys row0 − 4 … row1 − 1, all of them row1 − 5 … row0
    printed = _window_of(lambda i, j: _masked((j <= i) & (i - j < 5)))
    assert printed.window.keys == (
        "tl.maximum(0, (-4 + row0))",
        "tl.minimum(row1, m)",
        "tl.maximum(0, (-5 + row1))",
        "tl.minimum(m, (1 + row0))",
    )
    assert printed.window.rows == ("key0", "tl.minimum(n, (4 + key1))", "(-1 + key1)", "tl.minimum(n, (5 + key0))")
    assert printed.open_positions == {"pos0": "0.0"}


@pytest.mark.parametrize(
    "formula, heads, scalar",
    [
        (lambda i, j: _masked(sp.floor(i / 8) >= sp.floor(j / 8)), None, False),  # a floor
        (lambda i, j: _masked(sa.scalar("tau") * i >= j), None, True),  # a trainable scalar in the condition
        (lambda i, j, h: _masked((j <= i) & (i - j < 8 * (h + 1))), 4, False),  # a mask that reads the head
    ],
    ids=["floor", "scalar", "head"],
)
def test_a_mask_the_analysis_cannot_read_leaves_every_tile_masked(formula, heads, scalar):
    printed = _window_of(formula, heads=heads, scalar=scalar)
    assert printed.window is None and not printed.open_positions


def test_a_mask_under_another_normaliser_or_a_function_is_no_window():
    # σ(A) with −∞ in A: P = 0 there too, but only the row softmax's argument is read (a mask under tanh is none)
    assert _window_of(lambda i, j: _masked(j <= i), normaliser=lambda a: sa.sigmoid(a)).window is None
    assert _window_of(lambda i, j: _masked(j <= i), normaliser=lambda a: sa.softmax(sa.tanh(a))).window is None


# context parallelism's question of a spec: is its work outside the cores row-local (codegen/backends/triton/core.py)
ROW_LOCAL = ["attention", "mha", "self_attention", "transformer_block"]
ROW_LOCAL_GALLERY = ["bias", "cosine", "differential", "gated", "qk_norm", "sigmoid", "softcap", "softplus"]


def _with_outside(name: str, outside) -> sa.Spec:
    """softmax(Q Kᵀ/√d) V with outside(O, X, K, V) made of it: O's rows are the sequence's (n), K's and V's too."""
    n, d = dim("n"), dim("d")
    x, w_q, w_k, w_v = sa.matrix("X", n, d), sa.matrix("W_Q", d, d), sa.matrix("W_K", d, d), sa.matrix("W_V", d, d)
    q, k, v = x * w_q, x * w_k, x * w_v
    o = sa.softmax(q * k.T / sp.sqrt(d)) * v
    return sa.Spec(name, name, (x, w_q, w_k, w_v), outside(o, x, k, v))


@pytest.mark.parametrize(
    "outside, why",
    [
        (lambda o, x, k, v: o * (k.T * v), "sums over the sequence (n)"),  # O (Kᵀ V): a contraction over positions
        (lambda o, x, k, v: o + sa.ones(dim("n"), 1) * (sa.ones(1, dim("n")) * x), "sums over the sequence (n)"),
        (lambda o, x, k, v: o + sa.ones(dim("n"), 1) * sa.rowsum(x.T).T, "works along the sequence (n)"),
        (lambda o, x, k, v: o / dim("n"), "reads the sequence's length n as a number"),  # the rank's n, not the whole
        (lambda o, x, k, v: o * x.T, "has a column per position (n)"),  # an n × n output
    ],
)
def test_work_outside_the_cores_that_mixes_rows_is_named(outside, why):
    from symattn.codegen.backends.triton.core import mixed_rows

    assert why in mixed_rows(find_cores(_with_outside("mixing", outside)))


def test_the_built_ins_and_the_gallery_are_row_local_outside_their_cores():
    from symattn.codegen.backends.triton.core import mixed_rows

    specs = [builtin(name) for name in ROW_LOCAL] + [gallery(name) for name in ROW_LOCAL_GALLERY]
    specs.append(_with_outside("residual", lambda o, x, k, v: sa.relu(o) + x))
    assert [mixed_rows(find_cores(s)) for s in specs] == [None] * len(specs)


def _heads(n, m, d, heads=2):
    q, k, v = sa.matrix("Q", n, heads * d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    return q, k, v, SplitHeads(q, heads)


def test_grouped_keys_written_as_the_repetition_of_a_transpose_are_grouped_heads():
    """RepeatHeads(Kᵀ) (multi-query keys sliced or viewed before the transpose) is RepeatHeads(K)ᵀ: the one core."""
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v, qh = _heads(n, m, d)
    kh, vh = (RepeatHeads(SplitHeads(x, 1), 1, 2) for x in (k, v))
    spelt = RepeatHeads(SplitHeads(k, 1).T, 1, 2)
    core = find_core(sa.Spec("mqa", "multi-query", (q, k, v), sa.merge_heads(sa.softmax(qh * spelt) * vh, 2)))
    assert core.grouped and core.key == SplitHeads(k, 1) and core.value == SplitHeads(v, 1)
    assert kh.shape == core.key.shape


def test_one_scores_product_under_several_scalars_is_one_core():
    """where(s > 0, s, 0.1 s) reads c·Q Kᵀ at two scalars c: both are c·S of the one product."""
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    core = find_core(sa.Spec("two", "two scales", (q, k, v), sa.softmax(sa.relu(q * k.T) + q * k.T / 10) * v))
    assert core.query == q and core.key == k and core.logits.free_symbols >= {core.scores}
    assert not any(isinstance(x, sp.MatMul) and len(x.args) > 2 for x in sp.preorder_traversal(core.logits))


def test_a_per_head_constant_and_a_broadcast_constant_are_read_at_positions():
    """split_heads(C, H) of an n × H·m constant, and 𝟏 [c_ij] 𝟏ᵀ of a 1 × 1 one: tables of the kernels, no tiles."""
    n, d = dim("n"), dim("d")
    q, k, v, qh = _heads(n, n, d)
    kh, vh = (RepeatHeads(SplitHeads(x, 1), 1, 2) for x in (k, v))
    c, t = sp.MatrixSymbol("C", n, 2 * n), sp.MatrixSymbol("T", 1, 1)
    scale = sp.OneMatrix(n, 1) * make(1, 1, lambda i, j: t[i, j]) * sp.OneMatrix(1, n)
    logits = sp.HadamardProduct(qh * kh.T, scale) + SplitHeads(c, 2)
    spec = sa.Spec("both", "constants", (q, k, v), sa.merge_heads(sa.softmax(logits) * vh, 2), constants=(c, t))
    core = find_core(spec)
    assert core.tiles == () and {str(x.name) for x in core.tables} == {"C", "T"}
