"""Derivations: a spec's backward pass, its closed-form gradients and their recorded steps."""

from __future__ import annotations

from dataclasses import dataclass

from sympy import Basic

from symattn.grad import Tape, backward
from symattn.specs import Spec, spec


@dataclass
class Derivation:
    """The gradients of a spec's output (cotangent G) for every input and weight."""

    spec: Spec
    tape: Tape

    @property
    def gradients(self) -> dict[str, Basic]:
        """Input or weight name → closed-form gradient."""
        return {str(s.name): g for s, g in self.tape.gradients.items()}


def derive(name_or_spec: str | Spec, **options) -> Derivation:
    """Derive every gradient of a built-in spec (by name) or of a Spec."""
    s = spec(name_or_spec, **options) if isinstance(name_or_spec, str) else name_or_spec
    return Derivation(s, backward(s.output, s.inputs))
