"""Generated modules answer right or say why not: double backward, unused inputs, one input, MatPow,
docstrings, degenerate sizes and NumPy scalars, over every module in generated/ and user specs."""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import sympy as sp

import symattn as sa
from symattn.codegen.generate import generate
from symattn.specs import dim, family

torch = pytest.importorskip("torch", reason="torch is the reference for the generated modules")

SPECS = ("attention", "self_attention", "mha", "transformer_block")
ROW_BLOCKS = [name for name in SPECS if family(name).row_blocks]
MODULES = [(spec, variant) for spec in SPECS for variant in ("", "_memeff") if not variant or spec in ROW_BLOCKS]
IDS = [spec + variant for spec, variant in MODULES]


def module(spec: str, backend: str, variant: str = ""):
    return importlib.import_module(f"symattn.generated.{spec}_{backend}{variant}")


def draw(spec: str, rng, n: int = 3, m: int = 4, d: int = 2, batch: tuple = (2,), dtype=np.float64):
    """Inputs by name and options; d is the feature size per head (d_k, or d_model for self_attention)."""

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    if spec == "attention":
        return {"Q": normal(*batch, n, d), "K": normal(*batch, m, d), "V": normal(*batch, m, 3)}, {}
    if spec == "self_attention":
        return {"X": normal(*batch, n, d), "W_Q": normal(d, 2), "W_K": normal(d, 2), "W_V": normal(d, 3)}, {}
    width = 2 * d  # two heads
    scaled = {name: normal(width, width) / math.sqrt(max(width, 1)) for name in ("W_Q", "W_K", "W_V", "W_O")}
    if spec == "mha":
        return {"Q": normal(*batch, n, width), "K": normal(*batch, m, width), "V": normal(*batch, m, width)} | scaled, {
            "num_heads": 2
        }
    norms = {name: normal(1, width) + (1.0 if name.startswith("gamma") else 0.0) for name in ("gamma_1", "gamma_2")}
    norms |= {name: normal(1, width) for name in ("beta_1", "beta_2")}
    ffn = {"W_1": normal(width, 3), "W_2": normal(3, width)}
    return {"X": normal(*batch, n, width)} | scaled | norms | ffn, {"num_heads": 2}


def as_tensors(arrays: dict) -> dict:
    return {name: torch.tensor(a, requires_grad=True) for name, a in arrays.items()}


def assert_double_backward_raises(forward, tensors: dict) -> None:
    """gradcheck passes; gradgradcheck and a backward through a create_graph gradient raise."""
    names = list(tensors)

    def f(*args):
        return forward(**dict(zip(names, args)))

    args = tuple(tensors.values())
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.gradgradcheck(f, args, eps=1e-6, atol=1e-7)
    first = args[0]
    (grad,) = torch.autograd.grad(f(*args).sum(), first, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        grad.sum().backward()


@pytest.mark.parametrize(("spec", "variant"), MODULES, ids=IDS)
def test_double_backward_raises_through_every_generated_torch_module(spec, variant, rng):
    # Where no second derivative is derived torch must refuse it, not return the wrong numbers.
    arrays, options = draw(spec, rng, n=3, m=2, d=2, batch=(1,))
    blocks = {"block_size": 2} if variant else {}
    generated = module(spec, "torch", variant)

    def forward(**tensors):
        return generated.forward(**tensors, **options, **blocks)

    if hasattr(generated, "hvp"):  # a second closed form (tests/integration/test_second_order.py): right, not raised
        tensors = as_tensors(arrays)
        names = list(tensors)
        assert torch.autograd.gradgradcheck(lambda *a: forward(**dict(zip(names, a))), tuple(tensors.values()))
        return
    assert_double_backward_raises(forward, as_tensors(arrays))


# --- user specs ------------------------------------------------------------------------------------------------

n_, d_ = dim("n"), dim("d")
X_ = sp.MatrixSymbol("X", n_, d_)
Y_ = sp.MatrixSymbol("Y", n_, d_)
W_ = sp.MatrixSymbol("W_P", d_, d_)  # a parameter: no batch dimensions
USER_SPECS = {
    # Y is an input the output does not read; the summary holds a docstring's quotes and a backslash
    "unused": sa.Spec("unused", 'softmax(X W Xᵀ) X, Y unused; """quoted""" and a \\ backslash', (X_, Y_, W_),
                      sa.softmax(X_ * W_ * X_.T) * X_),
    "single": sa.Spec("single", "softmax(X Xᵀ) X", (X_,), sa.softmax(X_ * X_.T) * X_),
    "matpow": sa.Spec("matpow", "X W³", (X_, W_), X_ * sp.MatPow(W_, 3)),
}  # fmt: skip
REFERENCES = {  # the same forwards written in plain torch
    "unused": lambda X, Y, W_P: torch.softmax(X @ W_P @ X.mT, dim=-1) @ X,
    "single": lambda X: torch.softmax(X @ X.mT, dim=-1) @ X,
    "matpow": lambda X, W_P: X @ W_P @ W_P @ W_P,
}


@pytest.fixture(scope="module")
def user_modules(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("user_specs")
    loaded = {}
    for name, s in USER_SPECS.items():
        generate([s], None, None, out)
        for backend in ("numpy", "torch"):
            path = out / f"{name}_{backend}.py"
            spec = importlib.util.spec_from_file_location(f"user_{name}_{backend}", path)
            loaded[name, backend] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded[name, backend])
    return loaded


def user_inputs(name: str, rng, dtype=np.float64) -> dict:
    shapes = {"X": (2, 3, 2), "Y": (2, 3, 2), "W_P": (2, 2)}
    return {x.name: rng.standard_normal(shapes[x.name]).astype(dtype) for x in USER_SPECS[name].inputs}


@pytest.mark.parametrize("name", sorted(USER_SPECS))
def test_user_spec_modules_match_torch_autograd_forward_and_backward(user_modules, name, rng):
    arrays = user_inputs(name, rng)
    leaves = as_tensors(arrays)
    expected = REFERENCES[name](**leaves)
    grad_out = torch.randn_like(expected)
    expected_grads = dict(
        zip(leaves, torch.autograd.grad(expected, list(leaves.values()), grad_out, allow_unused=True))
    )
    expected_grads = {k: torch.zeros_like(leaves[k]) if g is None else g for k, g in expected_grads.items()}

    out, saved = user_modules[name, "numpy"].forward(**arrays)
    grads = user_modules[name, "numpy"].backward(saved, grad_out.numpy())
    assert np.abs(out - expected.detach().numpy()).max() < 1e-12
    for k, g in grads.items():
        assert g.shape == arrays[k].shape and np.abs(g - expected_grads[k].numpy()).max() < 1e-12, k

    torch_leaves = as_tensors(arrays)
    out = user_modules[name, "torch"].forward(**torch_leaves)
    out.backward(grad_out)
    assert float((out.detach() - expected.detach()).abs().max()) < 1e-12
    for k, leaf in torch_leaves.items():
        assert float((leaf.grad - expected_grads[k]).abs().max()) < 1e-12, k


@pytest.mark.parametrize("name", sorted(USER_SPECS))
def test_user_spec_torch_modules_refuse_double_backward(user_modules, name, rng):
    generated = user_modules[name, "torch"]
    tensors = as_tensors(user_inputs(name, rng))
    if hasattr(generated, "hvp"):  # a second closed form: right under double backward
        names = list(tensors)
        f = lambda *a: generated.forward(**dict(zip(names, a)))  # noqa: E731
        assert torch.autograd.gradgradcheck(f, tuple(tensors.values()))
        return
    assert_double_backward_raises(generated.forward, tensors)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_an_unused_input_gets_zeros_of_its_batched_shape_and_dtype(user_modules, backend, dtype, rng):
    arrays = user_inputs("unused", rng, dtype)
    generated = user_modules["unused", backend]
    if backend == "numpy":
        _, saved = generated.forward(**arrays)
        grads = generated.backward(saved, np.ones((2, 3, 2), dtype=dtype))
        dY = grads["Y"]
    else:
        leaves = as_tensors(arrays)
        generated.forward(**leaves).sum().backward()
        dY = leaves["Y"].grad.numpy()
    assert dY.shape == (2, 3, 2) and dY.dtype == dtype and not dY.any()


def test_a_summary_with_quotes_and_a_backslash_stays_in_the_docstrings(user_modules):
    summary = USER_SPECS["unused"].summary
    for backend in ("numpy", "torch"):
        generated = user_modules["unused", backend]
        assert summary in generated.__doc__ and generated.forward.__doc__.startswith(summary)


def test_matpow_prints_as_torch_in_the_torch_module(user_modules):
    source = Path(user_modules["matpow", "torch"].__file__).read_text()
    assert "torch.linalg.matrix_power" in source and "np." not in source


# --- degenerate sizes -----------------------------------------------------------------------------------------


def run(spec: str, backend: str, variant: str, arrays: dict, options: dict):
    """Output and gradients (for an all-ones cotangent) as NumPy arrays."""
    options = {**options, **({"block_size": 2} if variant else {})}
    generated = module(spec, backend, variant)
    if backend == "numpy":
        out, saved = generated.forward(**arrays, **options)
        return out, generated.backward(saved, np.ones_like(out))
    leaves = as_tensors(arrays)
    out = generated.forward(**leaves, **options)
    out.sum().backward()
    return out.detach().numpy(), {name: leaf.grad.numpy() for name, leaf in leaves.items()}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("spec", "variant"), MODULES, ids=IDS)
def test_no_query_rows_give_empty_outputs_and_zero_gradients(spec, variant, backend, rng):
    arrays, options = draw(spec, rng, n=0)
    out, grads = run(spec, backend, variant, arrays, options)
    assert out.shape[:2] == (2, 0) and out.dtype == np.float64
    assert set(grads) == set(arrays)
    for name, g in grads.items():
        assert g.shape == arrays[name].shape and g.dtype == np.float64 and not g.any(), name


ZERO_SIZES = [(spec, "m") for spec in ("attention", "mha")] + [(spec, "d") for spec in SPECS]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("variant", ["", "_memeff"])
@pytest.mark.parametrize(("spec", "size"), ZERO_SIZES, ids=[f"{s}-{z}=0" for s, z in ZERO_SIZES])
def test_no_keys_or_no_features_raise_a_value_error_naming_the_shapes(spec, size, variant, backend, rng):
    if variant and spec not in ROW_BLOCKS:
        pytest.skip("no memory-efficient variant")
    arrays, options = draw(spec, rng, **{size: 0})
    zero = {"m": "m = 0", "d": "d_model = 0" if spec == "self_attention" else "d_k = 0"}[size]
    with pytest.raises(ValueError, match=zero) as raised:
        run(spec, backend, variant, arrays, options)
    assert "(2, " in str(raised.value)  # the shapes the sizes were read off


# --- NumPy scalars --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("spec", "variant"), MODULES, ids=IDS)
def test_numpy_scalars_are_accepted_as_python_ones(spec, variant, backend, rng):
    arrays, options = draw(spec, rng)
    plain = {**options, "causal": True} if spec != "self_attention" else dict(options)
    if spec == "attention":
        plain["scale"] = 0.5
    scalars = {
        k: np.int64(v) if k == "num_heads" else np.True_ if k == "causal" else np.float32(v) for k, v in plain.items()
    }
    expected, expected_grads = run(spec, backend, variant, arrays, plain)
    out, grads = run(spec, backend, variant, arrays, scalars)
    assert np.array_equal(out, expected)
    assert all(np.array_equal(grads[name], expected_grads[name]) for name in grads)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_numpy_bools_are_not_head_counts_and_numbers_are_not_flags(backend, rng):
    arrays, options = draw("mha", rng)
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        run("mha", backend, "", arrays, {"num_heads": np.True_})
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        run("mha", backend, "", arrays, {"num_heads": np.int64(0)})
    with pytest.raises(ValueError, match="causal must be True or False"):
        run("mha", backend, "", arrays, {**options, "causal": 1})
