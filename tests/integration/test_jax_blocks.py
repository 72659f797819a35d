"""The JAX modules skip the keys a causal mask hides (issue 27, masked blocks), as the NumPy and torch ones do.

With ``causal=True`` a generated JAX module goes through blocks of query rows (``rows_per_block``: 128, larger
past 16 blocks) and each block reads only the keys 0 … its last row (``key_range``, from causal alone: static
under jax.jit), its causal part written into its scores (``causal_fill``); another mask (attn_mask,
key_padding_mask) is added to each block's scores. Checked in float64 against a forward written here in
jax.numpy that takes the mask whole: the output, jax.grad through the custom_vjp's closed-form backward (a float
attn_mask's gradient too) and jax.jvp through forward_jvp's closed-form JVP, eagerly and under jax.jit, with
several blocks, n ≠ m and rows whose keys are all masked; the gallery's specs with ``sa.with_mask`` against
torch autograd of their independent forwards; and the traced products, which make only the blocks' scores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import symattn as sa

jax = pytest.importorskip("jax", reason="jax is an optional extra: pip install -e '.[jax]'")
jnp = jax.numpy
jax.config.update("jax_enable_x64", True)

from symattn.generated import attention_jax, mha_jax  # noqa: E402

TOLERANCE = 1e-9
B, D_K, D_V = 2, 5, 3


def _reference(Q, K, V, M, scale):
    """softmax(scale Q Kᵀ + M) V with M whole; a row whose keys are all -inf gives zeros (no NaN to differentiate)."""
    scores = scale * Q @ jnp.swapaxes(K, -1, -2) + M
    top = jax.lax.stop_gradient(scores.max(axis=-1, keepdims=True))
    e = jnp.exp(scores - jnp.where(jnp.isneginf(top), 0.0, top))
    total = e.sum(axis=-1, keepdims=True)
    return e / jnp.where(total == 0, 1.0, total) @ V


def _causal(n: int, m: int) -> np.ndarray:
    """-inf where key j comes after query i (j > i), else 0."""
    return np.where(np.triu(np.ones((n, m), dtype=bool), 1), -np.inf, 0.0)


def _case(name: str, seed: int = 0):
    """Inputs, the module's mask keywords, the whole additive mask M the reference adds, and the float attn_mask
    that receives a gradient (None: none)."""
    n, m = {"causal": (300, 300), "rows-past-keys": (300, 200), "keys-past-rows": (200, 330)}.get(name, (300, 260))
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, r, d)) for r, d in ((n, D_K), (m, D_K), (m, D_V)))
    whole = _causal(n, m)
    keywords: dict = {"causal": True}
    if name == "padding":  # entry 0: keys 0 and 1 hidden, so rows 0 and 1 see no key; entry 1: its last 100
        padding = np.zeros((B, m), dtype=bool)
        padding[0, :2], padding[1, -100:] = True, True
        keywords["key_padding_mask"] = padding
        whole = whole + np.where(padding, -np.inf, 0.0)[:, None, :]
    elif name == "window":  # a boolean attn_mask: query i sees keys i − 40 … i (with causal)
        window = np.arange(n)[:, None] - np.arange(m)[None, :] > 40
        keywords["attn_mask"] = window
        whole = whole + np.where(window, -np.inf, 0.0)
    elif name == "float-mask":  # a float attn_mask (n × m, batched): added, and differentiated
        keywords["attn_mask"] = rng.standard_normal((B, n, m))
    return (q, k, v), keywords, whole, keywords.get("attn_mask") if name == "float-mask" else None


CASES = ["causal", "rows-past-keys", "keys-past-rows", "padding", "window", "float-mask"]


@pytest.mark.parametrize(
    ("case", "jit"),
    [(case, True) for case in CASES] + [("causal", False), ("padding", False)],  # eager: seconds a case, two enough
    ids=lambda value: {True: "jit", False: "eager"}.get(value, value) if isinstance(value, bool) else value,
)
def test_causal_blocks_match_the_whole_mask(case, jit):
    (q, k, v), keywords, whole, float_mask = _case(case)
    scale = D_K**-0.5
    g = np.random.default_rng(1).standard_normal((B, q.shape[1], D_V))
    differentiated = (q, k, v) if float_mask is None else (q, k, v, float_mask)

    def generated(q, k, v, *mask):
        options = keywords | ({"attn_mask": mask[0]} if mask else {})
        return attention_jax.forward(q, k, v, **options)

    def reference(q, k, v, *mask):
        return _reference(q, k, v, whole + (mask[0] if mask else 0.0), scale)

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * g)

    wrap = jax.jit if jit else (lambda f: f)
    argnums = tuple(range(len(differentiated)))
    out, want = wrap(generated)(*differentiated), reference(*differentiated)
    assert float(jnp.max(jnp.abs(out - want))) <= TOLERANCE
    grads = wrap(jax.grad(loss(generated), argnums))(*differentiated)
    want_grads = jax.grad(loss(reference), argnums)(*differentiated)
    for name, got, w in zip("QKVM", grads, want_grads):
        assert float(jnp.max(jnp.abs(got - w))) <= TOLERANCE, name
    # the forward mode: forward_jvp's custom_jvp rule is the generated JVP, which goes through the blocks too
    tangents = tuple(np.random.default_rng(2).standard_normal(x.shape) for x in (q, k, v))
    primal = (q, k, v)
    got = wrap(lambda p, t: jax.jvp(lambda *a: attention_jax.forward_jvp(*a, **keywords), p, t))(primal, tangents)
    want = jax.jvp(lambda *a: reference(*a, *([float_mask] if float_mask is not None else [])), primal, tangents)
    for a, b in zip(got, want):
        assert float(jnp.max(jnp.abs(a - b))) <= TOLERANCE


def test_mha_causal_blocks_under_jit_and_vmap():
    """MultiHeadAttention (2 heads, grouped kv heads), causal over 300 rows: three blocks of each head's rows."""
    rng = np.random.default_rng(3)
    n, d_model, heads = 300, 8, 2
    X = rng.standard_normal((B, n, d_model))
    weights = [rng.standard_normal((d_model, d_model)) * 0.5 for _ in range(4)]
    g = rng.standard_normal((B, n, d_model))
    causal = jnp.asarray(_causal(n, n))

    def reference(X, W_Q, W_K, W_V, W_O):
        def heads_of(x):
            return jnp.moveaxis(x.reshape(*x.shape[:-1], heads, -1), -2, -3)

        o = _reference(heads_of(X @ W_Q), heads_of(X @ W_K), heads_of(X @ W_V), causal, (d_model // heads) ** -0.5)
        return jnp.moveaxis(o, -3, -2).reshape(*X.shape[:-1], d_model) @ W_O

    def generated(X, W_Q, W_K, W_V, W_O):
        return mha_jax.forward(X, X, X, W_Q, W_K, W_V, W_O, num_heads=heads, causal=True)

    args = (X, *weights)
    argnums = tuple(range(5))
    got_grads = jax.jit(jax.grad(lambda *a: jnp.sum(generated(*a) * g), argnums))(*args)
    want_grads = jax.grad(lambda *a: jnp.sum(reference(*a) * g), argnums)(*args)
    assert float(jnp.max(jnp.abs(jax.jit(generated)(*args) - reference(*args)))) <= TOLERANCE
    for got, want in zip(got_grads, want_grads):
        assert float(jnp.max(jnp.abs(got - want))) <= TOLERANCE
    batched = jax.vmap(generated, (0, None, None, None, None))(*args)
    assert float(jnp.max(jnp.abs(batched - reference(*args)))) <= TOLERANCE


# ---- the blocks skip: the traced products make only the scores of the keys each block's rows may see ----


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (jit, custom_vjp, custom_jvp calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def _score_entries(function, *args, features=(D_K, D_V)) -> tuple[int, int]:
    """(entries of the products whose result has a key axis — scores Q_b K_kᵀ, dP_b = dO_b V_kᵀ —, the largest
    one's): every product's result but the ones whose last axis is a feature dimension."""
    jaxpr = jax.make_jaxpr(function)(*args).jaxpr
    sizes = [
        int(np.prod(eqn.outvars[0].aval.shape))
        for eqn in _equations(jaxpr)
        if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape[-1] not in features
    ]
    return sum(sizes), max(sizes)


@pytest.mark.parametrize("causal", [True, False])
def test_a_causal_module_makes_only_the_blocks_scores(causal):
    # n = m = 512 in blocks of 128: the blocks read 128, 256, 384, 512 keys, 5/8 of the scores, twice (the
    # forward's A_b, the backward's dP_b), never one n × m product; without causal one block of every key
    n = 512
    q, k, v, g = (jnp.ones((1, n, d)) for d in (D_K, D_K, D_V, D_V))

    def step(q, k, v, g):
        out, pull = jax.vjp(lambda *a: attention_jax.forward(*a, causal=causal), q, k, v)
        return out, pull(g)

    total, largest = _score_entries(step, q, k, v, g)
    if causal:
        assert total == 2 * 128 * (128 + 256 + 384 + 512) and largest == 128 * n
    else:
        assert total == 2 * n * n and largest == n * n
    # the forward mode: O_b and its tangent from the block's scores Q_b K_kᵀ and [Q_b | Q̇_b] [K̇_k | K_k]ᵀ
    total, largest = _score_entries(
        lambda p, t: jax.jvp(lambda *a: attention_jax.forward_jvp(*a, causal=causal), p, t), (q, k, v), (q, k, v)
    )
    assert (total, largest) == ((2 * 128 * 1280, 128 * n) if causal else (2 * n * n, n * n))


def test_rows_per_block_keeps_the_unrolled_loop_short():
    # jax.jit unrolls the loop: 128 rows up to 8 blocks, then 256, at most 16 blocks; one block without causal
    rows = (5, 300, 1024, 1025, 2048, 4096, 4097, 8192)
    sizes = {n: attention_jax.rows_per_block(None, True, jnp.zeros((n, 1))) for n in rows}
    assert sizes == {5: 128, 300: 128, 1024: 128, 1025: 256, 2048: 256, 4096: 256, 4097: 512, 8192: 512}
    assert attention_jax.rows_per_block(None, False, jnp.zeros((300, 1))) == 300
    assert attention_jax.key_range(jnp.zeros((300, 300)), False, slice(0, 128), 300) == slice(0, 300)


# ---- the gallery with a mask (sa.with_mask): the same loops, any spec with a softmax ----

sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.parametrize(
    "name, blocked",
    [("softcap_attention", True), ("temperature_attention", True), ("qk_norm_attention", True)]
    + [("differential_attention", False)],  # two softmaxes: no loop (rowblocks needs one), as in NumPy and torch
)
def test_masked_gallery_jax_module_skips_and_matches_autograd(name, blocked):
    torch = pytest.importorskip("torch", reason="torch autograd of the gallery's forward is the reference")
    from masked_reference import MaskedSoftmax
    from test_gallery import REFERENCES, gallery_spec, module
    from test_masked_gallery import _error, _mask, _values

    made = module(sa.with_mask(gallery_spec(name)), "jax")
    values = _values(name)  # 300 query rows: three blocks
    padding, additive = _mask(2)
    leaves = {key: torch.tensor(x, requires_grad=True) for key, x in values.items()}
    with MaskedSoftmax(additive):
        want = REFERENCES[name][1](**leaves)
    g = np.random.default_rng(1).standard_normal(tuple(want.shape))
    want_grads = torch.autograd.grad(want, list(leaves.values()), torch.tensor(g))

    def generated(*xs):
        return made.forward(*xs, causal=True, key_padding_mask=padding)

    inputs = [jnp.asarray(x) for x in values.values()]
    out, pull = jax.vjp(jax.jit(generated), *inputs)
    assert _error(np.asarray(out), want.detach().numpy()) <= 1e-10
    for key, got, w in zip(values, pull(jnp.asarray(g)), want_grads):
        assert _error(np.asarray(got), w.numpy()) <= 1e-10, key
    # the blocks skip: no product makes the scores of all 300 rows and keys; the first block's 128 × 128
    jaxpr = jax.make_jaxpr(lambda *xs: jax.vjp(generated, *xs)[1](jnp.asarray(g)))(*inputs).jaxpr
    products = [eqn.outvars[0].aval.shape[-2:] for eqn in _equations(jaxpr) if eqn.primitive.name == "dot_general"]
    assert ((300, 300) not in products and (128, 128) in products) == blocked
