"""Train one self-attention layer to reverse short sequences, with the generated NumPy backend.

The model is symattn's ``self_attention`` spec and nothing else: a token at
position i is the row [one-hot(token) | one-hot(i)] of X, the output
O = softmax(X W_Q (X W_K)ᵀ / √d_k) X W_V holds the logits of the token wanted at
each position (the one at position n − 1 − i), and the loss is the mean
cross-entropy. Its cotangent ∂L/∂O = (softmax(O) − one-hot(target)) / rows goes
into the generated ``backward``, and plain SGD updates every weight,
W ← W − η ∂L/∂W.

Run: python examples/train_reverse.py [--steps N]; the loss falls below 0.05
(from log(vocab) ≈ 1.6) in the default 300 steps.
"""

from __future__ import annotations

import argparse

import numpy as np
from symattn.generated import self_attention_numpy as attention

VOCAB = 5
LENGTH = 6
THRESHOLD = 0.05  # mean cross-entropy the default run ends below


def batch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Random sequences as X (size, n, vocab + n) and their reversals as token ids (size, n)."""
    tokens = rng.integers(0, VOCAB, size=(size, LENGTH))
    x = np.concatenate(
        [np.eye(VOCAB)[tokens], np.broadcast_to(np.eye(LENGTH), (size, LENGTH, LENGTH))],
        axis=-1,
    )
    return x, tokens[:, ::-1]


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy over every position, and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(shifted)
    probs /= probs.sum(axis=-1, keepdims=True)
    picked = np.take_along_axis(probs, targets[..., None], axis=-1)[..., 0]
    loss = float(-np.log(picked).mean())
    grad = probs.copy()
    np.put_along_axis(grad, targets[..., None], picked[..., None] - 1, axis=-1)  # softmax − one-hot
    return loss, grad / targets.size


def train(steps: int = 300, batch_size: int = 32, lr: float = 2.0, d_k: int = 8, seed: int = 0) -> list[float]:
    """SGD on the reversal task; returns the loss at every step."""
    rng = np.random.default_rng(seed)
    d_model = VOCAB + LENGTH
    weights = {
        "W_Q": rng.normal(0, 0.5, (d_model, d_k)),
        "W_K": rng.normal(0, 0.5, (d_model, d_k)),
        "W_V": rng.normal(0, 0.5, (d_model, VOCAB)),
    }
    losses = []
    for _ in range(steps):
        x, targets = batch(rng, batch_size)
        logits, saved = attention.forward(x, weights["W_Q"], weights["W_K"], weights["W_V"])
        loss, grad_logits = cross_entropy(logits, targets)
        grads = attention.backward(saved, grad_logits)
        for name, w in weights.items():
            w -= lr * grads[name]  # W ← W − η ∂L/∂W
        losses.append(loss)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    losses = train(args.steps)
    for step in range(0, len(losses), max(1, len(losses) // 10)):
        print(f"step {step:5d}  loss {losses[step]:.4f}")
    print(f"final loss {losses[-1]:.4f} (threshold {THRESHOLD})")


if __name__ == "__main__":
    main()
