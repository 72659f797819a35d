"""Forward mode: every generated module's ``jvp`` (NumPy, torch, JAX) and the JAX ``forward_jvp`` entry point,
against forward-mode autodiff of independently written torch forwards (``torch.func.jvp``), float64 ≤ 1e-9.

The references are written here with torch's own operations (softmax, layer_norm, gelu, explicit heads), never
from symattn's expressions; the gallery's are ``test_gallery.REFERENCES``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch.func.jvp of an independent forward is the reference")
F = torch.nn.functional

sys.path.insert(0, str(Path(__file__).parent))
from test_gallery import NAMES, REFERENCES, gallery_spec, module  # noqa: E402

TOLERANCE = 1e-9
BACKENDS = ("numpy", "torch", "jax")


def _attention(Q, K, V, scale, mask=None):
    scores = scale * Q @ K.mT + (0 if mask is None else mask)
    return torch.softmax(scores, -1) @ V


def _heads(x, h):
    return x.unflatten(-1, (h, -1)).transpose(-3, -2)


def _mha(Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, heads, mask=None):
    q, k, v = _heads(Q @ W_Q + b_Q, heads), _heads(K @ W_K + b_K, heads), _heads(V @ W_V + b_V, heads)
    o = _attention(q, k, v, q.shape[-1] ** -0.5, mask)
    return o.transpose(-3, -2).flatten(-2) @ W_O + b_O


def _block(X, W_Q, W_K, W_V, W_O, gamma_1, beta_1, gamma_2, beta_2, W_1, W_2, heads, eps, mask):
    x1 = F.layer_norm(X, X.shape[-1:], eps=eps) * gamma_1 + beta_1
    zero = torch.zeros_like(gamma_1)
    y = _mha(x1, x1, x1, W_Q, W_K, W_V, W_O, zero, zero, zero, zero, heads, mask) + X
    x2 = F.layer_norm(y, y.shape[-1:], eps=eps) * gamma_2 + beta_2
    return F.gelu(x2 @ W_1) @ W_2 + y


def _causal(n):
    return torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)


def _builtin_cases():
    """(spec, module options, inputs, reference of the inputs) for the built-in families."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5

    B, n, m, d = 2, 5, 6, 4
    qkv = {"Q": r(B, n, d), "K": r(B, m, d), "V": r(B, m, 3)}
    float_mask = r(n, m)
    weights = {f"W_{c}": r(8, 8) for c in "QKVO"}
    biases = {f"b_{c}": r(1, 8) for c in "QKVO"}
    x8 = {"Q": r(B, n, 8), "K": r(B, n, 8), "V": r(B, n, 8)}
    block = {"X": r(B, n, 8), **{f"W_{c}": r(8, 8) for c in "QKVO"}}
    block |= {"gamma_1": 1 + r(1, 8), "beta_1": r(1, 8), "gamma_2": 1 + r(1, 8), "beta_2": r(1, 8)}
    block |= {"W_1": r(8, 12), "W_2": r(12, 8)}
    return [
        ("attention", {"scale": 0.7}, qkv, lambda Q, K, V: _attention(Q, K, V, 0.7)),
        ("attention", {"causal": True}, qkv | {"K": r(B, n, d), "V": r(B, n, 3)}, None),
        (
            "attention",
            {"attn_mask": float_mask},
            qkv,
            lambda Q, K, V: _attention(Q, K, V, d**-0.5, float_mask),
        ),
        (
            "mha",
            {"num_heads": 2},
            x8 | weights | biases,
            lambda Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O: _mha(
                Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, 2
            ),
        ),
        (
            "transformer_block",
            {"num_heads": 2, "eps": 1e-5, "causal": True},
            block,
            lambda *a: _block(*a, 2, 1e-5, _causal(n)),
        ),
    ]


CASES = _builtin_cases()
CASES[1] = (*CASES[1][:3], lambda Q, K, V: _attention(Q, K, V, 4**-0.5, _causal(5)))


def _numpy(value):
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}


def _generated_jvp(made, backend: str, inputs: dict, tangents: dict, options: dict):
    """(output, tangent) from a generated module's jvp, as float64 numpy arrays (optional inputs by keyword)."""
    if backend.startswith("numpy"):
        convert = np.asarray
    elif backend.startswith("torch"):
        convert = torch.as_tensor
    else:
        convert = pytest.importorskip("jax.numpy", reason="jax is an optional extra").asarray
    inputs, tangents, options = (
        {k: convert(v.numpy()) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
        for d in (inputs, tangents, options)
    )
    positional = [v for k, v in inputs.items() if k not in made.OPTIONAL]
    keywords = {k: v for k, v in inputs.items() if k in made.OPTIONAL}
    out, tangent = made.jvp(*positional, tangents, **options, **keywords)
    return np.asarray(out, dtype=np.float64), np.asarray(tangent, dtype=np.float64)


def _relative(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().numpy()
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))


def _tangents(inputs: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in inputs.items()}


@pytest.fixture(scope="module")
def jax_enabled():
    jax = pytest.importorskip("jax", reason="jax is an optional extra")
    jax.config.update("jax_enable_x64", True)
    return jax


MODULES = [*BACKENDS, "numpy_memeff", "torch_memeff"]


@pytest.mark.parametrize("backend", MODULES)
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{'-'.join(CASES[i][1])}")
def test_builtin_jvp_matches_torch_func_jvp(case, backend, request):
    name, options, inputs, reference = CASES[case]
    if backend == "jax":
        request.getfixturevalue("jax_enabled")
    if backend.endswith("memeff"):
        if name == "transformer_block":
            pytest.skip("the transformer block has no memory-efficient variant")
        options = options | {"block_size": 2}  # several blocks of query rows, the last one short
    made = importlib.import_module(f"symattn.generated.{name}_{backend}")
    tangents = _tangents(inputs, case)
    want_out, want_tangent = torch.func.jvp(reference, tuple(inputs.values()), tuple(tangents.values()))
    out, tangent = _generated_jvp(made, backend, inputs, tangents, options)
    assert _relative(out, want_out) <= TOLERANCE
    assert _relative(tangent, want_tangent) <= TOLERANCE


def test_a_missing_tangent_is_zero_and_a_wrong_one_is_named():
    from symattn.generated import attention_numpy

    _, options, inputs, _ = CASES[0]
    values = _numpy(inputs)
    only_v = {"V": np.ones_like(values["V"])}
    explicit = only_v | {"Q": np.zeros_like(values["Q"]), "K": np.zeros_like(values["K"])}
    np.testing.assert_array_equal(
        attention_numpy.jvp(*values.values(), only_v, **options)[1],
        attention_numpy.jvp(*values.values(), explicit, **options)[1],
    )
    with pytest.raises(ValueError, match="'X' is no input"):
        attention_numpy.jvp(*values.values(), {"X": values["Q"]})
    with pytest.raises(ValueError, match="Q_t"):
        attention_numpy.jvp(*values.values(), {"Q": values["Q"][..., :2]})
    with pytest.raises(TypeError, match="a dict"):
        attention_numpy.jvp(*values.values(), [values["Q"]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_gallery_jvp_matches_torch_func_jvp(name, backend, request):
    if backend == "jax":
        request.getfixturevalue("jax_enabled")
    shapes, reference = REFERENCES[name]
    rng = np.random.default_rng(1)
    inputs = {k: torch.tensor(rng.standard_normal(s) * 0.5 + (0.8 if len(s) == 0 else 0.0)) for k, s in shapes.items()}
    tangents = _tangents(inputs, 7)
    want_out, want_tangent = torch.func.jvp(reference, tuple(inputs.values()), tuple(tangents.values()))
    out, tangent = _generated_jvp(module(gallery_spec(name), backend), backend, inputs, tangents, {})
    assert _relative(out, want_out) <= TOLERANCE
    assert _relative(tangent, want_tangent) <= TOLERANCE


def test_jax_forward_jvp_under_jvp_jacfwd_grad_and_hessian(jax_enabled):
    jax, jnp = jax_enabled, jax_enabled.numpy
    from symattn.generated import attention_jax

    _, _, inputs, reference = CASES[1]  # causal
    Q, K, V = (jnp.asarray(v.numpy()) for v in inputs.values())
    tangents = _tangents(inputs, 3)
    want_out, want_tangent = torch.func.jvp(reference, tuple(inputs.values()), tuple(tangents.values()))
    out, tangent = jax.jvp(
        lambda q, k, v: attention_jax.forward_jvp(q, k, v, causal=True),
        (Q, K, V),
        tuple(jnp.asarray(t.numpy()) for t in tangents.values()),
    )
    assert _relative(np.asarray(out), want_out) <= TOLERANCE
    assert _relative(np.asarray(tangent), want_tangent) <= TOLERANCE

    def loss(f):
        return lambda q: jnp.sum(jnp.sin(f(q, K, V, causal=True)))

    # jacfwd, grad (the JVP transposed) and hessian agree with JAX differentiating the custom_vjp forward
    np.testing.assert_allclose(
        jax.jacfwd(loss(attention_jax.forward_jvp))(Q), jax.grad(loss(attention_jax.forward))(Q), atol=1e-12
    )
    np.testing.assert_allclose(
        jax.grad(loss(attention_jax.forward_jvp))(Q), jax.grad(loss(attention_jax.forward))(Q), atol=1e-12
    )
    small = Q[:1, :3]
    want = jax.hessian(lambda q: jnp.sum(jnp.sin(attention_jax.forward(q, K[:1, :3], V[:1, :3], causal=True))))(small)
    got = jax.hessian(lambda q: jnp.sum(jnp.sin(attention_jax.forward_jvp(q, K[:1, :3], V[:1, :3], causal=True))))(
        small
    )
    np.testing.assert_allclose(got, want, atol=1e-10)
