"""The generated JAX modules (<spec>_jax): a jax.custom_vjp whose backward is the generated closed form.

Each is checked against jax.grad of a forward written here directly in jax.numpy, for every built-in
spec (masks, biases, grouped-query heads, a float additive mask's gradient) and every gallery spec:
float64 (jax_enable_x64) to 1e-10 and float32 to 1e-5, relative to the reference's largest entry;
under jax.jit and jax.vmap; and a second derivative (jax.grad of jax.grad, a Hessian-vector product),
which JAX takes through the closed-form backward's own jax.numpy code, agrees with the reference's.
"""

from __future__ import annotations

import functools
import types
from pathlib import Path

import numpy as np
import pytest

from symattn.codegen import generate as codegen
from symattn.specs.files import load_spec_file

jax = pytest.importorskip("jax", reason="jax is an optional extra: pip install -e '.[jax]'")
jnp = jax.numpy
jax.config.update("jax_enable_x64", True)

from symattn.generated import attention_jax, mha_jax, self_attention_jax, transformer_block_jax  # noqa: E402

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"
B, N, M, D_MODEL, D_K, D_V, H = 2, 5, 6, 6, 4, 3, 2


def _relative(got, want) -> float:
    """Largest difference relative to the reference's largest entry, at least 1."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1.0))


# ---- the references: the same forwards written directly in jax.numpy ----


def ref_attention(Q, K, V, scale=None, M=None):
    """softmax(scale Q Kᵀ + M) V."""
    scale = Q.shape[-1] ** -0.5 if scale is None else scale
    scores = scale * Q @ jnp.swapaxes(K, -1, -2) + (0.0 if M is None else M)
    return jax.nn.softmax(scores, axis=-1) @ V


def _heads(x, heads):
    return jnp.moveaxis(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


def _bias(b):
    return 0.0 if b is None else b


def ref_mha(Q, K, V, W_Q, W_K, W_V, W_O, num_heads, num_kv_heads=None, b_Q=None, b_K=None, b_V=None, b_O=None, M=None):
    """Concat_h attention(Q W_Q + b_Q, …)_h W_O + b_O; kv head h // (H / H_kv) serves query head h."""
    kv = num_kv_heads or num_heads
    q = _heads(Q @ W_Q + _bias(b_Q), num_heads)
    k = jnp.repeat(_heads(K @ W_K + _bias(b_K), kv), num_heads // kv, axis=-3)
    v = jnp.repeat(_heads(V @ W_V + _bias(b_V), kv), num_heads // kv, axis=-3)
    if M is not None and M.ndim > 2:
        M = M[..., None, :, :]  # one mask for every head
    o = jnp.moveaxis(ref_attention(q, k, v, M=M), -3, -2)
    return o.reshape(*o.shape[:-2], -1) @ W_O + _bias(b_O)


def _layer_norm(x, gamma, beta, eps):
    c = x - x.mean(axis=-1, keepdims=True)
    return c / jnp.sqrt((c * c).mean(axis=-1, keepdims=True) + eps) * gamma + beta


def ref_block(X, W_Q, W_K, W_V, W_O, gamma_1, beta_1, gamma_2, beta_2, W_1, W_2, num_heads, eps=1e-5, **biases):
    """Pre-LN encoder layer: Y = X + MHA(LN₁(X)), Z = Y + GELU(LN₂(Y) W_1 + b_1) W_2 + b_2."""
    M = biases.pop("M", None)
    b_1, b_2 = biases.pop("b_1", None), biases.pop("b_2", None)
    x1 = _layer_norm(X, gamma_1, beta_1, eps)
    Y = X + ref_mha(x1, x1, x1, W_Q, W_K, W_V, W_O, num_heads, M=M, **biases)
    u = _layer_norm(Y, gamma_2, beta_2, eps) @ W_1 + _bias(b_1)
    return Y + jax.nn.gelu(u, approximate=False) @ W_2 + _bias(b_2)


def _from_bool(mask):
    return jnp.where(mask, -jnp.inf, 0.0)


def _inputs(shapes: dict, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    scaled = {
        k: rng.standard_normal(s) * (1.0 if k in ("X", "Q", "K", "V") or k.startswith(("gamma", "beta")) else 0.5)
        for k, s in shapes.items()
    }
    return {k: v.astype(dtype) for k, v in scaled.items()}


def _compare(generated, reference, inputs: dict, dtype: str, seed: int = 1) -> dict:
    """Output and every gradient (jax.vjp, one random cotangent) of generated against reference, the reference
    run in float64; the largest relative errors by name."""
    names = list(inputs)
    want_out, want_vjp = jax.vjp(reference, *(jnp.asarray(v, dtype=jnp.float64) for v in inputs.values()))
    g = np.random.default_rng(seed).standard_normal(want_out.shape)
    want = want_vjp(jnp.asarray(g))
    out, vjp = jax.vjp(generated, *(jnp.asarray(v) for v in inputs.values()))
    got = vjp(jnp.asarray(g, dtype=dtype))
    assert out.dtype == np.dtype(dtype) and all(x.dtype == np.dtype(dtype) for x in got)
    assert all(x.shape == inputs[k].shape for k, x in zip(names, got))
    return {"output": _relative(out, want_out)} | {k: _relative(a, b) for k, a, b in zip(names, got, want)}


MHA_SHAPES = {"Q": (B, N, D_MODEL), "K": (B, M, D_MODEL), "V": (B, M, D_MODEL)} | {
    w: (D_MODEL, D_MODEL) for w in ("W_Q", "W_K", "W_V", "W_O")
}
BLOCK_SHAPES = (
    {"X": (B, N, D_MODEL)}
    | {w: (D_MODEL, D_MODEL) for w in ("W_Q", "W_K", "W_V", "W_O")}
    | {"gamma_1": (1, D_MODEL), "beta_1": (1, D_MODEL), "gamma_2": (1, D_MODEL), "beta_2": (1, D_MODEL)}
    | {"W_1": (D_MODEL, 7), "W_2": (7, D_MODEL)}
)
BIASES = {"b_Q": (1, D_MODEL), "b_K": (1, D_MODEL), "b_V": (1, D_MODEL), "b_O": (1, D_MODEL)}
BOOL_MASK = np.random.default_rng(7).random((N, M)) < 0.3
BOOL_MASK[:, 0] = False  # every query sees a key: the reference's softmax has no row of -inf
PADDING = np.zeros((B, M), dtype=bool)
PADDING[1, -2:] = True
SELF_PADDING = PADDING[:, :N]  # the block's keys are its N tokens


def _builtin_cases():
    """name -> (generated, reference, input shapes), each a function of the inputs in table order."""
    kv = {"W_K": (D_MODEL, D_MODEL // H), "W_V": (D_MODEL, D_MODEL // H)}  # one kv head serving both
    causal = np.triu(np.ones((N, M), dtype=bool), 1)
    padding = jnp.asarray(PADDING)[:, None, :]
    return {
        "attention": (
            lambda Q, K, V: attention_jax.forward(Q, K, V),
            ref_attention,
            {"Q": (B, N, D_K), "K": (B, M, D_K), "V": (B, M, D_V)},
        ),
        "attention_scale_masks": (
            lambda Q, K, V: attention_jax.forward(
                Q, K, V, scale=0.3, attn_mask=jnp.asarray(BOOL_MASK), key_padding_mask=jnp.asarray(PADDING)
            ),
            lambda Q, K, V: ref_attention(Q, K, V, 0.3, _from_bool(BOOL_MASK) + _from_bool(padding)),
            {"Q": (B, N, D_K), "K": (B, M, D_K), "V": (B, M, D_V)},
        ),
        "self_attention": (
            self_attention_jax.forward,
            lambda X, W_Q, W_K, W_V: ref_attention(X @ W_Q, X @ W_K, X @ W_V),
            {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)},
        ),
        "mha": (
            functools.partial(mha_jax.forward, num_heads=H),
            functools.partial(ref_mha, num_heads=H),
            MHA_SHAPES,
        ),
        "mha_gqa_biases_causal": (
            lambda Q, K, V, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O: mha_jax.forward(
                Q,
                K,
                V,
                W_Q,
                W_K,
                W_V,
                W_O,
                num_heads=H,
                num_kv_heads=1,
                causal=True,
                b_Q=b_Q,
                b_K=b_K,
                b_V=b_V,
                b_O=b_O,
            ),
            lambda *a: ref_mha(*a[:7], H, 1, *a[7:], M=_from_bool(causal)),
            MHA_SHAPES | kv | BIASES | {"b_K": (1, D_MODEL // H), "b_V": (1, D_MODEL // H)},
        ),
        "transformer_block": (
            functools.partial(transformer_block_jax.forward, num_heads=H),
            functools.partial(ref_block, num_heads=H),
            BLOCK_SHAPES,
        ),
        "transformer_block_biases_padding": (
            lambda *a: transformer_block_jax.forward(
                *a[:11],
                num_heads=H,
                eps=1e-3,
                key_padding_mask=jnp.asarray(SELF_PADDING),
                **dict(zip(("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2"), a[11:])),
            ),
            lambda *a: ref_block(
                *a[:11],
                num_heads=H,
                eps=1e-3,
                M=_from_bool(jnp.asarray(SELF_PADDING)[:, None, :]),
                **dict(zip(("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2"), a[11:])),
            ),
            BLOCK_SHAPES | BIASES | {"b_1": (1, 7), "b_2": (1, D_MODEL)},
        ),
    }


BUILTIN = _builtin_cases()


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", sorted(BUILTIN))
def test_builtin_module_matches_jax_grad_of_a_jnp_forward(case, dtype):
    generated, reference, shapes = BUILTIN[case]
    errors = _compare(generated, reference, _inputs(shapes, dtype), dtype)
    assert max(errors.values()) <= TOLERANCE[dtype], errors


@pytest.mark.parametrize("case", ["attention", "mha_gqa_biases_causal", "transformer_block"])
def test_builtin_module_under_jit_and_vmap(case):
    """jit of the gradient, and vmap over a new leading axis of the inputs (the weights' gradients summed)."""
    generated, reference, shapes = BUILTIN[case]
    inputs = [jnp.asarray(v) for v in _inputs(shapes, "float64").values()]
    g = jnp.asarray(np.random.default_rng(2).standard_normal(reference(*inputs).shape))

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * g)

    argnums = tuple(range(len(inputs)))
    want = jax.grad(loss(reference), argnums)(*inputs)
    got = jax.jit(jax.grad(loss(generated), argnums))(*inputs)
    assert max(_relative(a, b) for a, b in zip(got, want)) <= 1e-10
    # vmap over the leading axis of the token inputs (Q, K, V or X), the weights shared
    tokens = 1 if case == "transformer_block" else 3
    axes = (0,) * tokens + (None,) * (len(inputs) - tokens)
    mapped = jax.jit(jax.vmap(generated, in_axes=axes))(*inputs)
    np.testing.assert_allclose(mapped, reference(*inputs), rtol=0, atol=1e-12)
    vjp_got = jax.vjp(jax.vmap(generated, in_axes=axes), *inputs)[1](g)
    vjp_want = jax.vjp(reference, *inputs)[1](g)
    assert max(_relative(a, b) for a, b in zip(vjp_got, vjp_want)) <= 1e-10


@pytest.mark.parametrize("shape", [(N, M), (B, N, M)])
def test_a_float_attn_mask_receives_its_gradient(shape):
    """∂f/∂attn_mask = ∂f/∂A summed over the axes the mask was broadcast along (batch, heads)."""
    inputs = {k: jnp.asarray(v) for k, v in _inputs(MHA_SHAPES, "float64").items()}
    bias = jnp.asarray(np.random.default_rng(3).standard_normal(shape))
    g = jnp.asarray(np.random.default_rng(4).standard_normal((B, N, D_MODEL)))

    def generated(mask, *a):
        return jnp.sum(mha_jax.forward(*a, num_heads=H, attn_mask=mask, causal=True) * g)

    def reference(mask, *a):
        return jnp.sum(ref_mha(*a, H, M=mask + _from_bool(np.triu(np.ones((N, M), dtype=bool), 1))) * g)

    argnums = tuple(range(8))
    got = jax.jit(jax.grad(generated, argnums))(bias, *inputs.values())
    want = jax.grad(reference, argnums)(bias, *inputs.values())
    assert got[0].shape == shape
    assert max(_relative(a, b) for a, b in zip(got, want)) <= 1e-10
    # attention's mask has no heads axis
    q, k, v = (jnp.asarray(x) for x in _inputs({"Q": (B, N, 4), "K": (B, M, 4), "V": (B, M, 3)}, "float64").values())
    got = jax.grad(lambda m: jnp.sum(attention_jax.forward(q, k, v, attn_mask=m)[..., 0]))(bias)
    want = jax.grad(lambda m: jnp.sum(ref_attention(q, k, v, M=m)[..., 0]))(bias)
    assert _relative(got, want) <= 1e-10


def test_a_row_whose_keys_are_all_masked_gives_zeros_not_nan():
    q, k, v = (jnp.asarray(x) for x in _inputs({"Q": (N, 4), "K": (M, 4), "V": (M, 3)}, "float64").values())
    mask = np.zeros((N, M), dtype=bool)
    mask[1] = True
    out = attention_jax.forward(q, k, v, attn_mask=jnp.asarray(mask))
    grads = jax.grad(lambda *a: jnp.sum(attention_jax.forward(*a, attn_mask=jnp.asarray(mask)) ** 2), (0, 1, 2))(
        q, k, v
    )
    assert not np.asarray(out[1]).any() and np.isfinite(np.asarray(out)).all()
    assert all(np.isfinite(np.asarray(x)).all() for x in grads) and not np.asarray(grads[0][1]).any()


@pytest.mark.slow  # three second-order traces per case
@pytest.mark.parametrize("case", ["mha_gqa_biases_causal", "transformer_block", "attention_scale_masks"])
def test_second_derivatives_through_the_closed_form_are_exact(case):
    """jax.grad of jax.grad and a Hessian-vector product (jvp of grad) agree with the reference's: JAX
    differentiates the custom_vjp's forward and backward rules, both plain jax.numpy."""
    generated, reference, shapes = BUILTIN[case]
    inputs = [jnp.asarray(v) for v in _inputs(shapes, "float64").values()]
    g = jnp.asarray(np.random.default_rng(5).standard_normal(reference(*inputs).shape))
    direction = jnp.asarray(np.random.default_rng(6).standard_normal(inputs[1].shape))

    def first(f):  # ∂/∂(the second input) of <g, f>
        return jax.grad(lambda w: jnp.sum(f(inputs[0], w, *inputs[2:]) * g))

    def penalty(f):  # a gradient penalty: ‖∂/∂x <g, f>‖², differentiated again
        return lambda w: jnp.sum(first(f)(w) ** 2)

    got = jax.grad(penalty(generated))(inputs[1])
    want = jax.grad(penalty(reference))(inputs[1])
    assert _relative(got, want) <= 1e-9
    hvp_got = jax.jvp(first(generated), (inputs[1],), (direction,))[1]
    hvp_want = jax.jvp(first(reference), (inputs[1],), (direction,))[1]
    assert _relative(hvp_got, hvp_want) <= 1e-9


def test_options_are_static_under_jit_and_bad_inputs_are_named():
    inputs = [jnp.asarray(v) for v in _inputs(MHA_SHAPES, "float64").values()]
    for heads in (1, 2, 3):  # one jitted function per number of heads, each matching the reference
        got = jax.jit(functools.partial(mha_jax.forward, num_heads=heads))(*inputs)
        np.testing.assert_allclose(got, ref_mha(*inputs, heads), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        mha_jax.forward(*inputs, num_heads=0)
    with pytest.raises(ValueError, match="multiple of 4"):
        mha_jax.forward(*inputs, num_heads=4)
    with pytest.raises(ValueError, match=r"W_O: expected shape"):
        mha_jax.forward(*inputs[:6], inputs[6][:, :4], num_heads=2)
    with pytest.raises(ValueError, match="mixed dtypes"):
        mha_jax.forward(*inputs[:6], inputs[6].astype(jnp.float32), num_heads=2)
    with pytest.raises(ValueError, match="attn_mask: expected shape"):
        mha_jax.forward(*inputs, num_heads=2, attn_mask=jnp.zeros((N, N), dtype=bool))
    with pytest.raises(ValueError, match="causal must be True or False"):
        mha_jax.forward(*inputs, num_heads=2, causal=1)


# ---- the gallery (examples/specs), each spec rendered into a JAX module ----


def _unit_rows(m):
    return m / jnp.sqrt((m * m).sum(-1, keepdims=True))


def _qkv(X, W_Q, W_K, W_V):
    return X @ W_Q, X @ W_K, X @ W_V


def _gallery_attention(q, k, v, scores=lambda s, d: s / d**0.5, weights=lambda a: jax.nn.softmax(a, axis=-1)):
    return weights(scores(q @ jnp.swapaxes(k, -1, -2), q.shape[-1])) @ v


STANDARD = {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K), "W_V": (D_MODEL, D_V)}
GALLERY_REFERENCES = {
    "sigmoid_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: _gallery_attention(*_qkv(X, W_Q, W_K, W_V), weights=jax.nn.sigmoid),
    ),
    "bias_attention": (
        STANDARD | {"B": (B, N, N)},
        lambda X, W_Q, W_K, W_V, B: _gallery_attention(*_qkv(X, W_Q, W_K, W_V), scores=lambda s, d: s / d**0.5 + B),
    ),
    "softcap_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: _gallery_attention(
            *_qkv(X, W_Q, W_K, W_V), scores=lambda s, d: 50 * jnp.tanh(s / d**0.5 / 50)
        ),
    ),
    "gated_attention": (
        STANDARD | {"W_G": (D_MODEL, D_V)},
        lambda X, W_Q, W_K, W_V, W_G: _gallery_attention(*_qkv(X, W_Q, W_K, W_V)) * jax.nn.sigmoid(X @ W_G),
    ),
    "differential_attention": (
        {"X": (B, N, D_MODEL), "W_Q1": (D_MODEL, D_K), "W_K1": (D_MODEL, D_K), "W_Q2": (D_MODEL, D_K)}
        | {"W_K2": (D_MODEL, D_K), "W_V": (D_MODEL, D_V), "lam": ()},
        lambda X, W_Q1, W_K1, W_Q2, W_K2, W_V, lam: (
            _gallery_attention(X @ W_Q1, X @ W_K1, X @ W_V) - lam * _gallery_attention(X @ W_Q2, X @ W_K2, X @ W_V)
        ),
    ),
    "temperature_attention": (
        STANDARD | {"tau": ()},
        lambda X, W_Q, W_K, W_V, tau: _gallery_attention(*_qkv(X, W_Q, W_K, W_V), scores=lambda s, d: tau * s),
    ),
    "linear_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: (
            jax.nn.sigmoid(X @ W_Q)
            @ (jnp.swapaxes(jax.nn.sigmoid(X @ W_K), -1, -2) @ (X @ W_V))
            / (jax.nn.sigmoid(X @ W_Q) @ jnp.swapaxes(jax.nn.sigmoid(X @ W_K).sum(-2, keepdims=True), -1, -2))
        ),
    ),
    "cosine_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: (
            jax.nn.softmax(10 * _unit_rows(X @ W_Q) @ jnp.swapaxes(_unit_rows(X @ W_K), -1, -2), axis=-1) @ (X @ W_V)
        ),
    ),
    "qk_norm_attention": (
        STANDARD | {"gamma_Q": (1, D_K), "beta_Q": (1, D_K), "gamma_K": (1, D_K), "beta_K": (1, D_K)},
        lambda X, W_Q, W_K, W_V, gamma_Q, beta_Q, gamma_K, beta_K: _gallery_attention(
            _layer_norm(X @ W_Q, gamma_Q, beta_Q, 1e-5), _layer_norm(X @ W_K, gamma_K, beta_K, 1e-5), X @ W_V
        ),
    ),
    "relu_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: _gallery_attention(
            *_qkv(X, W_Q, W_K, W_V), weights=lambda a: jax.nn.relu(a) / a.shape[-2]
        ),
    ),
    "softplus_attention": (
        STANDARD,
        lambda X, W_Q, W_K, W_V: _gallery_attention(
            *_qkv(X, W_Q, W_K, W_V), weights=lambda a: jax.nn.softplus(a) / jax.nn.softplus(a).sum(-1, keepdims=True)
        ),
    ),
    "pointer_attention": (
        {"X": (B, N, D_MODEL), "W_Q": (D_MODEL, D_K), "W_K": (D_MODEL, D_K)},
        lambda X, W_Q, W_K: jax.nn.log_softmax((X @ W_Q) @ jnp.swapaxes(X @ W_K, -1, -2) / D_K**0.5, axis=-1),
    ),
}
GALLERY_NAMES = sorted(GALLERY_REFERENCES)


def test_every_gallery_spec_has_a_jax_reference():
    assert sorted(p.stem for p in GALLERY.glob("*.py")) == GALLERY_NAMES


@functools.cache
def gallery_module(name: str) -> types.ModuleType:
    """The gallery spec's JAX module, rendered as `symattn generate --spec-file F --backend jax` writes it."""
    made = types.ModuleType(f"{name}_jax")
    source = codegen.render(load_spec_file(GALLERY / f"{name}.py"), "jax")
    exec(compile(source, made.__name__, "exec"), made.__dict__)
    return made


@pytest.mark.slow  # a render and three traces (plain, jit, vmap) per spec and dtype
@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("name", GALLERY_NAMES)
def test_gallery_jax_module_matches_jax_grad_under_jit_and_vmap(name, dtype):
    shapes, reference = GALLERY_REFERENCES[name]
    generated = gallery_module(name).forward
    inputs = _inputs(shapes, dtype)
    errors = _compare(generated, reference, inputs, dtype)
    errors |= {f"jit {k}": v for k, v in _compare(jax.jit(generated), reference, inputs, dtype).items()}
    batched = tuple(0 if len(s) == 3 else None for s in shapes.values())  # X (and B) mapped, weights shared
    errors |= {f"vmap {k}": v for k, v in _compare(jax.vmap(generated, batched), reference, inputs, dtype).items()}
    assert max(errors.values()) <= TOLERANCE[dtype], errors
