"""Mixed-precision training with the generated drop-in MultiheadAttention: torch's AMP recipe, unchanged.

A one-layer model learns to copy a random sequence through causal self-attention. The forward runs under
``torch.autocast`` (bfloat16 on the CPU, float16 with a GradScaler on CUDA), the parameters stay float32,
and the attention's backward is symattn's generated closed form.

    python examples/amp_training.py [--steps 60] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from symattn.generated.mha_torch import MultiheadAttention

WIDTH, HEADS, LENGTH = 32, 4, 16


class Copier(torch.nn.Module):
    """x → x + attention(x) → a linear read-out, the attention being symattn's drop-in."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        attended, _ = self.attention(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        return self.out(x + attended)


def train(steps: int = 60, device: str = "cpu", seed: int = 0) -> list[float]:
    """The losses of an AMP training run (bfloat16 on the CPU, float16 with loss scaling on CUDA)."""
    torch.manual_seed(seed)
    model = Copier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, LENGTH, WIDTH, device=device)
        optimizer.zero_grad()
        with torch.autocast(device, dtype=dtype):
            loss = F.mse_loss(model(x).float(), x)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    losses = train(args.steps, args.device)
    print(f"loss {losses[0]:.3f} → {losses[-1]:.3f} over {args.steps} steps ({args.device}, autocast)")
