"""Backends of code generation: one ``Backend`` object per array library (NumPy, PyTorch, JAX), each with its
printer, runtime helpers and template; generate, the module context and the second order ask the object.

``BACKENDS`` are the ones ``symattn generate`` writes by default; ``OPTIONAL_BACKENDS`` (Triton) are written for the
built-ins, and for a user's spec when named (``--backend triton``): ``backend_named`` knows both."""

from __future__ import annotations

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.jax.backend import JAX_BACKEND
from symattn.codegen.backends.numpy.backend import NUMPY_BACKEND
from symattn.codegen.backends.torch.backend import TORCH_BACKEND
from symattn.codegen.backends.triton.backend import TRITON_BACKEND
from symattn.errors import SymattnError

BACKENDS: dict[str, Backend] = {b.name: b for b in (NUMPY_BACKEND, TORCH_BACKEND, JAX_BACKEND)}
OPTIONAL_BACKENDS: dict[str, Backend] = {TRITON_BACKEND.name: TRITON_BACKEND}


def backend_named(name: str) -> Backend:
    """The backend called name; a SymattnError naming the choices for any other."""
    known = BACKENDS | OPTIONAL_BACKENDS
    if name not in known:
        raise SymattnError(f"unknown backend {name!r}; choose from {', '.join(known)}")
    return known[name]
