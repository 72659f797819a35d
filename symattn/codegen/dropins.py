"""The drop-in torch classes a generated torch module carries, and their source.

The classes live in ``dropin_runtime`` as real, linted code; code generation copies their
source with the helpers they call (``NEEDS``, each copied before its first user) to the end
of the module. The source is read from the file's text (``ast``), not by importing it:
importing it imports torch, seconds that deriving or generating NumPy code never needs.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

RUNTIME = Path(__file__).with_name("dropin_runtime.py")

# the drop-in classes by name, and the helpers each calls (copied before it, in this order)
NEEDS: dict[str, tuple[str, ...]] = {
    "MultiheadAttention": (
        "_not_supported",
        "_size",
        "_float_mask",
        "_torch_mask",
        "_sequences",
        "_projections",
        "_AttentionWeights",
        "_add_weights_gradient",
        "_identity",
        "MultiheadAttention",
    ),
    "TransformerEncoderLayer": (
        "_not_supported",
        "_size",
        "_float_mask",
        "_torch_mask",
        "_sequences",
        "_projections",
        "_SelfAttentionWeights",
        "_is_exact_gelu",
        "TransformerEncoderLayer",
    ),
}


@cache
def _definitions() -> dict[str, str]:
    """Top-level function and class name → its source, decorators included."""
    text = RUNTIME.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out[node.name] = "".join(lines[start - 1 : node.end_lineno])
    return out


def source(names: tuple[str, ...] | list[str]) -> str:
    """The source of the named drop-in classes and the helpers they call, each once, two blank lines apart."""
    definitions = _definitions()
    return "\n\n".join(definitions[name] for name in dict.fromkeys(n for name in names for n in NEEDS[name]))


__all__ = ["NEEDS", "source"]
