"""Code printers: SymPy matrix expressions of symattn's language as NumPy source.

``NumPyMatrixPrinter`` prints every node so that leading batch dimensions broadcast
(transpose swaps the last two axes, reductions name negative axes). Nodes NumPy has
no function for print as calls of small helpers whose source the printer hands out
(``helper_source``), so a generated module stays self-contained.
``ExactPrinter`` prints the same language for object arrays of SymPy numbers, with
opaque exp atoms, for exact rational verification.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from functools import cache
from importlib.util import find_spec
from pathlib import Path

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import MatMul, OneMatrix
from sympy.printing.numpy import NumPyPrinter

from symattn.lang.algebra import product
from symattn.lang.functions import EXACT, NUMPY
from symattn.numeric import positions
from symattn.numeric.exact_runtime import ExpAtom  # noqa: F401 (re-exported: lambdify and tests import it here)


@cache
def runtime_functions(module: str) -> dict[str, str]:
    """The source of each function and class a runtime module defines at top level (decorators included),
    by name: the helpers a printer may copy. Read from the module's file, not imported: the torch and JAX
    runtimes import torch and JAX, seconds that printing their source never needs."""
    text = Path(find_spec(module).origin).read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    return {
        node.name: "".join(lines[min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1 : node.end_lineno])
        for node in ast.parse(text).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }


def runtime_source(table: dict[str, str], names: Iterable[str]) -> str:
    """The source of the named helpers, in that order, two blank lines apart (copied from their modules)."""
    return "\n\n".join(table[name] for name in names)


NUMPY_RUNTIME = runtime_functions("symattn.numeric.numpy_runtime")  # helper name -> its source


@cache
def _names_in(source: str) -> frozenset[str]:
    """The names a helper's source reads."""
    return frozenset(n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name))


def helper_needs(runtime: dict[str, str], name: str) -> set[str]:
    """The helpers of runtime that the named helper's source calls, directly or through another one."""
    needs, todo = set(), [name]
    while todo:
        found = {n for n in _names_in(runtime[todo.pop()]) if n in runtime and n != name} - needs
        needs |= found
        todo += found
    return needs


# a name, an attribute chain or a number, maybe negated: an operand ruff format hugs ** to
_SIMPLE_OPERAND = re.compile(r"-?([A-Za-z_]\w*(\.[A-Za-z_]\w*)*|\d+(\.\d*)?)")


def power(base: str, exponent: str) -> str:
    """base ** exponent as ruff format writes it: x**2 between simple operands, (x + y) ** 2 otherwise."""
    simple = _SIMPLE_OPERAND.fullmatch(base) and _SIMPLE_OPERAND.fullmatch(exponent)
    return f"{base}**{exponent}" if simple else f"{base} ** {exponent}"


class NumPyMatrixPrinter(NumPyPrinter):
    """Print symattn's matrix language as batched NumPy code (``np.`` prefix)."""

    printmethod = "_symattn_numpy"
    module_alias = "np"
    # keyword names of a reduction: a.sum(axis=-1, keepdims=True)
    axis_keyword = "axis"
    keepdims_keyword = "keepdims"
    runtime = NUMPY_RUNTIME  # helper name -> its source in a runtime module
    backend = NUMPY  # the key of the function records' calls (``Elementwise.call``)

    def __init__(self, settings: dict | None = None) -> None:
        super().__init__(settings)
        self.helpers_used: set[str] = set()

    def _module_format(self, fqn: str, register: bool = True) -> str:
        if fqn.startswith("numpy."):
            fqn = self.module_alias + "." + fqn.removeprefix("numpy.")
        return super()._module_format(fqn, register=False)

    def helper(self, name: str) -> str:
        if name not in self.helpers_used:
            self.helpers_used.add(name)
            self.helpers_used.update(helper_needs(self.runtime, name))
        return name

    def function_call(self, call: str, operand: str) -> str:
        """A function record's call (``Elementwise.call``) applied to operand: a template with {} (or {0}, the
        operand read twice) filled in, a library function (dotted) called, a runtime helper (a bare name) called and
        its source handed out."""
        if "{" in call:
            head = call.split("(", 1)[0]
            if head.isidentifier() and head in self.runtime:  # a template calling a runtime helper: its source too
                self.helper(head)
            return call.format(operand)
        return f"{call if '.' in call else self.helper(call)}({operand})"

    def helper_source(self) -> str:
        """Source of every helper the printed expressions call, in a fixed order."""
        return runtime_source(self.runtime, sorted(self.helpers_used))

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
            sign, rest = split_sign(term)
            if sign < 0:
                text += ("-" if i == 0 else " - ") + self._atom(rest)
            else:
                text += ("" if i == 0 else " + ") + self._term(rest)
        return text

    def _term(self, expr: Basic) -> str:
        """expr printed as a term of a sum: bare, unless its text is a conditional expression (the lowest
        precedence of all), which is parenthesised."""
        return f"({self._print(expr)})" if self.is_conditional(expr) else self._print(expr)

    def is_conditional(self, expr: Basic) -> bool:
        """Does expr print as ``a if c else b``? (None here: the generated code's masked softmax does.)"""
        return False

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
                out[-1] = self.reduce_sum(self._atom_text(" @ ".join(out), len(out)), "-1", keepdims=True)
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
        return power(self._atom(base), self._atom(p))

    def _print_FunctionRecord(self, expr: Basic) -> str:
        """f(A), entrywise or row-wise, by the call its record gives this backend."""
        return self.function_call(expr.call(self.backend), self._print(expr.arg))

    def reduce_sum(self, operand: str, axis: str, keepdims: bool = False) -> str:
        """operand (printed as an atom) summed along axis, by the backend's keyword names."""
        keep = f", {self.keepdims_keyword}=True" if keepdims else ""
        return f"{operand}.sum({self.axis_keyword}={axis}{keep})"

    def _print_RowSum(self, expr: Basic) -> str:
        return self.reduce_sum(self._atom(expr.arg), "-1", keepdims=True)

    def _print_SumEntries(self, expr: Basic) -> str:
        return self.reduce_sum(self._atom(expr.arg), "(-2, -1)")

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

    def position_flavour(self, names: dict | None = None) -> positions.Flavour:
        """How this printer writes a formula of the position grids (``numeric.positions``), names: other arrays."""
        return positions.array_flavour(self.module_alias, self._print, self.position_number, self.helper, names)

    def _print_Entries(self, expr: Basic) -> str:
        """[f(i, j)] by the runtime's entries: f a lambda of the position grids (``numeric.positions``)."""
        body = positions.array_code(expr, self.position_flavour())
        rows, cols = self._print(expr.rows), self._print(expr.cols)
        return f"{self.helper('entries')}(lambda i, j: {body}, {rows}, {cols}{self.position_dtype})"

    def _print_Scatter(self, expr: Basic) -> str:
        """[Σ_{(i, j): (r, c)(i, j) = (k, l)} Wᵢⱼ]ₖₗ by the runtime's table_scatter: (r, c) a lambda of the grids."""
        index = positions.index_code(expr, self.position_flavour())
        rows, cols = (self._print(s) for s in expr.shape)
        return f"{self.helper('table_scatter')}({self._print(expr.weights)}, lambda i, j: {index}, {rows}, {cols})"

    def _print_EntriesBlock(self, expr: Basic) -> str:
        """The block of [f(i, j)] a loop over blocks of rows reads (its rows ``block``, its keys ``keys``) by the
        runtime's block_entries: f (with heads, f(i, j, h)) of the block's position grids."""
        body = positions.array_code(expr.formula, self.position_flavour())
        heads = f", heads={self._print(expr.heads)}" if expr.heads else ""
        variables = "i, j, h" if expr.heads else "i, j"
        rows = self._print(expr.source.rows)
        call = f"(lambda {variables}: {body}, block, keys, {rows}{self.position_dtype}{heads})"
        return self.helper("block_entries") + call

    def _print_ScatterBlock(self, expr: Basic) -> str:
        """The part of a table's cotangent a loop's block adds (its rows ``block``, its keys ``keys``) by the
        runtime's block_scatter: (r, c) a lambda of the block's position grids (with heads, of h too)."""
        index = positions.index_code(expr, self.position_flavour())
        variables, heads = ("i, j, h", f", heads={self._print(expr.heads)}") if expr.heads else ("i, j", "")
        rows, cols = (self._print(s) for s in expr.shape)
        where = f"{rows}, {cols}, block, keys{heads}"
        return f"{self.helper('block_scatter')}({self._print(expr.weights)}, lambda {variables}: {index}, {where})"

    position_dtype = ""  # the entries call's dtype (and device) arguments after rows and cols
    position_number = "i.dtype.type({})".format  # a number as a scalar of the grids' dtype (a where's branch)

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}))"


def split_sign(term: Basic) -> tuple[int, Basic]:
    """(−1, t) for a term −t of a sum, else (1, term)."""
    if isinstance(term, MatMul) and term.args and term.args[0].is_number and term.args[0] < 0:
        return -1, product(-term.args[0], *term.args[1:])
    return 1, term


EXACT_RUNTIME = {  # (ExpAtom is no helper: the evaluating namespace has it, so that exact values share one class)
    **{name: NUMPY_RUNTIME[name] for name in ("split_heads", "merge_heads", "repeat_heads", "sum_groups")},
    **{k: v for k, v in runtime_functions("symattn.numeric.exact_runtime").items() if k != "ExpAtom"},
}


class ExactPrinter(NumPyMatrixPrinter):
    """The same language for object arrays of exact SymPy numbers."""

    runtime = EXACT_RUNTIME
    backend = EXACT

    def _print_Elementwise(self, expr: Basic) -> str:
        """f(A) from the record's scalar f, evaluated exactly entry by entry (exp an opaque atom); a record with an
        exact call of its own (dropout's fixed mask: no scalar function) by that call."""
        if EXACT in expr.calls:
            return self._print_FunctionRecord(expr)
        parameters = "".join(f", sp.S({str(p)!r})" for p in expr.args[1:])  # exact: a record's parameters
        return f"{self.helper('entrywise')}({self._print(expr.arg)}, {expr.function!r}{parameters})"

    def _module_format(self, fqn: str, register: bool = True) -> str:
        if fqn.startswith("numpy."):  # scalar functions of dims, e.g. sqrt(d_k), stay exact
            fqn = "sp." + fqn.removeprefix("numpy.")
        return super(NumPyMatrixPrinter, self)._module_format(fqn, register=False)

    def _print_Rational(self, expr: Basic) -> str:
        """p/q as a SymPy Rational: Python's p/q would be a float, and exact values would become Floats."""
        return f"sp.Rational({expr.p}, {expr.q})"

    def _print_Identity(self, expr: Basic) -> str:
        return f"np.eye({self._print(expr.shape[0])}, dtype=int).astype(object)"

    def _print_OneMatrix(self, expr: Basic) -> str:
        return f"np.ones(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=int).astype(object)"

    def _print_ZeroMatrix(self, expr: Basic) -> str:
        return f"np.zeros(({self._print(expr.shape[0])}, {self._print(expr.shape[1])}), dtype=int).astype(object)"

    def _print_Entries(self, expr: Basic) -> str:
        return positions.exact_code(expr, self._print, self.helper)

    def _print_Scatter(self, expr: Basic) -> str:
        index = positions.index_code(expr, positions.exact_flavour(self._print, self.helper))
        rows, cols = (self._print(s) for s in expr.shape)
        return f"{self.helper('table_scatter')}({self._print(expr.weights)}, lambda _i, _j: {index}, {rows}, {cols})"
