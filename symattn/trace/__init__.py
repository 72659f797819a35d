"""From PyTorch code to a spec: ``from_torch`` traces a function or nn.Module forward into symattn's language;
``drop_in`` swaps a module's forward for the generated closed form; ``check_backward`` checks a
hand-written backward against the traced spec's closed form. torch is imported only when they are called.
"""

from __future__ import annotations


def from_torch(fn, *example_inputs, name: str | None = None):
    """The Spec of a PyTorch function or nn.Module's forward, traced at the example inputs (see ``source``)."""
    from symattn.trace.source import from_torch as traced

    return traced(fn, *example_inputs, name=name)


def drop_in(module, *example_inputs, second_order: bool = True, generated=None):
    """Replace module.forward by the generated closed form of its traced spec (see ``dropin``)."""
    from symattn.trace.dropin import drop_in as replace

    return replace(module, *example_inputs, second_order=second_order, generated=generated)


def generated_instance(module, *example_inputs, second_order: bool = True):
    """The generated nn.Module of a traced module, holding a copy of its parameters (see ``dropin``)."""
    from symattn.trace.dropin import generated_instance as instance

    return instance(module, *example_inputs, second_order=second_order)


def undo(module) -> None:
    """Give a module its own forward back after ``drop_in``."""
    from symattn.trace.dropin import undo as restore

    restore(module)


def check_backward(fn, backward, *example_inputs, trials: int = 5, seed: int = 0):
    """Check a hand-written torch backward against the traced spec's closed form (see ``checking``)."""
    from symattn.trace.checking import check_backward as checked

    return checked(fn, backward, *example_inputs, trials=trials, seed=seed)


__all__ = ["check_backward", "drop_in", "from_torch", "generated_instance", "undo"]
