"""The Triton modules' runtime helpers by name (``TRITON_RUNTIME``), read from the source of their modules, and which
of them a module calls (``called_helpers``): a generated module copies those, and only those, into itself."""

from __future__ import annotations

import ast

from symattn.numeric.printers import helper_needs, runtime_functions

# the helpers a Triton module copies, by role: its launches, its autograd Functions, its public functions' arguments
RUNTIMES = (
    "symattn.codegen.backends.triton.runtime_launch",
    "symattn.codegen.backends.triton.runtime_autograd",
    "symattn.codegen.backends.triton.runtime_module",
)
TRITON_RUNTIME = {name: source for module in RUNTIMES for name, source in runtime_functions(module).items()}


def called_helpers(text: str) -> list[str]:
    """The runtime helpers that text, a module without them, reads, and the ones those call, in the runtime modules'
    order (launches, autograd, arguments; each in its source order): a spec without head counts gets no _count."""
    read = {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    called = read & TRITON_RUNTIME.keys()
    needed = called.union(*(helper_needs(TRITON_RUNTIME, name) for name in called))
    return [name for name in TRITON_RUNTIME if name in needed]
