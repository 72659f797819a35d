"""Every built-in spec's every gradient against a central finite difference (float64)."""

from __future__ import annotations

import pytest

import symattn as sa
from symattn.numeric.verify import random_dims, vjp_error


@pytest.mark.parametrize("name", sa.specs())
def test_every_gradient_matches_finite_differences(name, derivations, rng):
    derivation = derivations[name]
    spec = derivation.spec
    assert set(derivation.gradients) == set(spec.input_names)
    for batch in [(), (2,)]:
        dims = random_dims([spec.output], rng)
        for symbol in spec.inputs:
            err = vjp_error(spec.output, symbol, derivation.tape.gradients[symbol], dims, rng, batch=batch)
            assert err < 1e-7, (name, symbol.name, batch, err)


def test_unknown_spec_names_the_builtins():
    with pytest.raises(sa.UnknownSpecError, match="attention"):
        sa.spec("nope")
