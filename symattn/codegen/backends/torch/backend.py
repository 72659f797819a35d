"""The PyTorch backend: its printer (``torch`` calls, scalars as plain Python arithmetic since dimensions are
ints, so a generated module imports only torch) and what code generation asks of it."""

from __future__ import annotations

import ast

from sympy import Basic

from symattn.codegen.backends.backend import Backend
from symattn.codegen.backends.printing import SCALAR_FUNCTIONS, GeneratedCodeMixin, _unwrapped
from symattn.codegen.emit.dropins import MODULES as DROPIN_MODULES
from symattn.codegen.schedule.plan import flipped
from symattn.errors import SymattnError
from symattn.lang.functions import TORCH
from symattn.numeric.printers import NumPyMatrixPrinter, power, runtime_functions

RUNTIMES = (
    "symattn.codegen.backends.common_runtime",
    "symattn.codegen.backends.torch.runtime",
    "symattn.codegen.backends.torch.pages",
    "symattn.codegen.backends.torch.function_runtime",
    "symattn.codegen.backends.torch.positions_runtime",
    "symattn.codegen.backends.torch.random_runtime",
)
TORCH_RUNTIME = {name: source for module in RUNTIMES for name, source in runtime_functions(module).items()}


def _receiver(text: str) -> str:
    """text as the tensor an in-place method is called on: bracketed unless it is one primary expression (a name,
    a call, an attribute, a subscript). ``1 + T - D.mul_(P)`` would multiply D, the last operand, in place (D a
    column, the product n × m: a write into an array smaller than the value), not the sum."""
    body = ast.parse(text, mode="eval").body
    return text if isinstance(body, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)) else f"({text})"


class TorchMatrixPrinter(GeneratedCodeMixin, NumPyMatrixPrinter):
    """PyTorch source for generated modules: tensors batched like the NumPy printer's arrays."""

    printmethod = "_symattn_torch"
    module_alias = "torch"
    axis_keyword = "dim"
    keepdims_keyword = "keepdim"
    concatenate_function = "torch.cat"
    runtime = TORCH_RUNTIME
    backend = TORCH
    flip_ratio = 8  # Aᵀ B as matmul_tn(A, B) when A has this many times B's columns (typical sizes)
    # SymPy's NumPy printer names numpy functions (MatPow: numpy.linalg.matrix_power); their torch forms
    numpy_functions = {
        "numpy.linalg.matrix_power": "torch.linalg.matrix_power",
        "numpy.linalg.inv": "torch.linalg.inv",
        **{f"numpy.{f}": f"torch.{f}" for f in SCALAR_FUNCTIONS},
    }

    def batch_scalar(self, text: str) -> str:
        return f"{text}[..., None, None]"

    # rowsum(X ⊙ Y), D = rowsum(dO ⊙ O): the runtime's row_dot, in float32 for 16-bit arrays (a statistic)
    row_dot_function = "row_dot"
    wide_product, narrow_product = "big_matmul", "narrow_matmul"  # (16-bit runs: n × m arrays in float32)
    block_sum = "add_blocks"  # (16-bit runs: a weight's gradient summed over blocks in float32)

    def concatenate_rows(self, blocks: str) -> str:
        """The blocks of rows stacked back, their float32 values (a 16-bit run's) with them: ``joined_rows``."""
        return f"{self.helper('joined_rows')}({blocks})"

    def placed_rows(self, name: str) -> str:
        """Traced or transformed, put_rows collects the blocks in a list: one concatenation after the loop."""
        return f"{self.helper('placed_rows')}({name})"

    def mask_gradient(self, value: str, heads: bool) -> str:
        """∂f/∂M of M's shape; autograd carries it on to attn_mask (summed where M was expanded)."""
        return f"{value}.sum_to_size(mask_shape)"

    def inplace_function(self, function: str, operand: str, buffer: str) -> str:
        """function(operand) in place: A.sub_(L).exp_()."""
        return f"{_receiver(operand)}.{function.removeprefix('torch.')}_()"

    def inplace_operation(self, op: str, target: str, operand: str, buffer: str) -> str:
        """target op operand, in place: dP.sub_(D).mul_(P)."""
        method = {"add": "add_", "subtract": "sub_", "multiply": "mul_"}[op]
        return f"{_receiver(target)}.{method}({operand})"

    def _module_format(self, fqn: str, register: bool = True) -> str:
        """The torch name of a numpy function SymPy's printer asks for; a module that imports only torch has no np."""
        if fqn.startswith("numpy."):
            if fqn not in self.numpy_functions:
                raise SymattnError(f"the torch printer has no torch form of {fqn}")
            return self.numpy_functions[fqn]
        return super()._module_format(fqn, register)

    def _print_Trace(self, expr: Basic) -> str:
        return f"torch.diagonal({self._print(expr.arg)}, dim1=-2, dim2=-1).sum(dim=-1)"

    def _repeat(self, column: str, times: Basic) -> str:
        return f"{self.helper('repeat_columns')}({column}, {self._print(times)})"

    def _print_Identity(self, expr: Basic) -> str:
        return f"torch.eye({self._print(expr.shape[0])}, dtype=dtype, device=device)"

    position_dtype = ", dtype, device"
    position_number = "i.new_tensor({})".format

    def _print_OneMatrix(self, expr: Basic) -> str:
        rows, cols = (self._print(s) for s in expr.shape)
        return f"torch.ones({rows}, {cols}, dtype=dtype, device=device)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        rows, cols = (self._print(s) for s in expr.shape)
        return f"torch.zeros({rows}, {cols}, dtype=dtype, device=device)"

    def _join_product(self, mats: list[Basic], texts: list[str]) -> str:
        """Aᵀ B the plan flips (Pᵀ dO, dAᵀ Q: A's columns ``flip_ratio`` times B's): the runtime's matmul_tn,
        which multiplies a long product as (Bᵀ A)ᵀ where torch's GEMM is faster that way."""
        if len(mats) == 2 and texts[0].endswith(".mT") and flipped(*mats, self.flip_ratio):
            left, right = (_unwrapped(t) for t in (texts[0].removesuffix(".mT"), texts[1]))
            return f"{self.helper('matmul_tn')}({left}, {right})"
        return super()._join_product(mats, texts)

    def _print_sqrt(self, expr: Basic) -> str:  # pragma: no cover - Pow handles sqrt
        return power(self._atom(expr.args[0]), "0.5")


TORCH_BACKEND = Backend(
    name=TORCH,
    printer=TorchMatrixPrinter,
    variants=("standard", "memeff"),
    check_inputs="_tensors",
    helpers=("_Last", "_apply", "_distinct", "_only_tensors", "_first_order", "_tie"),
    mask_shape="_grad_shape",
    autodiff=True,
    second_order_helpers=(
        "_direction",
        "_Held",
        "_first_forward_mode",
        "_Backward",
        "_split",
        "_same_draws",
        "_hessian",
        "_plus",
        "_shaped",
        "_second_order",
    ),
    forward_mode_helpers=("_first_forward_mode", "_same_draws", "_tangent"),
    vmapped=True,
    device=True,
    dropins=True,
    routes=True,
    runtimes=(*RUNTIMES, *DROPIN_MODULES),
    imports=("torch",),
)
