"""Specs: the Spec type and its validation, the built-in specs, their registry, and spec files.

Each built-in spec is a ``Family``: the function that builds it from options, and the
facts code generation needs (its generated keywords, whether its modules take masks,
whether a row-block variant exists, the torch class name, the options that choose one of
its configurations). Code generation asks the family, never the spec's name; a user's
spec file is a family with the defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from symattn.errors import SymattnError, UnknownSpecError
from symattn.lang.dims import dim
from symattn.specs.attention import attention, attention_options, mha, mha_options, self_attention
from symattn.specs.block import block_options, transformer_block
from symattn.specs.spec import Option, Spec, head_count


def no_options(extended: bool) -> tuple[dict, tuple[Option, ...]]:
    """A spec whose generated modules take no keywords."""
    return {}, ()


@dataclass(frozen=True)
class Family:
    """A spec builder and what its generated modules need to know.

    ``generated_options(extended)`` gives the builder's keywords that make the generated
    spec (options as symbols) and the generated forward's keyword ``Option``s; with
    ``masks`` the modules are built extended (mask keywords, optional biases).
    """

    build: Callable[..., Spec]
    generated_options: Callable[[bool], tuple[dict, tuple[Option, ...]]] = no_options
    masks: bool = False
    row_blocks: bool = False  # a memory-efficient variant: P recomputed one block of query rows at a time
    class_name: str | None = None  # the torch nn.Module's name (default: the spec's name in CamelCase)
    dropins: tuple[str, ...] = ()  # torch's classes the torch module also carries (codegen.dropin_runtime)
    # the builder's options that choose a configuration (a different function, e.g. the block's norm_first and
    # activation): generated/ holds the default one; another is rendered on demand (``codegen.generate.render``)
    configured: tuple[str, ...] = ()

    def generated_spec(self, extended: bool, configuration: tuple = ()) -> tuple[Spec, tuple[Option, ...]]:
        """The spec with its options as symbols (extended: every optional part on) in the configuration given as
        (option, value) pairs (none: the builder's defaults), and its keyword options."""
        unknown = sorted(name for name, _ in configuration if name not in self.configured)
        if unknown:
            known = ", ".join(self.configured) or "none"
            raise SymattnError(f"{', '.join(unknown)}: not a configuration option of this spec (those: {known})")
        spec_options, options = self.generated_options(extended)
        return self.build(**spec_options, **dict(configuration)), options

    def configuration(self, s: Spec) -> dict:
        """The values of the configuration options (``configured``) that built the spec s (an option the spec
        leaves out, a dropout of 0: its default)."""
        return {name: s.options[name] for name in self.configured if name in s.options}


BUILTIN: dict[str, Family] = {
    "attention": Family(attention, attention_options, masks=True, row_blocks=True),
    "self_attention": Family(self_attention, row_blocks=True),
    "mha": Family(
        mha,
        mha_options,
        masks=True,
        row_blocks=True,
        class_name="MultiHeadAttention",
        dropins=("MultiheadAttention",),
        configured=("dropout",),
    ),
    "transformer_block": Family(
        transformer_block,
        block_options,
        masks=True,
        dropins=("TransformerEncoderLayer",),
        configured=("norm_first", "activation", "approximate", "dropout"),
    ),
}


def specs() -> list[str]:
    """Names of the built-in specs."""
    return list(BUILTIN)


def family(name: str) -> Family:
    """The built-in family called name."""
    if name not in BUILTIN:
        raise UnknownSpecError(f"unknown spec {name!r}; built-in specs: {', '.join(BUILTIN)}")
    return BUILTIN[name]


def spec(name: str, **options) -> Spec:
    """The built-in spec called name, built with the given options."""
    build = family(name).build
    try:
        return build(**options)
    except TypeError as err:
        raise SymattnError(f"bad option for spec {name!r}: {err}") from None


__all__ = ["BUILTIN", "Family", "Option", "Spec", "dim", "family", "head_count", "spec", "specs"]
