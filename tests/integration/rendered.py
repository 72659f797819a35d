"""A user's Spec rendered and loaded as a module (first order), and arrays compared shape and value."""

from __future__ import annotations

import types

import numpy as np

import symattn as sa
from symattn.codegen import generate as codegen


def load(spec: sa.Spec, backend: str) -> types.ModuleType:
    """The generated first-order module of spec in backend, made in memory."""
    module = types.ModuleType(f"{spec.name}_{backend}")
    exec(compile(codegen.render(spec, backend, second_order=False), module.__name__, "exec"), module.__dict__)
    return module


def close(got, want, what: str) -> None:
    """got equals want in shape, and in value to float64 rounding."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=what)
