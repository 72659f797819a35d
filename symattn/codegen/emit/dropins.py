"""The drop-in torch classes a generated torch module carries, and their source.

The classes live in ``dropin_runtime`` and ``dropin_block`` as real, linted code; code generation copies their
source with the helpers they call (``NEEDS``, each copied before its first user) to the end
of the module. The source is read from the file's text (``numeric.printers.runtime_functions``),
not by importing it: importing it imports torch, seconds that deriving or generating NumPy code
never needs.
"""

from __future__ import annotations

from symattn.numeric.printers import runtime_functions

# the helpers both drop-ins call: torch's options, a configuration's closed form, masks, sequence layout and
# projections
COMMON = (
    "_not_supported",
    "_size",
    "_closed_form",
    "_prepare",
    "_float_mask",
    "_torch_mask",
    "_sequences",
    "_projections",
)
# the drop-in classes by name, and the helpers each calls (copied before it, in this order)
NEEDS: dict[str, tuple[str, ...]] = {
    "MultiheadAttention": (
        *COMMON,
        "_AttentionWeights",
        "_add_weights_gradient",
        "_identity",
        "MultiheadAttention",
    ),
    "TransformerEncoderLayer": (
        *COMMON,
        "_SelfAttentionWeights",
        "_activation_candidates",
        "_named_activation",
        "_probed_activation",
        "_block_activation",
        "_autocast_output",
        "TransformerEncoderLayer",
    ),
}
# the modules the classes and helpers live in (the encoder layer's beside the attention's)
MODULES = ("symattn.codegen.backends.torch.dropin_runtime", "symattn.codegen.backends.torch.dropin_block")


def source(names: tuple[str, ...] | list[str]) -> str:
    """The source of the named drop-in classes and the helpers they call, each once, two blank lines apart."""
    definitions = {name: text for module in MODULES for name, text in runtime_functions(module).items()}
    return "\n\n".join(definitions[name] for name in dict.fromkeys(n for name in names for n in NEEDS[name]))


__all__ = ["MODULES", "NEEDS", "source"]
