"""A backend of code generation: one object holds everything generate, the module context and the second
order ask of an array library (its printer, runtime helpers, variants, mask policy, whether its own autodiff
calls the closed form). A new backend is a printer, a runtime module and a template, named by one of these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """An array library code generation writes modules for."""

    name: str
    printer: type  # prints expressions (a GeneratedCodeMixin printer); its runtime holds the helpers it copies
    variants: tuple[str, ...]  # the variants its modules come in (standard, memeff)
    check_inputs: str  # the runtime helper that checks and converts a module's inputs
    helpers: tuple[str, ...]  # the runtime helpers every module of this backend calls
    mask_shape: str  # the runtime helper that gives the shape ∂f/∂M is summed to
    # its own autodiff calls the closed form (torch autograd, jax.custom_vjp) and carries ∂f/∂attn_mask on to the
    # mask; False: the caller calls backward, which returns it under "attn_mask"
    autodiff: bool
    second_order_helpers: tuple[str, ...] | None  # the second closed form's helpers; None: none printed
    runtimes: tuple[str, ...]  # the runtime modules whose names generated code may use
    imports: tuple[str, ...]  # the module names its generated modules bind (np; torch; jax, jnp)
    device: bool = False  # arrays carry a device beside their dtype
    dropins: bool = False  # drop-in nn.Modules rendered beside a built-in family's standard module
    forward_mode_helpers: tuple[str, ...] = ()  # the runtime helpers its Function's jvp calls
    # its second closed form and JVP run under vmap (torch.func) with some operands batched and others not,
    # where an in-place update of an unbatched array by a batched one is refused: they write nothing in place
    vmapped: bool = False
    custom_jvp: bool = False  # forward_jvp: the forward as a custom_jvp whose rule is the generated JVP (JAX)
    missing_variant: str = ""  # why a variant is not made (shown when one is asked for)
    # its standard modules with a mask go through blocks of query rows without a memory-efficient variant (JAX:
    # causal blocks whose key ranges are static under jit)
    masked_blocks: bool = False
    # its arrays can be written: helpers take out=, sums over blocks are +=, dying arrays are overwritten (JAX's are
    # immutable: nothing in place anywhere)
    mutable: bool = True
    # the runtime helper that decorates its public backward, hvp and jvp ("": none): NumPy's rounds a float16 run's
    # float32 values (products left wide, sums over blocks of rows) to float16 once, as torch's autograd and the
    # JAX module's _narrowed do
    results_helper: str = ""
    # its modules are rendered by this function (source, regenerate command, Jinja environment) → text, not from the
    # schedule's sections (Triton: the kernels of the spec's n × m core, the torch code around them)
    renders: Callable | None = None
    # its modules hand a call on CUDA to the spec's Triton module beside them where the kernels apply (path()):
    # forward and jvp
    routes: bool = False

    @property
    def loops(self) -> bool:
        """Has it the runtime of loops over blocks of query rows (key_range, causal_fill, put_rows, add_rows): the
        backends with a memory-efficient variant, whose standard modules with a mask go through blocks too, and
        those that say so (masked_blocks)."""
        return "memeff" in self.variants or self.masked_blocks

    @property
    def template(self) -> str:
        """The Jinja template of its modules."""
        return f"{self.name}_module.py.j2"
