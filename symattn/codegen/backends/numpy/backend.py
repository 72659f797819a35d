"""The NumPy backend: its printer and what code generation asks of it."""

from __future__ import annotations

from sympy import Basic
from sympy.matrices.expressions import MatAdd

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.numpy.runtime import REPLACING
from symattn.codegen.backends.printing import GeneratedCodeMixin, _unwrapped
from symattn.codegen.schedule.plan import NARROW, broadcast_column, flipped, precision
from symattn.lang.functions import NUMPY, Exp
from symattn.numeric.printers import NUMPY_RUNTIME, NumPyMatrixPrinter, runtime_functions, split_sign

RUNTIMES = (
    "symattn.codegen.backends.common_runtime",
    "symattn.codegen.backends.numpy.runtime",
    "symattn.codegen.backends.numpy.positions_runtime",
    "symattn.codegen.backends.numpy.random_runtime",
    "symattn.codegen.backends.numpy.numba_kernels",
    "symattn.numeric.low_precision",
)
OWN = {name: source for module in RUNTIMES for name, source in runtime_functions(module).items()}
REPLACED = {helper.__name__ for helper in REPLACING}  # the generated modules' own forms
if set(OWN) & set(NUMPY_RUNTIME) != REPLACED:  # pragma: no cover - a helper named twice must be meant
    raise RuntimeError(f"helpers in both NumPy runtimes: {sorted(set(OWN) & set(NUMPY_RUNTIME))}")
# helper name -> its source: the evaluation printer's helpers (erf, gelu, layer_norm, …) and the modules' own
GENERATED_NUMPY_RUNTIME = {**NUMPY_RUNTIME, **OWN}


class GeneratedNumPyPrinter(GeneratedCodeMixin, NumPyMatrixPrinter):
    """NumPy source for generated modules: constant arrays in the inputs' dtype."""

    runtime = GENERATED_NUMPY_RUNTIME
    backend = NUMPY
    # rowsum(X ⊙ Y), D = rowsum(dO ⊙ O): the runtime's row_dot, np.vecdot (no X ⊙ Y temporary), in float32 for
    # float16 arrays (a statistic)
    row_dot_function = "row_dot"
    # float16 runs as the torch and JAX modules: the n × m arrays in float32, each product accumulated in float32
    # and an n × m factor never rounded (the product is, once), sums over blocks of rows in float32
    wide_product, narrow_product = "wide_matmul", "narrow_matmul"
    block_sum = "add_blocks"  # (a weight's gradient summed over blocks of rows in float32)

    # Entrywise forms over a full array X and a column u broadcast along its rows, each one sweep (a compiled
    # kernel where numba is installed: numpy_runtime.exp_rows, shifted_product) instead of NumPy's two passes:
    #   exp(X − u 𝟏ᵀ)     -> exp_rows(X, u)              (P from the scores and the row log-sum-exp)
    #   F ⊙ (X − u 𝟏ᵀ)    -> shifted_product(F, X, u)    (softmax's backward, P ⊙ (dP − D 𝟏ᵀ))
    fused_rows = True  # (JAX's printer, a subclass: False, XLA fuses them itself)

    def _print_Elementwise(self, expr: Basic) -> str:
        shifted = _row_shifted(expr.arg) if self.fused_rows and isinstance(expr, Exp) else None
        if shifted is None:
            return super()._print_Elementwise(expr)
        return self._fused("exp_rows", [*shifted], self.plan.buffer(expr.arg))

    def _print_HadamardProduct(self, expr: Basic) -> str:
        if self.fused_rows and len(expr.args) == 2:
            for factor, other in (expr.args, expr.args[::-1]):
                shifted = _row_shifted(other)
                if shifted is not None and broadcast_column(factor) is None and factor.shape == expr.shape:
                    return self._fused("shifted_product", [factor, *shifted], self.plan.buffer(expr))
        return super()._print_HadamardProduct(expr)

    # Aᵀ B of an n × m A with flip_ratio times B's columns (dSᵀ Q, Pᵀ dO: a block's part of dK, dV, as torch's
    # printer flips them) by the runtime's matmul_tn, whose product of a float16 run stays float32 for add_rows to
    # sum (None: the narrowing product; JAX's printer)
    transposed_product: str | None = "matmul_tn"
    flip_ratio = 8

    def _join_product(self, mats: list[Basic], texts: list[str]) -> str:
        if (
            self.transposed_product
            and len(mats) == 2
            and texts[0].endswith(".mT")
            and precision(*mats) == NARROW
            and flipped(*mats, self.flip_ratio)
        ):
            left, right = (_unwrapped(t) for t in (texts[0].removesuffix(".mT"), texts[1]))
            return f"{self.helper(self.transposed_product)}({left}, {right})"
        return super()._join_product(mats, texts)

    def _fused(self, helper: str, operands: list[Basic], buffer: str | None) -> str:
        out = "" if buffer is None else f", out={buffer}"
        return f"{self.helper(helper)}({', '.join(self._print(a) for a in operands)}{out})"

    def column_sums(self, text: str) -> str:
        """𝟏ᵀ X: the sums of X's columns, as a row (the runtime's: in float32 for a float16 X)."""
        return f"{self.helper('column_sums')}({text})"

    position_dtype = ", dtype"

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"np.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"

    def _print_Identity(self, expr: Basic) -> str:
        return f"np.eye({self._print(expr.shape[0])}, dtype=dtype)"


def _row_shifted(expr: Basic) -> tuple[Basic, Basic] | None:
    """(X, u) when expr is X − u 𝟏ᵀ: X of expr's shape, u a column (a value per row), else None."""
    if not isinstance(expr, MatAdd) or len(expr.args) != 2:
        return None
    for full, shift in (expr.args, expr.args[::-1]):
        sign, rest = split_sign(shift)
        column = broadcast_column(rest) if sign < 0 else None
        if column is not None and column.shape[1] == 1 and expr.shape[1] != 1 and split_sign(full)[0] > 0:
            if broadcast_column(full) is None and full.shape == expr.shape:
                return full, column
    return None


NUMPY_BACKEND = Backend(
    name=NUMPY,
    printer=GeneratedNumPyPrinter,
    variants=("standard", "memeff"),
    check_inputs="_arrays",
    helpers=("_cotangent", "_in_run_dtype"),
    mask_shape="_float_mask_shape",
    autodiff=False,
    second_order_helpers=("_direction",),
    runtimes=("symattn.numeric.numpy_runtime", *RUNTIMES),
    imports=("np",),
    results_helper="_in_run_dtype",
)
