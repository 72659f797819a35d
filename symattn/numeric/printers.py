"""Code printers: SymPy matrix expressions of symattn's language as NumPy source.

``NumPyMatrixPrinter`` prints every node so that leading batch dimensions broadcast
(transpose swaps the last two axes, reductions name negative axes). Nodes NumPy has
no function for print as calls of small helpers whose source the printer hands out
(``helper_source``), so a generated module stays self-contained.
``ExactPrinter`` prints the same language for object arrays of SymPy numbers, with
opaque exp atoms, for exact rational verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import MatMul, OneMatrix
from sympy.printing.numpy import NumPyPrinter

NUMPY_HELPERS = {
    "row_softmax": '''def row_softmax(a):
    """softmax along the last axis, the row max subtracted first."""
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
''',
    "sigmoid": '''def sigmoid(a):
    """1 / (1 + exp(-a)), entrywise."""
    return 1.0 / (1.0 + np.exp(-a))
''',
    "split_heads": '''def split_heads(a, heads):
    """(..., n, heads * k) -> (..., heads, n, k)."""
    return np.swapaxes(a.reshape(*a.shape[:-1], heads, a.shape[-1] // heads), -2, -3)
''',
    "merge_heads": '''def merge_heads(a, heads):
    """(..., heads, n, k) -> (..., n, heads * k)."""
    a = np.swapaxes(a, -2, -3)
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])
''',
    "repeat_heads": '''def repeat_heads(a, heads):
    """(..., kv_heads, n, k) -> (..., heads, n, k): head h reads kv head h // (heads // kv_heads)."""
    return a if a.shape[-3] == heads else np.repeat(a, heads // a.shape[-3], axis=-3)
''',
    "sum_groups": '''def sum_groups(a, heads):
    """(..., H, n, k) -> (..., heads, n, k): each group of H // heads consecutive heads summed."""
    if a.shape[-3] == heads:
        return a
    return a.reshape(*a.shape[:-3], heads, a.shape[-3] // heads, *a.shape[-2:]).sum(axis=-3)
''',
    "erf": '''def erf(x):
    """erf(x) = 2/√π exp(−x²) Σ_k 2^k x^(2k+1) / (1·3·…·(2k+1)): positive terms, no cancellation;
    ±1 to double precision past |x| = 6."""
    a = np.clip(x, -6.0, 6.0)
    a2 = a * a
    term = a * 1.0
    total = a * 1.0
    for k in range(1, 160):
        term = term * (2.0 * a2) / (2 * k + 1)
        total = total + term
        if np.all(np.abs(term) <= 1e-17 * np.abs(total)):
            break
    return 1.1283791670955126 * np.exp(-a2) * total
''',
    "gelu": '''def gelu(a):
    """x Φ(x) = x (1 + erf(x / √2)) / 2, entrywise."""
    return 0.5 * a * (1.0 + erf(a * 0.7071067811865476))
''',
    "gelu_grad": '''def gelu_grad(a):
    """GELU′(x) = Φ(x) + x φ(x), entrywise."""
    return 0.5 * (1.0 + erf(a * 0.7071067811865476)) + a * np.exp(-0.5 * a * a) * 0.3989422804014327
''',
    "gelu_tanh": '''def gelu_tanh(a):
    """x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2, entrywise."""
    return 0.5 * a * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
''',
    "gelu_tanh_grad": '''def gelu_tanh_grad(a):
    """The derivative of gelu_tanh: (1 + t) / 2 + x (1 − t²) k (1 + 3 c x²) / 2, t = tanh(k (x + c x³))."""
    t = np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * a * a)
''',
    "layer_norm": '''def layer_norm(a, eps):
    """Each row standardised: (a − mean) / √(biased variance + eps), along the last axis."""
    c = a - a.mean(axis=-1, keepdims=True)
    return c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)
''',
    "row_inv_std": '''def row_inv_std(a, eps):
    """1 / √(biased variance + eps) of each row, as a column (..., n, 1)."""
    c = a - a.mean(axis=-1, keepdims=True)
    return 1.0 / np.sqrt((c * c).mean(axis=-1, keepdims=True) + eps)
''',
}

# helpers whose source calls other helpers
HELPER_NEEDS = {"gelu": ("erf",), "gelu_grad": ("erf",)}


class NumPyMatrixPrinter(NumPyPrinter):
    """Print symattn's matrix language as batched NumPy code (``np.`` prefix)."""

    printmethod = "_symattn_numpy"
    module_alias = "np"
    helpers_table = NUMPY_HELPERS
    helper_needs = HELPER_NEEDS
    # name of the call that evaluates each entrywise node
    elementwise = {
        "exp": "np.exp",
        "log": "np.log",
        "tanh": "np.tanh",
        "sigmoid": "sigmoid",
        "gelu": "gelu",
        "gelu_tanh": "gelu_tanh",
        "gelu_grad": "gelu_grad",
        "gelu_tanh_grad": "gelu_tanh_grad",
    }

    def __init__(self, settings: dict | None = None) -> None:
        super().__init__(settings)
        self.helpers_used: set[str] = set()

    def _module_format(self, fqn: str, register: bool = True) -> str:
        if fqn.startswith("numpy."):
            fqn = self.module_alias + fqn[len("numpy") :]
        return super()._module_format(fqn, register=False)

    def helper(self, name: str) -> str:
        self.helpers_used.add(name)
        self.helpers_used.update(self.helper_needs.get(name, ()))
        return name

    def helper_source(self) -> str:
        """Source of every helper the printed expressions call, in a fixed order."""
        return "\n\n".join(self.helpers_table[k] for k in sorted(self.helpers_used))

    def _atom(self, expr: Basic) -> str:
        """expr printed so that it can stand as an operand of an operator."""
        text = self._print(expr)
        if isinstance(expr, (sp.Symbol, sp.MatrixSymbol, sp.Integer)) or text.isidentifier():
            return text
        return f"({text})"

    def _print_MatrixSymbol(self, expr: Basic) -> str:
        return str(expr.name)

    def _print_Transpose(self, expr: Basic) -> str:
        return f"{self._atom(expr.arg)}.mT"

    def _print_MatAdd(self, expr: Basic) -> str:
        return self._signed_sum(expr.args)

    def _signed_sum(self, terms: Sequence[Basic]) -> str:
        """t₁ + t₂ − t₃ …: a term with a negative coefficient printed as a subtraction."""
        text = ""
        for i, term in enumerate(terms):
            sign, rest = _split_sign(term)
            if sign < 0:
                text += ("-" if i == 0 else " - ") + self._atom(rest)
            else:
                text += ("" if i == 0 else " + ") + self._print(rest)
        return text

    def _print_MatMul(self, expr: Basic) -> str:
        scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
        mats = [a for a in expr.args if isinstance(a, MatrixExpr)]
        body = self._print_matrix_chain(mats)
        if not scalars:
            return body
        coeff = sp.Mul(*scalars)
        if coeff == -1:
            return f"-{self._atom_text(body, len(mats))}"
        coeff_text = self._atom(coeff)
        if any(isinstance(a, MatrixExpr) for a in sp.preorder_traversal(coeff)):
            # a per-batch scalar such as tr(A) has shape (...): give it the two matrix axes
            coeff_text = f"np.expand_dims({coeff_text}, (-2, -1))"
        return f"{coeff_text} * {self._atom_text(body, len(mats))}"

    @staticmethod
    def _atom_text(body: str, nfactors: int) -> str:
        return f"({body})" if nfactors > 1 and not body.startswith("(") else body

    def _print_matrix_chain(self, mats: list[Basic]) -> str:
        """A @ B @ …, with products by ones printed as row sums or broadcasts."""
        out: list[str] = []
        i = 0
        while i < len(mats):
            m = mats[i]
            if isinstance(m, OneMatrix) and out and m.shape[1] == 1:
                out[-1] = f"{self._atom_text(' @ '.join(out), len(out))}.sum(axis=-1, keepdims=True)"
                del out[:-1]
            elif isinstance(m, OneMatrix) and out and m.shape[0] == 1 and mats[i - 1].shape[1] == 1:
                prev = self._atom_text(" @ ".join(out), len(out))
                out = [self._repeat(prev, m.shape[1])]
            else:
                out.append(self._atom(m))
            i += 1
        return " @ ".join(out)

    def _repeat(self, column: str, times: Basic) -> str:
        return f"np.repeat({column}, {self._print(times)}, axis=-1)"

    def _print_HadamardProduct(self, expr: Basic) -> str:
        return " * ".join(self._atom(a) for a in expr.args)

    def _print_HadamardPower(self, expr: Basic) -> str:
        base, p = expr.args
        return f"{self._atom(base)} ** {self._atom(p)}"

    def _print_Elementwise(self, expr: Basic) -> str:
        name = self.elementwise[expr.function]
        if "." not in name:
            self.helper(name)
        return f"{name}({self._print(expr.arg)})"

    _print_Exp = _print_Log = _print_Tanh = _print_Sigmoid = _print_Elementwise

    def _print_RowSoftmax(self, expr: Basic) -> str:
        return f"{self.helper('row_softmax')}({self._print(expr.arg)})"

    def _print_RowSum(self, expr: Basic) -> str:
        return f"{self._atom(expr.arg)}.sum(axis=-1, keepdims=True)"

    def _print_SumEntries(self, expr: Basic) -> str:
        return f"{self._atom(expr.arg)}.sum(axis=(-2, -1))"

    def _print_Trace(self, expr: Basic) -> str:
        return f"np.trace({self._print(expr.arg)}, axis1=-2, axis2=-1)"

    def _print_SplitHeads(self, expr: Basic) -> str:
        return f"{self.helper('split_heads')}({self._print(expr.arg)}, {self._print(expr.heads)})"

    def _print_MergeHeads(self, expr: Basic) -> str:
        return f"{self.helper('merge_heads')}({self._print(expr.arg)}, {self._print(expr.heads)})"

    def _print_RepeatHeads(self, expr: Basic) -> str:
        return f"{self.helper('repeat_heads')}({self._print(expr.arg)}, {self._print(expr.heads)})"

    def _print_SumGroups(self, expr: Basic) -> str:
        return f"{self.helper('sum_groups')}({self._print(expr.arg)}, {self._print(expr.kv_heads)})"

    def _print_LayerNorm(self, expr: Basic) -> str:
        return f"{self.helper('layer_norm')}({self._print(expr.arg)}, {self._print(expr.eps)})"

    def _print_RowInvStd(self, expr: Basic) -> str:
        return f"{self.helper('row_inv_std')}({self._print(expr.arg)}, {self._print(expr.eps)})"

    def _print_Identity(self, expr: Basic) -> str:
        return f"np.eye({self._print(expr.shape[0])})"

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"np.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}))"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}))"


def _split_sign(term: Basic) -> tuple[int, Basic]:
    """(−1, t) for a term −t of a sum, else (1, term)."""
    if isinstance(term, MatMul) and term.args and term.args[0].is_number and term.args[0] < 0:
        rest = MatMul(-term.args[0], *term.args[1:]).doit(deep=False)
        return -1, rest
    return 1, term


EXACT_HELPERS = {
    "row_softmax": """def row_softmax(a):
    e = exp(a)
    return e / e.sum(axis=-1, keepdims=True)
""",
    "sigmoid": """def sigmoid(a):
    return 1 / (1 + exp(-a))
""",
    "split_heads": NUMPY_HELPERS["split_heads"],
    "merge_heads": NUMPY_HELPERS["merge_heads"],
    "repeat_heads": NUMPY_HELPERS["repeat_heads"],
    "sum_groups": NUMPY_HELPERS["sum_groups"],
    "exp": "exp = np.vectorize(ExpAtom, otypes=[object])\n",
    "log": "log = np.vectorize(sp.log, otypes=[object])\n",
    "tanh": "tanh = np.vectorize(sp.tanh, otypes=[object])\n",
    "gelu": "gelu = np.vectorize(lambda x: x * (1 + sp.erf(x / sp.sqrt(2))) / 2, otypes=[object])\n",
    "gelu_grad": "gelu_grad = np.vectorize(lambda x: (1 + sp.erf(x / sp.sqrt(2))) / 2"
    " + x * sp.exp(-(x**2) / 2) / sp.sqrt(2 * sp.pi), otypes=[object])\n",
    "gelu_tanh": "gelu_tanh = np.vectorize(lambda x: x * (1 + sp.tanh(sp.sqrt(2 / sp.pi)"
    " * (x + sp.Float('0.044715') * x**3))) / 2, otypes=[object])\n",
    "gelu_tanh_grad": """def _gelu_tanh_grad(x):
    k, c = sp.sqrt(2 / sp.pi), sp.Float("0.044715")
    t = sp.tanh(k * (x + c * x**3))
    return (1 + t) / 2 + x * (1 - t**2) * k * (1 + 3 * c * x**2) / 2


gelu_tanh_grad = np.vectorize(_gelu_tanh_grad, otypes=[object])
""",
    "layer_norm": """def layer_norm(a, eps):
    c = a - a.sum(axis=-1, keepdims=True) / a.shape[-1]
    root = np.vectorize(lambda v: sp.sqrt(v + eps), otypes=[object])
    return c / root((c * c).sum(axis=-1, keepdims=True) / a.shape[-1])
""",
    "row_inv_std": """def row_inv_std(a, eps):
    c = a - a.sum(axis=-1, keepdims=True) / a.shape[-1]
    root = np.vectorize(lambda v: 1 / sp.sqrt(v + eps), otypes=[object])
    return root((c * c).sum(axis=-1, keepdims=True) / a.shape[-1])
""",
}


class ExpAtom(sp.Function):
    """exp(x) kept opaque: no automatic exp(a)·exp(b) = exp(a + b), d/dx ExpAtom(x) = ExpAtom(x)."""

    def fdiff(self, argindex: int = 1) -> Basic:
        return self


class ExactPrinter(NumPyMatrixPrinter):
    """The same language for object arrays of exact SymPy numbers."""

    helpers_table = EXACT_HELPERS
    helper_needs: dict = {}  # the exact helpers call SymPy's erf themselves
    elementwise = {
        "exp": "exp",
        "log": "log",
        "tanh": "tanh",
        "sigmoid": "sigmoid",
        "gelu": "gelu",
        "gelu_tanh": "gelu_tanh",
        "gelu_grad": "gelu_grad",
        "gelu_tanh_grad": "gelu_tanh_grad",
    }

    def _module_format(self, fqn: str, register: bool = True) -> str:
        if fqn.startswith("numpy."):  # scalar functions of dims, e.g. sqrt(d_k), stay exact
            fqn = "sp" + fqn[len("numpy") :]
        return super(NumPyMatrixPrinter, self)._module_format(fqn, register=False)

    def _print_Elementwise(self, expr: Basic) -> str:
        name = self.elementwise[expr.function]
        self.helper(name)
        if name == "sigmoid":
            self.helper("exp")
        return f"{name}({self._print(expr.arg)})"

    _print_Exp = _print_Log = _print_Tanh = _print_Sigmoid = _print_Elementwise

    def _print_RowSoftmax(self, expr: Basic) -> str:
        self.helper("exp")
        return super()._print_RowSoftmax(expr)

    def _print_Identity(self, expr: Basic) -> str:
        return f"np.eye({self._print(expr.shape[0])}, dtype=int).astype(object)"

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"np.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=int).astype(object)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=int).astype(object)"

    def helper_source(self) -> str:
        order = sorted(self.helpers_used, key=lambda k: (k not in ("exp", "log", "tanh"), k))
        return "\n\n".join(self.helpers_table[k] for k in order)
