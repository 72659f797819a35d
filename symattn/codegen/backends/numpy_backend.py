"""The NumPy backend: its printer and what code generation asks of it."""

from __future__ import annotations

from sympy import Basic

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.printing import GeneratedCodeMixin
from symattn.lang.functions import NUMPY
from symattn.numeric.printers import NUMPY_RUNTIME, NumPyMatrixPrinter, runtime_functions

RUNTIMES = ("symattn.codegen.backends.common_runtime", "symattn.codegen.backends.numpy_runtime")
OWN = {name: source for module in RUNTIMES for name, source in runtime_functions(module).items()}
REPLACED = {"row_softmax"}  # the generated modules' own form (out=: written into a dying array)
if set(OWN) & set(NUMPY_RUNTIME) != REPLACED:  # pragma: no cover - a helper named twice must be meant
    raise RuntimeError(f"helpers in both NumPy runtimes: {sorted(set(OWN) & set(NUMPY_RUNTIME))}")
# helper name -> its source: the evaluation printer's helpers (erf, gelu, layer_norm, …) and the modules' own
GENERATED_NUMPY_RUNTIME = {**NUMPY_RUNTIME, **OWN}


class GeneratedNumPyPrinter(GeneratedCodeMixin, NumPyMatrixPrinter):
    """NumPy source for generated modules: constant arrays in the inputs' dtype."""

    runtime = GENERATED_NUMPY_RUNTIME
    backend = NUMPY
    row_dot_function = "np.vecdot"  # rowsum(X ⊙ Y) without the X ⊙ Y temporary (NumPy ≥ 2.0)

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"np.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=dtype)"

    def _print_Identity(self, expr: Basic) -> str:
        return f"np.eye({self._print(expr.shape[0])}, dtype=dtype)"


NUMPY_BACKEND = Backend(
    name=NUMPY,
    printer=GeneratedNumPyPrinter,
    variants=("standard", "memeff"),
    check_inputs="_arrays",
    helpers=("_cotangent",),
    mask_shape="_float_mask_shape",
    autodiff=False,
    second_order_helpers=("_direction",),
    runtimes=("symattn.numeric.numpy_runtime", *RUNTIMES),
    imports=("np",),
)
