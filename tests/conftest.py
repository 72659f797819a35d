"""Shared fixtures: a seeded generator and the built-in derivations (derived once)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core (-n auto): each one thread, before BLAS loads
    for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")

# Triton's interpreter runs the Triton modules' kernels on CPU tensors (tests/integration/test_triton.py); it is chosen
# when triton is first imported (its own tl.* helpers are decorated then), which torch._dynamo may do before that file.
# TRITON_INTERPRET=0 keeps it off (torch.compile's own Triton kernels on a GPU); test_triton.py then skips.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

import symattn as sa


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


@pytest.fixture(scope="session")
def derivations() -> dict[str, sa.Derivation]:
    return {name: sa.derive(name) for name in sa.specs()}
