"""The JAX backend: the NumPy printer's batched code with ``jnp`` calls, never in place, and what code
generation asks of it.

JAX arrays are immutable, so ``JaxMatrixPrinter`` prints no ``out=`` and no in-place update
(``Backend.mutable`` False: the sections give it no dying array to overwrite). Everything else — the
broadcasts, the scalar on the smallest factor, the weight gradients as one product of flattened
rows — is ``GeneratedCodeMixin``'s, with a module name and a table of function names.
"""

from __future__ import annotations

from sympy import Basic

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.numpy.backend import GeneratedNumPyPrinter
from symattn.codegen.backends.printing import SCALAR_FUNCTIONS
from symattn.errors import SymattnError
from symattn.lang.functions import JAX
from symattn.numeric.printers import runtime_functions

RUNTIMES = (
    "symattn.codegen.backends.common_runtime",
    "symattn.codegen.backends.jax.runtime",
    "symattn.codegen.backends.jax.random_runtime",
)
JAX_RUNTIME = {name: source for module in RUNTIMES for name, source in runtime_functions(module).items()}


class JaxMatrixPrinter(GeneratedNumPyPrinter):
    """jax.numpy source for generated modules: arrays batched like the NumPy printer's, pure functions only."""

    printmethod = "_symattn_jax"
    module_alias = "jnp"
    concatenate_function = "jnp.concatenate"
    runtime = JAX_RUNTIME
    row_dot_function = "row_dot"  # the runtime's: float32 for 16-bit arrays (XLA fuses the product into the sum)
    wide_product, narrow_product = "wide_matmul", "narrow_matmul"  # (16-bit runs: n × m arrays in float32)
    fused_rows = False  # and exp(X − u 𝟏ᵀ), F ⊙ (X − u 𝟏ᵀ) into one loop
    block_sum = None  # a sum over blocks is a new array, total + part (add_rows sums 16-bit parts in float32)
    transposed_product = None  # Pᵀ dO, dSᵀ Q by narrow_matmul (add_rows sums the parts in float32)
    backend = JAX
    # SymPy's NumPy printer names numpy functions (MatPow: numpy.linalg.matrix_power); their jax forms
    numpy_functions = {
        "numpy.linalg.matrix_power": "jnp.linalg.matrix_power",
        "numpy.linalg.inv": "jnp.linalg.inv",
        **{f"numpy.{f}": f"jnp.{f}" for f in SCALAR_FUNCTIONS},
    }

    def _module_format(self, fqn: str, register: bool = True) -> str:
        """The jax name of a numpy function SymPy's printer asks for; a module that imports only jax has no np."""
        if fqn.startswith("numpy."):
            if fqn not in self.numpy_functions:
                raise SymattnError(f"the jax printer has no jax form of {fqn}")
            return self.numpy_functions[fqn]
        return super()._module_format(fqn, register)

    def inplace_function(self, function: str, operand: str, buffer: str) -> str:  # pragma: no cover - no buffers
        raise SymattnError("the jax printer writes nothing in place")

    def inplace_operation(self, op: str, target: str, operand: str, buffer: str) -> str:  # pragma: no cover
        raise SymattnError("the jax printer writes nothing in place")

    def column_sums(self, text: str) -> str:
        """𝟏ᵀ X: the sums of X's columns, as a row (jnp's sum: XLA accumulates 16-bit sums in float32)."""
        return self.reduce_sum(text, "0", keepdims=True)

    def batch_scalar(self, text: str) -> str:
        return f"jnp.expand_dims({text}, (-2, -1))"

    def placed_rows(self, name: str) -> str:
        """put_rows collects the padded blocks in a list (no in-place update): one concatenation after the loop."""
        return f"{self.helper('placed_rows')}({name})"

    def mask_gradient(self, value: str, heads: bool) -> str:
        """∂f/∂M of M's shape (mask_shape), summed where M was broadcast; jax carries it on to attn_mask."""
        return f"{self.helper('sum_to_shape')}({value}, mask_shape)"

    def _repeat(self, column: str, times: Basic) -> str:
        return f"jnp.repeat({column}, {self._print(times)}, axis=-1)"

    def _print_Trace(self, expr: Basic) -> str:
        return f"jnp.trace({self._print(expr.arg)}, axis1=-2, axis2=-1)"

    def _print_Identity(self, expr: Basic) -> str:
        return f"jnp.eye({self._print(expr.shape[0])}, dtype=dtype)"

    position_dtype = ", dtype"
    position_number = "jnp.asarray({}, i.dtype)".format

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"jnp.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"jnp.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"


JAX_BACKEND = Backend(
    name=JAX,
    printer=JaxMatrixPrinter,
    variants=("standard",),
    check_inputs="_arrays",
    helpers=("_Static", "_residuals", "_restore", "_narrowed"),
    mask_shape="_mask_shape",
    autodiff=True,
    second_order_helpers=None,  # jax differentiates a custom_vjp's own rules (plain jax.numpy) again
    runtimes=RUNTIMES,
    imports=("jax", "jnp"),
    custom_jvp=True,
    missing_variant="jax.jit decides what XLA keeps in memory",
    masked_blocks=True,
    mutable=False,
)
