"""The gallery with a mask (``sa.with_mask``): softmax(A) → softmax(A + M) in every spec that has a softmax. Each
generated module (NumPy, torch; float64) with causal and key padding, over enough query rows for several blocks
(the blocks skip the keys the mask hides), matches torch autograd of the gallery's independent torch forward run
with the same mask added to each of its softmaxes' scores."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import symattn as sa
from symattn.errors import SymattnError

torch = pytest.importorskip("torch", reason="torch autograd is the reference")
sys.path.insert(0, str(Path(__file__).parent))
from masked_reference import MaskedSoftmax, maskable  # noqa: E402
from test_gallery import NAMES, REFERENCES, N, gallery_spec, module  # noqa: E402

ROWS = 300  # three blocks of query rows (128, 128, 44)


MASKED = [name for name in NAMES if maskable(gallery_spec(name))]


def _values(name: str, seed: int = 0) -> dict:
    shapes, _ = REFERENCES[name]
    rng = np.random.default_rng(seed)
    values = {}
    for k, s in shapes.items():
        shape = tuple(ROWS if size == N else size for size in s)
        scale = 1.0 if k == "X" or k.startswith(("gamma", "beta")) else 0.5
        values[k] = np.asarray(rng.standard_normal(shape) * scale + (0.8 if not shape else 0.0))
    return values


def _mask(batch: int) -> tuple[np.ndarray, torch.Tensor]:
    """Key padding (entry 0: keys 3 … 9; entry 1: its last 150) and the additive mask with causal (every row sees
    a key: the reference's softmax of a row of −inf is NaN, the generated modules' zeros)."""
    padding = np.zeros((batch, ROWS), dtype=bool)
    padding[0, 3:10] = True
    padding[1, -150:] = True
    hidden = np.triu(np.ones((ROWS, ROWS), dtype=bool), 1) | padding[:, None, :]
    return padding, torch.tensor(np.where(hidden, -np.inf, 0.0))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", MASKED)
def test_masked_gallery_matches_autograd_with_the_mask(name, backend):
    spec = sa.with_mask(gallery_spec(name))
    values = _values(name)
    padding, additive = _mask(2)
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in values.items()}
    with MaskedSoftmax(additive):
        want = REFERENCES[name][1](**leaves)
    g = np.random.default_rng(1).standard_normal(tuple(want.shape))
    want_grads = torch.autograd.grad(want, list(leaves.values()), torch.tensor(g))
    made = module(spec, backend)
    if backend == "numpy":
        out, saved = made.forward(*values.values(), causal=True, key_padding_mask=padding)
        grads = made.backward(saved, g)
    else:
        inputs = [torch.tensor(v, requires_grad=True) for v in values.values()]
        out = made.forward(*inputs, causal=True, key_padding_mask=torch.tensor(padding))
        grads = dict(zip(values, torch.autograd.grad(out, inputs, torch.tensor(g))))
        out = out.detach()
    assert _error(np.asarray(out), want.detach().numpy()) <= 1e-10
    for k, w in zip(values, want_grads):
        assert _error(np.asarray(grads[k]), w.numpy()) <= 1e-10, k


def _error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the largest finite entry (log-probabilities of hidden keys: −inf in both)."""
    same = got == want
    finite = np.abs(want[np.isfinite(want)])
    return float(np.max(np.where(same, 0.0, np.abs(got - want)), initial=0.0) / max(1.0, finite.max(initial=0.0)))


def test_every_gallery_spec_with_a_softmax_takes_a_mask():
    assert len(MASKED) >= 6 and "temperature_attention" in MASKED and "sigmoid_attention" not in MASKED


def test_a_masked_gallery_module_skips_the_hidden_keys():
    # the scores of a block of rows are made only for the keys its rows may see: causal, 300 rows in blocks of 128
    source = sa.with_mask(gallery_spec("temperature_attention"))
    from symattn.codegen import generate as codegen

    text = codegen.render(source, "numpy")
    assert "keys = key_range(M, causal, block, " in text and "causal_fill(" in text


def test_with_mask_names_what_it_cannot_do():
    with pytest.raises(SymattnError, match="needs a softmax"):
        sa.with_mask(gallery_spec("sigmoid_attention"))
    with pytest.raises(SymattnError, match="already an input or constant"):
        sa.with_mask(gallery_spec("bias_attention"), name="B")


@pytest.mark.parametrize("name", ["softcap_attention", "temperature_attention"])
def test_masked_gallery_jvp_matches_forward_mode_of_the_reference(name):
    made = module(sa.with_mask(gallery_spec(name)), "torch")
    values = [torch.tensor(v) for v in _values(name).values()]
    padding, additive = _mask(2)
    tangents = [torch.randn_like(v) for v in values]

    def reference(*xs):
        with MaskedSoftmax(additive):
            return REFERENCES[name][1](*xs)

    def generated(*xs):
        return made.forward(*xs, causal=True, key_padding_mask=torch.tensor(padding))

    want = torch.func.jvp(reference, tuple(values), tuple(tangents))
    got = torch.func.jvp(generated, tuple(values), tuple(tangents))
    for a, b in zip(got, want, strict=True):
        assert _error(a.numpy(), b.numpy()) <= 1e-10


@pytest.mark.parametrize("scores", ["transposed", "log_softmax"])
def test_scores_not_made_entry_by_entry_are_computed_whole(scores):
    # tanh(S)ᵀ (n × n like S) and log_softmax(S) ⊙ S (log_softmax over every key) are not made block by block
    # from S's blocks: the module computes them whole, and the numbers are the mask's, never a wrong block's
    from symattn.specs import dim

    n, d = dim("n"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", n, d), sa.matrix("V", n, d)
    s = q * k.T
    a = sa.tanh(s).T if scores == "transposed" else sa.hadamard(sa.log_softmax(s), s)
    spec = sa.with_mask(sa.Spec("chained", "softmax(f(Q Kᵀ) + M) V", (q, k, v), sa.softmax(a) * v, (("S", s),)))
    rng = np.random.default_rng(2)
    values = [rng.standard_normal((ROWS, 4)) for _ in range(3)]
    out, _ = module(spec, "numpy").forward(*values, causal=True)
    s_value = values[0] @ values[1].T
    log_p = s_value - np.log(np.exp(s_value).sum(-1, keepdims=True))
    a_value = np.tanh(s_value).T if scores == "transposed" else log_p * s_value
    a_value = np.where(np.triu(np.ones((ROWS, ROWS), dtype=bool), 1), -np.inf, a_value)
    p = np.exp(a_value - a_value.max(-1, keepdims=True))
    assert _error(out, (p / p.sum(-1, keepdims=True)) @ values[2]) <= 1e-10
