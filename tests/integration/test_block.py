"""transformer_block: LayerNorm and GELU nodes, the spec, and its generated modules against
torch.nn.TransformerEncoderLayer(norm_first=True, dropout=0.0, activation="gelu", batch_first=True)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.lang.ops import GeluGrad, GeluTanhGrad, RowInvStd, gelu, layer_norm
from symattn.numeric.printers import NUMPY_RUNTIME
from symattn.numeric.verify import vjp_error

NAMES = sa.spec("transformer_block").input_names  # the spec's order: X, the weights and norms, then the biases
n, d = sp.symbols("n d", positive=True, integer=True)


def test_layer_norm_and_gelu_rules_match_finite_differences(rng):
    # d LN(A) = r𝟏ᵀ ⊙ (dA − dA 𝟏𝟏ᵀ/d − N ⊙ (N ⊙ dA) 𝟏𝟏ᵀ/d); d GELU(A) = GELU′(A) ⊙ dA (erf and tanh forms)
    x, w = sp.MatrixSymbol("X", n, d), sp.MatrixSymbol("W", d, d)
    for expr in (layer_norm(x * w, sp.Rational(1, 10)), gelu(x * w), gelu(x * w, "tanh"), gelu(layer_norm(x, 1)) * w):
        gradients = sa.grad(expr, [x, w])
        for symbol in (x, w):
            assert vjp_error(expr, symbol, gradients[symbol], {n: 3, d: 4}, rng, batch=(2,)) < 1e-8


def test_exact_and_numpy_printers_agree_on_the_new_nodes():
    # exact: SymPy's erf, tanh and square roots on object arrays of Rationals; numpy: float64 helpers
    x = sp.MatrixSymbol("X", n, d)
    values = np.array([[sp.Rational(1, 3), sp.Rational(-2, 5), 2], [1, sp.Rational(1, 7), -1]], dtype=object)
    nodes = [gelu(x), gelu(x, "tanh"), GeluGrad(x), GeluTanhGrad(x)]
    nodes += [layer_norm(x, sp.Rational(1, 10)), RowInvStd(x, sp.Rational(1, 10))]
    for node in nodes:
        exact = np.array(sa.lambdify([x], node, backend="exact")(values), dtype=float)
        assert np.max(np.abs(exact - sa.lambdify([x], node)(values.astype(float)))) < 1e-15, node


def test_numpy_erf_is_accurate_to_double_precision():
    # the generated NumPy modules import only numpy, so erf is a positive-term series there
    namespace: dict = {"np": np}
    exec(NUMPY_RUNTIME["erf"], namespace)
    x = np.concatenate([np.linspace(-9, 9, 1001), [0.0, 1e-300, -7.5, 30.0]])
    exact = np.array([math.erf(t) for t in x])
    assert np.max(np.abs(namespace["erf"](x) - exact)) < 4e-15  # a few ulps of 1


def test_bad_options_are_named():
    with pytest.raises(sa.SymattnError, match="approximate"):
        sa.spec("transformer_block", approximate="sigmoid")
    with pytest.raises(sa.SymattnError, match="eps"):
        sa.spec("transformer_block", eps=-1.0)
    with pytest.raises(sa.SymattnError, match="num_heads"):
        sa.spec("transformer_block", num_heads=0)
    x = sp.MatrixSymbol("X", n, d)
    with pytest.raises(sa.SymattnError, match="positive scalar eps"):
        layer_norm(x, x)
    with pytest.raises(sa.SymattnError, match="'none' or 'tanh'"):
        gelu(x, "exact")


def test_tanh_gelu_derivation_steps_verify():
    derivation = sa.derive("transformer_block", num_heads=2, approximate="tanh")
    report = derivation.verify(["W_1", "gamma_2"], seed=3)
    assert report.ok, report.text()
    assert "GELU_tanh′(U)" in derivation.text("W_1")


@pytest.mark.parametrize(("norm_first", "activation"), [(False, "relu"), (False, "silu"), (True, "relu")])
def test_other_configurations_derivation_steps_verify(norm_first, activation):
    # post-LN: X₁ = LN₁(X + MHA(X)), Z = LN₂(X₁ + act(X₁ W_1 + 𝟏b_1) W_2 + 𝟏b_2); pre-LN with ReLU or SiLU
    derivation = sa.derive("transformer_block", num_heads=2, norm_first=norm_first, activation=activation)
    report = derivation.verify(["W_1", "gamma_2", "W_Q"], seed=5)
    assert report.ok, report.text()
    assert ("post-LN" if not norm_first else "pre-LN") in sa.spec("transformer_block", norm_first=norm_first).summary


def test_bad_configurations_are_named():
    from symattn.codegen.generate import render

    with pytest.raises(sa.SymattnError, match="activation must be one of gelu, relu, silu"):
        sa.spec("transformer_block", activation="tanh")
    with pytest.raises(sa.SymattnError, match="applies to GELU only"):
        sa.spec("transformer_block", activation="relu", approximate="tanh")
    with pytest.raises(sa.SymattnError, match="norm_first must be True or False"):
        sa.spec("transformer_block", norm_first="yes")
    with pytest.raises(sa.SymattnError, match="not a configuration option"):
        render("transformer_block", "torch", configuration={"causal": True})
    with pytest.raises(sa.SymattnError, match="triton backend takes no configuration"):
        render("transformer_block", "triton", configuration={"norm_first": False})


def test_causal_derivation_steps_verify():
    # A_h = S_h/√d_k + M: the mask M is a constant (random in the check), never differentiated
    derivation = sa.derive("transformer_block", num_heads=2, causal=True)
    assert "A_h = (1/√d_k) S_h + M" in derivation.text("W_K")
    report = derivation.verify(["W_K", "b_V"], seed=4)
    assert report.ok, report.text()


# Against PyTorch.


def _reference(
    torch,
    causal: bool,
    approximate: str = "none",
    batch: int = 3,
    n_tokens: int = 5,
    seed: int = 0,
    absent: tuple[str, ...] = (),
    d_model: int = 8,
    d_ff: int = 16,
):
    """A random float64 TransformerEncoderLayer, its output and parameter gradients, and the mapped inputs.

    The biases named in absent are zero, which is the layer without them.
    """
    torch.manual_seed(seed)
    heads = 2
    activation = "gelu" if approximate == "none" else (lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    layer = torch.nn.TransformerEncoderLayer(
        d_model, heads, d_ff, dropout=0.0, activation=activation, batch_first=True, norm_first=True
    ).double()
    with torch.no_grad():  # move every parameter off its initial value (LayerNorm's γ = 1, β = 0)
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
        biases = {
            "b_Q": layer.self_attn.in_proj_bias[:d_model],
            "b_K": layer.self_attn.in_proj_bias[d_model : 2 * d_model],
            "b_V": layer.self_attn.in_proj_bias[2 * d_model :],
            "b_O": layer.self_attn.out_proj.bias,
            "b_1": layer.linear1.bias,
            "b_2": layer.linear2.bias,
        }
        for name in absent:
            biases[name].zero_()
    x = torch.randn(batch, n_tokens, d_model, dtype=torch.float64, requires_grad=True)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(n_tokens, dtype=torch.float64) if causal else None
    out = layer(x, src_mask=mask, is_causal=causal)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    attn, k = layer.self_attn, d_model

    def rows(t):  # a torch bias or LayerNorm parameter as a 1 × d row
        return t[None]

    w_in, b_in = attn.in_proj_weight, attn.in_proj_bias
    # math convention: Q = X W_Q + 𝟏 b_Q with W_Q = in_proj_weight[:d]ᵀ (nn.Linear stores the transpose)
    params = {
        "W_Q": w_in[:k].T,
        "W_K": w_in[k : 2 * k].T,
        "W_V": w_in[2 * k :].T,
        "W_O": attn.out_proj.weight.T,
        "b_Q": rows(b_in[:k]),
        "b_K": rows(b_in[k : 2 * k]),
        "b_V": rows(b_in[2 * k :]),
        "b_O": rows(attn.out_proj.bias),
        "gamma_1": rows(layer.norm1.weight),
        "beta_1": rows(layer.norm1.bias),
        "gamma_2": rows(layer.norm2.weight),
        "beta_2": rows(layer.norm2.bias),
        "W_1": layer.linear1.weight.T,
        "b_1": rows(layer.linear1.bias),
        "W_2": layer.linear2.weight.T,
        "b_2": rows(layer.linear2.bias),
    }
    g_in, gb_in = w_in.grad, b_in.grad
    grads = {
        "X": x.grad,
        "W_Q": g_in[:k].T,
        "W_K": g_in[k : 2 * k].T,
        "W_V": g_in[2 * k :].T,
        "W_O": attn.out_proj.weight.grad.T,
        "b_Q": rows(gb_in[:k]),
        "b_K": rows(gb_in[k : 2 * k]),
        "b_V": rows(gb_in[2 * k :]),
        "b_O": rows(attn.out_proj.bias.grad),
        "gamma_1": rows(layer.norm1.weight.grad),
        "beta_1": rows(layer.norm1.bias.grad),
        "gamma_2": rows(layer.norm2.weight.grad),
        "beta_2": rows(layer.norm2.bias.grad),
        "W_1": layer.linear1.weight.grad.T,
        "b_1": rows(layer.linear1.bias.grad),
        "W_2": layer.linear2.weight.grad.T,
        "b_2": rows(layer.linear2.bias.grad),
    }
    inputs = {"X": x.detach(), **{name: p.detach() for name, p in params.items()}}
    return inputs, out.detach(), grad_out, grads, {"num_heads": heads, "eps": layer.norm1.eps}


@pytest.mark.parametrize("causal", [False, True])
def test_generated_torch_block_matches_transformer_encoder_layer(causal):
    torch = pytest.importorskip("torch", reason="torch is the reference implementation")
    from symattn.generated import transformer_block_torch as block

    inputs, expected, grad_out, expected_grads, options = _reference(torch, causal)
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
    out = block.forward(**leaves, **options, causal=causal)
    out.backward(grad_out)
    errors = {"output": float((out.detach() - expected).abs().max())}
    errors |= {name: float((leaves[name].grad - expected_grads[name]).abs().max()) for name in NAMES}
    print(f"\ntransformer_block (causal={causal}) vs nn.TransformerEncoderLayer, max abs error:", errors)
    assert all(e < 1e-11 for e in errors.values()), errors
    if causal:  # the mask changes the output: token 0 sees only itself
        unmasked = block.forward(**inputs, **options)
        assert float((unmasked - out.detach()).abs().max()) > 1e-3


def test_generated_nn_module_holds_the_weights_of_an_encoder_layer():
    torch = pytest.importorskip("torch", reason="torch is the reference implementation")
    from symattn.generated import transformer_block_torch as block

    inputs, expected, _, _, options = _reference(torch, causal=True)
    module = block.TransformerBlock(8, 16, num_heads=2, eps=options["eps"], bias=True, dtype=torch.float64)
    assert bool((module.gamma_1 == 1).all()) and bool((module.beta_2 == 0).all())  # as nn.LayerNorm starts
    assert repr(module) == f"TransformerBlock(d_model=8, d_ff=16, num_heads=2, eps={options['eps']}, bias=True)"
    with torch.no_grad():
        for name in NAMES[1:]:
            getattr(module, name).copy_(inputs[name])
    assert float((module(inputs["X"], causal=True).detach() - expected).abs().max()) < 1e-12


def test_tanh_gelu_closed_forms_match_transformer_encoder_layer():
    # the tanh approximation through symattn's own evaluator (the generated modules use the exact GELU)
    torch = pytest.importorskip("torch", reason="torch is the reference implementation")
    inputs, expected, grad_out, expected_grads, options = _reference(torch, causal=False, approximate="tanh", batch=1)
    derivation = sa.derive("transformer_block", num_heads=options["num_heads"], eps=options["eps"], approximate="tanh")
    spec = derivation.spec
    values = [inputs[name].numpy()[0] if name == "X" else inputs[name].numpy() for name in NAMES]
    out = sa.lambdify(spec.inputs, spec.output)(*values)
    errors = {"output": float(np.max(np.abs(out - expected.numpy()[0])))}
    seed = sp.MatrixSymbol("G", *spec.output.shape)
    for symbol in spec.inputs:
        got = sa.lambdify([*spec.inputs, seed], derivation.gradients[str(symbol.name)])(*values, grad_out.numpy()[0])
        want = expected_grads[str(symbol.name)].numpy()
        errors[str(symbol.name)] = float(np.max(np.abs(got - (want[0] if symbol.name == "X" else want))))
    print("\ntransformer_block (approximate='tanh') vs nn.TransformerEncoderLayer, max abs error:", errors)
    assert all(e < 1e-11 for e in errors.values()), errors


def _small_inputs(rng, batch=(2,), n_tokens=3, d_model=4, d_ff=5) -> dict[str, np.ndarray]:
    shapes = {"X": (*batch, n_tokens, d_model), "W_1": (d_model, d_ff), "b_1": (1, d_ff), "W_2": (d_ff, d_model)}
    out = {}
    for name in NAMES:
        shape = shapes.get(name, (d_model, d_model) if name.startswith("W_") else (1, d_model))
        out[name] = rng.standard_normal(shape) + (1.0 if name.startswith("gamma") else 0.0)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_generated_torch_block_passes_gradcheck(rng, causal):
    torch = pytest.importorskip("torch", reason="gradcheck needs torch")
    from symattn.generated import transformer_block_torch as block

    tensors = [torch.tensor(a, requires_grad=True) for a in _small_inputs(rng).values()]

    def f(*args):
        return block.forward(**dict(zip(NAMES, args)), num_heads=2, causal=causal)

    assert torch.autograd.gradcheck(f, tuple(tensors), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal", [False, True])
def test_generated_numpy_block_matches_finite_differences(rng, causal):
    from symattn.generated import transformer_block_numpy as block

    inputs = _small_inputs(rng)
    out, saved = block.forward(**inputs, num_heads=2, causal=causal)
    grad_out = rng.standard_normal(out.shape)
    grads = block.backward(saved, grad_out)
    assert set(grads) == set(NAMES)
    eps = 1e-6
    for name in NAMES:
        direction = rng.standard_normal(inputs[name].shape)
        plus = block.forward(**{**inputs, name: inputs[name] + eps * direction}, num_heads=2, causal=causal)[0]
        minus = block.forward(**{**inputs, name: inputs[name] - eps * direction}, num_heads=2, causal=causal)[0]
        numeric = float(np.sum(grad_out * (plus - minus))) / (2 * eps)
        analytic = float(np.sum(grads[name] * direction))
        assert abs(analytic - numeric) / max(1.0, abs(numeric)) < 1e-7, name


BIASES = ("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2")


@pytest.mark.slow  # trains
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_generated_block_trains_with_any_subset_of_biases(backend):
    # Every subset of the six biases: an absent bias is the layer with that bias zero, and gets no gradient.
    torch = pytest.importorskip("torch", reason="torch is the reference implementation")
    import importlib
    import itertools

    block = importlib.import_module(f"symattn.generated.transformer_block_{backend}")
    worst = 0.0
    for k in range(len(BIASES) + 1):
        for present in itertools.combinations(BIASES, k):
            absent = tuple(b for b in BIASES if b not in present)
            inputs, expected, grad_out, expected_grads, options = _reference(
                torch, causal=False, batch=2, n_tokens=3, absent=absent, d_model=4, d_ff=6
            )
            given = {name: t for name, t in inputs.items() if name not in absent}
            if backend == "torch":
                leaves = {name: t.clone().requires_grad_() for name, t in given.items()}
                out = block.forward(**leaves, **options)
                out.backward(grad_out)
                grads = {name: leaf.grad for name, leaf in leaves.items()}
                out = out.detach()
            else:
                out, saved = block.forward(**{name: t.numpy() for name, t in given.items()}, **options)
                grads = {name: torch.from_numpy(g) for name, g in block.backward(saved, grad_out.numpy()).items()}
                out = torch.from_numpy(out)
            assert set(grads) == set(given), (present, sorted(grads))
            errors = [float((out - expected).abs().max())]
            for name, g in grads.items():
                assert g.shape == expected_grads[name].shape and g.dtype == torch.float64, (present, name)
                errors.append(float((g - expected_grads[name]).abs().max()))
            assert all(e < 1e-11 for e in errors), (present, errors)
            worst = max(worst, *errors)
    print(f"\ntransformer_block_{backend}, 64 subsets of biases: worst max abs error {worst:.2e}")


@pytest.mark.slow  # trains
@pytest.mark.parametrize("present", [(), ("b_1",), ("b_Q", "b_O")])
def test_a_block_module_without_biases_trains(present):
    # TransformerBlock(8, 16, num_heads=2) has no biases: its backward must not read an absent bias's gradient.
    torch = pytest.importorskip("torch", reason="the nn.Module is torch's")
    from symattn.generated import transformer_block_torch as block

    module = block.TransformerBlock(8, 16, num_heads=2, dtype=torch.float64, bias=bool(present))
    for name in BIASES:
        if name not in present and getattr(module, name) is not None:
            setattr(module, name, None)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and bool(x.grad.isfinite().all())
    assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters())
