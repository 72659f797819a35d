"""Fused Triton kernels of a spec the torch ops cannot fuse: differential attention (docs/modules.md, Triton).

``symattn generate --backend triton`` writes a module whose n × m cores run as FlashAttention-style kernels:
here the gallery's differential attention, (softmax(Q₁K₁ᵀ/√d + M) − λ softmax(Q₂K₂ᵀ/√d + M)) V, two cores
and a trainable λ, with the additive mask M of ``sa.with_mask`` (so both modules take ``causal``). On a CUDA
tensor the kernels run compiled; without a GPU, Triton's interpreter runs them on CPU tensors
(TRITON_INTERPRET=1, set before triton is imported), which this script does at a small size. Output, every
gradient (λ's included) and the JVP are compared with the generated torch module of the same spec.

    python examples/triton_kernels.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # the kernels on CPU tensors: before triton is first imported

import triton  # noqa: E402, F401  (the `triton` extra: the generated module's kernels)

import symattn as sa  # noqa: E402
from symattn.codegen.generate import render  # noqa: E402
from symattn.specs.files import load_spec_file  # noqa: E402

spec = sa.with_mask(load_spec_file(Path(__file__).parent / "specs" / "differential_attention.py"))
folder = Path(tempfile.mkdtemp())
modules = {}
for backend in ("triton", "torch"):  # what `symattn generate --backend triton|torch --spec-file …` writes
    path = folder / f"{spec.name}_{backend}.py"
    path.write_text(render(spec, backend), encoding="utf-8")
    found = importlib.util.spec_from_file_location(path.stem, path)
    modules[backend] = importlib.util.module_from_spec(found)
    sys.modules[path.stem] = modules[backend]
    found.loader.exec_module(modules[backend])

device = "cuda" if CUDA else "cpu"
generator = torch.Generator(device=device).manual_seed(0)
shapes = {"X": (2, 40, 32), **{w: (32, 16) for w in ("W_Q1", "W_K1", "W_Q2", "W_K2", "W_V")}}
inputs = {k: torch.randn(s, generator=generator, device=device) / 4 for k, s in shapes.items()}
inputs["lam"] = torch.tensor(0.8, device=device)
for x in inputs.values():
    x.requires_grad_()

fused = modules["triton"].forward(*inputs.values(), causal=True)
plain = modules["torch"].forward(*inputs.values(), causal=True)
cotangent = torch.randn(fused.shape, generator=generator, device=device)
grads = torch.autograd.grad(fused, list(inputs.values()), cotangent)
want = torch.autograd.grad(plain, list(inputs.values()), cotangent)
print(f"output: max |Triton − torch| = {(fused - plain).abs().max():.1e}")
for name, a, b in zip(inputs, grads, want):
    print(f"d{name}: max |Triton − torch| = {(a - b).abs().max():.1e}")
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name

tangents = {"X": torch.randn(shapes["X"], generator=generator, device=device)}
detached = [x.detach() for x in inputs.values()]
_, tangent = modules["triton"].jvp(*detached, tangents, causal=True)
_, want_tangent = modules["torch"].jvp(*detached, tangents, causal=True)
print(f"JVP along X: max |Triton − torch| = {(tangent - want_tangent).abs().max():.1e}")
assert torch.allclose(tangent, want_tangent, rtol=1e-4, atol=1e-5)
