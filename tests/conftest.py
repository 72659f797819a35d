"""Shared fixtures: a seeded generator and the built-in derivations (derived once)."""

from __future__ import annotations

import numpy as np
import pytest

import symattn as sa


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261122)


@pytest.fixture(scope="session")
def derivations() -> dict[str, sa.Derivation]:
    return {name: sa.derive(name) for name in sa.specs()}
