"""What every generated module's printer shares (``GeneratedCodeMixin``, on ``NumPyMatrixPrinter``).

The backends' printers (``numpy_backend``, ``torch_backend``, ``jax_backend``) print batched code:
transpose swaps the last two axes (``.mT``), reductions name negative axes, multi-head blocks are a
reshape to (…, H, n, d_k). On top of ``NumPyMatrixPrinter`` they print

- a broadcast u 𝟏ᵀ (or 𝟏 vᵀ) inside a sum or an entrywise product as u alone, so
  P ⊙ (dP − rowsum(dP ⊙ P) 𝟏ᵀ) makes no n × m array of row sums;
- what the statement's plan (``schedule.plan``) decided: the dying array a value is computed into, the order
  of a product and the factor its scalar multiplies (scale·Q Kᵀ is (scale·Q) Kᵀ);
- a weight's gradient Lᵀ R, summed over the batch, as one product of the
  flattened rows, rows(L)ᵀ rows(R);
- rowsum(X ⊙ Y) as one row-wise dot product where the backend has one (NumPy's vecdot: no X ⊙ Y array).

Each backend's printer adds its module's names (``np``, ``torch``, ``jnp``) and in-place forms.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import HadamardProduct, MatAdd, MatMul, OneMatrix, Transpose

from symattn.codegen.schedule.chains import split_ones
from symattn.codegen.schedule.plan import (
    AT_CALL,
    NARROW,
    NO_BUFFERS,
    WIDE,
    Plan,
    broadcast_column,
    cheapest_tree,
    precision,
    scaled_factor,
)
from symattn.codegen.schedule.rowblocks import END_ROW, FIRST_ROW
from symattn.errors import SymattnError, UnsupportedNodeError
from symattn.lang.algebra import factors
from symattn.lang.graph import matrix_symbols
from symattn.lang.ops import RowWise
from symattn.lang.piecewise import literal
from symattn.numeric import positions
from symattn.numeric.positions import bound_code
from symattn.numeric.printers import (
    power,
    runtime_source,
    split_sign,
)
from symattn.optimize.mask_structure import key_window, of_sizes, pure_mask
from symattn.optimize.position_blocks import SEED, EntriesBlock

# SymPy functions of a trainable scalar (exp(τ), log(τ), …): SymPy's printer names them numpy.exp, …, which the
# torch and jax printers name by their own module (the scalar is a 0-d tensor or array there)
SCALAR_FUNCTIONS = ("exp", "log", "tanh", "sqrt", "sin", "cos", "abs")
# ... and those of a number made of the sizes alone (log n: its symbols integers, Python ints in the generated code):
# Python's math by the runtime helper size_math, since the array libraries' functions take arrays (torch.log of an
# int raises) and their scalars carry a dtype (NumPy's float64 would widen a float32 run)
SIZE_FUNCTIONS = ("exp", "log", "tanh", "sin", "cos")


class GeneratedCodeMixin:
    """Printing for generated modules: broadcasts, scalar placement, weight gradients."""

    def _atom(self, expr: Basic) -> str:
        if isinstance(expr, Transpose) and isinstance(expr.arg, sp.MatrixSymbol):
            return self._print(expr)
        return super()._atom(expr)

    def _size_function(self, expr: Basic, name: str) -> str:
        """name(x) (SIZE_FUNCTIONS): by Python's math where x is made of sizes and numbers, else the library's."""
        if all(symbol.is_integer for symbol in expr.free_symbols):
            return f'{self.helper("size_math")}("{name}", {self._print(expr.args[0])})'
        return getattr(super(), f"_print_{name}")(expr)

    def _print_Mul(self, expr: Basic) -> str:
        # spaces around scalar operators, as ruff format writes them: H * d_k
        text = super()._print_Mul(expr)
        return re.sub(r"\s*(?<!\*)([*/])(?![*/])\s*", r" \1 ", text)

    inplace = True  # values may be written into dying arrays (build_context: Backend.mutable, unless told not to)
    plan = NO_BUFFERS  # the statement's buffer decisions (schedule.plan), while it prints

    @contextmanager
    def planned(self, plan: Plan) -> Iterator[None]:
        """Print by plan within the block."""
        self.plan = plan
        try:
            yield
        finally:
            self.plan = NO_BUFFERS

    def _inplace(self, expr: Basic, operation: str, terms: list[tuple[str, Basic]]) -> str | None:
        """expr computed into the dying array the plan gives it: the root term first, then each other term
        folded in."""
        buffer = self.plan.buffer(expr)
        if buffer is None:
            return None
        root = self.plan.root(expr, terms, operation)
        text = self._print(root)
        for op, term in terms:
            if term is root:
                continue
            text = self.inplace_operation(op, text, self._print(broadcast_column(term) or term), buffer)
        return text

    def inplace_operation(self, op: str, target: str, operand: str, buffer: str) -> str:
        """target op operand, written into buffer (NumPy: out=)."""
        return f"np.{op}({target}, {operand}, out={buffer})"

    # Names of inputs that may be None at run time (biases, the mask): their terms are added only when given.
    optional: frozenset = frozenset()
    # The name of the additive mask, when there is one: softmax then copes with rows of -inf.
    mask: str | None = None
    # Whether rows may hold −inf whatever the arguments (a matrix of positions' −∞ entries): the masked forms always.
    masked_rows: bool = False
    block_maps: dict = {}  # a mask on data's formula → its loop's block map (``emit.block_maps``), while it prints

    def _hidden(self, scores: str, mask: EntriesBlock, fresh: bool) -> str:
        """scores plus a block of a mask of positions (0, or −∞ where its condition holds) by the runtime's hide_keys:
        −∞ written where the condition holds, looked for only on the keys outside the block's open range (those
        every row of the block sees, ``optimize.mask_structure``)."""
        window = key_window(mask.formula, FIRST_ROW, END_ROW, mask.shape[1])
        rows = {FIRST_ROW: "block.start", END_ROW: f"min(block.stop, {self._print(mask.source.rows)})"}
        open_keys = "slice(0, 0)"  # (a window that reads the head: no range open to every head)
        if of_sizes(window, FIRST_ROW, END_ROW):
            open_keys = f"slice({bound_code(window.open_lo, rows)}, {bound_code(window.open_hi, rows)})"
        condition = positions.array_code(pure_mask(mask.formula), self.position_flavour())
        variables = "i, j, h" if mask.heads else "i, j"
        heads = f", heads={self._print(mask.heads)}" if mask.heads else ""
        arguments = f"{scores}, lambda {variables}: {condition}, block, keys, {self._print(mask.source.rows)}"
        blocks = f", blocks={self.block_maps[mask.formula]}" if mask.formula in self.block_maps else ""
        call = f"({arguments}, {open_keys}{self.position_dtype}{heads}, inplace={fresh}{blocks})"
        return self.helper("hide_keys") + call

    def _optional_term(self, term: Basic) -> bool:
        value = broadcast_column(term) or term
        return isinstance(value, sp.MatrixSymbol) and str(value.name) in self.optional

    def _print_MatAdd(self, expr: Basic) -> str:
        hiding = [t for t in expr.args if isinstance(t, EntriesBlock) and pure_mask(t.formula) is not None]
        if hiding and len(hiding) < len(expr.args):  # scores + a mask of positions: −∞ written into the scores
            rest = [t for t in expr.args if t not in hiding]
            scores = rest[0] if len(rest) == 1 else MatAdd(*rest)
            text = self._print(scores)
            for mask in hiding:  # (in place into a value made here: a product, a sum)
                text = self._hidden(text, mask, self.inplace and not isinstance(scores, sp.MatrixSymbol))
            return text
        optional = [t for t in expr.args if self._optional_term(t)]
        if optional:
            rest = [t for t in expr.args if t not in optional]
            text = self._print(rest[0] if len(rest) == 1 else MatAdd(*rest))
            for term in optional:
                text = f"{self.helper('add_optional')}({text}, {self._print(broadcast_column(term) or term)})"
            return text
        ones = [t for t in expr.args if _is_ones(t, expr.shape)]
        if ones and len(ones) < len(expr.args) and any(broadcast_column(t) is None for t in expr.args if t not in ones):
            # c 𝟏𝟏ᵀ + X: the scalar c broadcast (no ones array: cheaper, and it keeps X's dtype)
            rest = [t for t in expr.args if t not in ones]
            scalar = sp.Add(*(factors(t)[0] for t in ones))
            return self._signed_sum([scalar, *(broadcast_column(t) or t for t in rest)])
        full = [t for t in expr.args if broadcast_column(t) is None]
        terms = sorted(expr.args, key=lambda t: split_sign(t)[0] < 0)  # dP - D, not -D + dP
        signed = [("add" if split_sign(t)[0] > 0 else "subtract", split_sign(t)[1]) for t in terms]
        inplace = self._inplace(expr, "add", signed) if full else None
        if inplace is not None:
            return inplace
        if full:
            terms = [broadcast_column(term) or term for term in terms]
        return self._signed_sum(terms)

    def _print_HadamardProduct(self, expr: Basic) -> str:
        full = [a for a in expr.args if broadcast_column(a) is None]
        inplace = self._inplace(expr, "multiply", [("multiply", a) for a in expr.args]) if full else None
        if inplace is not None:
            return inplace
        args = [broadcast_column(a) or a for a in expr.args] if full else expr.args
        return " * ".join(self._atom(a) for a in args)

    # the function of two arrays that sums their entrywise product along the last axis, without making it (None:
    # the product made, then summed; XLA fuses the two, and torch's vecdot makes the product anyway)
    row_dot_function: str | None = None

    def _print_RowSum(self, expr: Basic) -> str:
        """rowsum(X ⊙ Y) of full-shape X, Y as one row-wise dot product: no temporary of X's size."""
        text = self._row_dot(expr.arg)
        return super()._print_RowSum(expr) if text is None else text

    def _row_dot(self, arg: Basic) -> str | None:
        """rowsum(arg) as one row dot, arg = X ⊙ Y of full-shape X, Y (None: not such an arg, or no row dot)."""
        if (
            self.row_dot_function is None
            or not isinstance(arg, HadamardProduct)
            or any(broadcast_column(a) is not None or a.shape != arg.shape for a in arg.args)
        ):
            return None
        *rest, last = arg.args
        first = self._print(rest[0]) if len(rest) == 1 else self._print(HadamardProduct(*rest))
        return self.row_dot(first, self._print(last))

    def row_dot(self, first: str, last: str) -> str:
        """The row dot of the arrays printed as first and last, as a column (a runtime helper's own: a column)."""
        if self.row_dot_function in self.runtime:
            return f"{self.helper(self.row_dot_function)}({first}, {last})"
        return f"{self.row_dot_function}({first}, {last})[..., None]"

    def _print_Elementwise(self, expr: Basic) -> str:
        if hasattr(expr, "draws"):  # a random record: its generated draws, where the backend has them
            if self.backend not in expr.draws:
                drawn = [f"{expr.function} in {b}" for b in expr.draws]
                raise UnsupportedNodeError(expr, f"generated {self.backend} code (no draws of it there yet)", drawn)
            return self.function_call(expr.drawing_call(self.backend), self._print(expr.arg))
        buffer = self.plan.buffer(expr.arg) if expr.arg.shape == expr.shape else None
        if buffer is None or not expr.inplace:  # ufuncs with out= / in-place methods
            return super()._print_FunctionRecord(expr)
        return self.inplace_function(expr.call(self.backend), self._print(expr.arg), buffer)

    def _print_DropoutBlock(self, expr: Basic) -> str:
        """A block of rows of dropout's mask in a loop over blocks of rows: drawn from the call's seed, the mask's
        stream and the block's first row (the runtime's dropout_block), over every key, read at the loop's keys."""
        p, stream = expr.args[1:]
        where = f"{SEED}, {stream}, block, keys, {self._print(expr.shape[1])}"
        return f"{self.helper('dropout_block')}({self._print(expr.arg)}, {literal(p)}, {where})"

    def inplace_function(self, function: str, operand: str, buffer: str) -> str:
        """function(operand) written into buffer."""
        return f"{function}({operand}, out={buffer})"

    def _print_BlockMatrix(self, expr: Basic) -> str:
        """[A | B | …] (one row of blocks) or [A; B; …] (one column), concatenated."""
        blocks = expr.blocks
        if blocks.shape[0] == 1:
            return self.concatenate([self._print(b) for b in blocks], axis=-1)
        if blocks.shape[1] == 1:
            return self.concatenate([self._print(b) for b in blocks], axis=-2)
        rows = [self.concatenate([self._print(b) for b in blocks.row(i)], axis=-1) for i in range(blocks.shape[0])]
        return self.concatenate(rows, axis=-2)

    # the function that joins arrays along an axis
    concatenate_function = "np.concatenate"

    def concatenate(self, parts: list[str], axis: int) -> str:
        return f"{self.concatenate_function}([{', '.join(parts)}], {self.axis_keyword}={axis})"

    def concatenate_rows(self, blocks: str) -> str:
        """The blocks of rows in the list called blocks, stacked back into one array (one block: itself, no copy)."""
        return f"{blocks}[0] if len({blocks}) == 1 else {self.concatenate_function}({blocks}, {self.axis_keyword}=-2)"

    def placed_rows(self, name: str) -> str:
        """What a value put_rows placed block by block becomes after the loop ("": it is complete as it is)."""
        return ""

    def mask_gradient(self, value: str, heads: bool) -> str:
        """∂f/∂M from the scores' cotangent (value), summed over the axes M (mask_shape) was broadcast along."""
        return f"{self.helper('sum_to_mask')}({value}, mask_shape{', heads=True' if heads else ''})"

    def zeros_like(self, name: str) -> str:
        """Zeros of the shape, dtype (and device) of the array called name."""
        return f"{self.module_alias}.zeros_like({name})"

    def column_sums(self, text: str) -> str:
        """𝟏ᵀ X: the sums of X's columns, as a row."""
        return self.reduce_sum(text, "0", keepdims=True)

    def runtime_source(self, names: list[str]) -> str:
        """The source of the named runtime helpers (input checks, masks), in that order."""
        return runtime_source(self.runtime, names)

    def _print_MatrixSlice(self, expr: Basic) -> str:
        parent, rows, cols = expr.args
        return f"{self._atom(parent)}[..., {self._slice(rows, parent.shape[0])}, {self._slice(cols, parent.shape[1])}]"

    def _slice(self, bounds: tuple, size: Basic) -> str:
        """start:stop as ruff format writes it (spaces around : when a bound is not a name or number)."""
        start, stop, step = bounds
        if step != 1:
            raise SymattnError(f"cannot print a strided slice {bounds}")
        start_text = "" if start == 0 else self._print(start)
        stop_text = "" if sp.expand(stop - size) == 0 else self._print(stop)
        simple = all(isinstance(b, (sp.Symbol, sp.Integer)) for b, t in ((start, start_text), (stop, stop_text)) if t)
        return f"{start_text}:{stop_text}" if simple else f"{start_text} : {stop_text}".strip()

    def is_conditional(self, expr: Basic) -> bool:
        return isinstance(expr, RowWise) and self.mask is not None and not self.masked_rows

    def _print_RowWise(self, expr: Basic) -> str:
        """f(A) row by row, into A when it dies here and the call takes out=; with a mask, the masked form
        (rows of −inf) unless the mask is None at run time."""
        arg = self._print(expr.arg)
        if expr.inplace and isinstance(expr.arg, sp.MatrixSymbol) and self.plan.buffer(expr.arg) == arg:
            arg = f"{arg}, out={arg}"
        plain = self.function_call(expr.call(self.backend), arg)
        if self.masked_rows:
            return self.function_call(expr.masked_call(self.backend), arg)
        if self.mask is None:
            return plain
        return f"{plain} if {self.mask} is None else {self.function_call(expr.masked_call(self.backend), arg)}"

    def _print_MatMul(self, expr: Basic) -> str:
        scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
        mats = [a for a in expr.args if isinstance(a, MatrixExpr)]
        coeff = sp.Mul(*scalars)
        if coeff == 1:
            return self._print_matrix_chain(mats)
        coeff_text = self._atom(coeff)
        if any(isinstance(a, MatrixExpr) for a in sp.preorder_traversal(coeff)):
            coeff_text = self.batch_scalar(coeff_text)  # tr(A) of a batch has shape (...): add the matrix axes
        if len(mats) < 2 or any(isinstance(m, OneMatrix) for m in mats):
            body = self._print_matrix_chain(mats)
            if coeff == -1:
                return f"-{self._atom_text(body, len(mats))}"
            return f"{coeff_text} * {self._atom_text(body, len(mats))}"
        smallest = scaled_factor(mats)
        factor = mats[smallest]
        inner = factor.arg if isinstance(factor, Transpose) else factor
        scaled = f"{coeff_text} * {self._atom(inner)}" if coeff != -1 else f"-{self._atom(inner)}"
        scaled = f"({scaled}).mT" if isinstance(factor, Transpose) else f"({scaled})"
        if cheapest_tree(mats) == AT_CALL:
            return self.chain([scaled if i == smallest else self._print(m) for i, m in enumerate(mats)])
        return self._join_product(mats, [scaled if i == smallest else self._atom(m) for i, m in enumerate(mats)])

    # The runtime helpers of 16-bit precision (None: plain a @ b), by the product's ``precision`` (schedule.plan):
    # WIDE's float32 result (Q Kᵀ, dP = dO Vᵀ), NARROW's n × m operand rounded once, right before (P V, dS K).
    wide_product: str | None = None
    narrow_product: str | None = None
    # the runtime helper of a sum over blocks of rows, total = block_sum(total, part), that sums 16-bit parts in
    # float32 and rounds the sum once (None: total += part, or total = total + part for immutable arrays)
    block_sum: str | None = None

    weights: frozenset = frozenset()  # the spec's weights by name: a product with one is a projection (precision)

    def _join_product(self, mats: list[Basic], texts: list[str]) -> str:
        """The product of the factors mats, printed as texts: left to right (two factors of an n × m array, by
        the precision helpers)."""
        helpers = {WIDE: self.wide_product, NARROW: self.narrow_product}
        helper = helpers.get(precision(*mats, self.weights)) if len(mats) == 2 else None
        if helper is not None:
            return f"{self.helper(helper)}({_unwrapped(texts[0])}, {_unwrapped(texts[1])})"
        return " @ ".join(texts)

    def _print_matrix_chain(self, mats: list[Basic]) -> str:
        """F₁ @ F₂ @ … in the order the plan gives (``cheapest_tree``). A k × c block of ones is 𝟏_k 𝟏_cᵀ (a row
        sum, then a broadcast): A B 𝟏𝟏ᵀ is A (B 𝟏) 𝟏ᵀ, no ones array and no n × n product. With the precision
        helpers, (X ⊙ Y) 𝟏, the derivation's D = (O ⊙ dO) 𝟏, is the row dot rowsum(X ⊙ Y) (a float32 statistic)."""
        if self.narrow_product is not None and len(mats) == 2 and isinstance(mats[1], OneMatrix):
            text = self._row_dot(mats[0]) if mats[1].shape[1] == 1 else None
            if text is not None:
                return text
        mats = [part for m in mats for part in split_ones(m)]
        if len(mats) == 2 and not any(isinstance(m, OneMatrix) for m in mats):
            return self._join_product(mats, [self._atom(m) for m in mats])
        tree = cheapest_tree(mats)
        if tree is None:
            return super()._print_matrix_chain(mats)
        if tree == AT_CALL:
            return self.chain([self._print(m) for m in mats])
        return self._print_tree(tree)

    def chain(self, texts: list[str]) -> str:
        """The product of the factors printed as texts, ordered at call time from their shapes (runtime chain)."""
        return f"{self.helper('chain')}({', '.join(texts)})"

    def _print_tree(self, tree: Basic) -> str:
        """A binary tree of products: each node a product of two operands (subtrees print themselves); one that
        reads an n × m array by the narrowing helper."""
        if self.narrow_product is not None and len(tree.args) == 2 and precision(*tree.args) == NARROW:
            return self._join_product(list(tree.args), [self._atom(a) for a in tree.args])
        return super()._print_matrix_chain(list(tree.args))

    def batch_scalar(self, text: str) -> str:
        """A per-batch scalar (shape (...)) as an array that broadcasts against matrices."""
        return f"np.expand_dims({text}, (-2, -1))"

    # Scalars print as Python arithmetic: a Python float keeps a float32 array float32 (NEP 50).
    def _print_Pow(self, expr: Basic, rational: bool = False) -> str:
        base, p = expr.args
        if isinstance(base, MatrixExpr):
            return super()._print_Pow(expr, rational)
        if p == sp.Rational(1, 2):
            return power(self._atom(base), "0.5")
        if p == -sp.Rational(1, 2):
            return f"1 / {power(self._atom(base), '0.5')}"
        if p == -1:
            return f"1 / {self._atom(base)}"
        return power(self._atom(base), self._atom(p))

    def _print_Rational(self, expr: Basic) -> str:
        return f"{expr.p} / {expr.q}"

    def _print_Half(self, expr: Basic) -> str:
        return "0.5"

    def _print_Float(self, expr: Basic) -> str:
        return repr(float(expr))

    def _print_Pi(self, expr: Basic) -> str:
        return "3.141592653589793"

    def weight_gradient(self, expr: Basic, batched: set) -> str:
        """expr summed over the leading batch dimensions of its batched operands."""
        coeff, mats = 1, [expr]
        if isinstance(expr, MatMul):
            coeff = sp.Mul(*(a for a in expr.args if not isinstance(a, MatrixExpr)))
            mats = [a for a in expr.args if isinstance(a, MatrixExpr)]
        if any(isinstance(a, MatrixExpr) for a in sp.preorder_traversal(coeff)):  # tr(A)·…: one scalar a batch
            return f"{self.helper('sum_batch')}({self._print(expr)})"
        ones_around = len(mats) == 3 and isinstance(mats[0], OneMatrix) and isinstance(mats[2], OneMatrix)
        if ones_around and expr.shape == (1, 1):  # (𝟏ᵀ M 𝟏_{1×d}, M a column, is a row: summed as any value below)
            body = f"{self._atom(mats[1])}.sum()"  # 𝟏ᵀ M 𝟏 over the batch: a trainable scalar's gradient, 0-d
            return body if coeff == 1 else f"{self._atom(coeff)} * {body}"
        if len(mats) == 2 and isinstance(mats[0], OneMatrix) and mats[0].shape[0] == 1 and coeff == 1:
            if _batched(mats[1], batched):  # 𝟏ᵀ X: the column sums of every row of the batch
                return self.column_sums(f"{self.helper('rows')}({self._print(mats[1])})")
            return self.column_sums(self._print(mats[1]))
        if len(mats) == 2 and isinstance(mats[0], Transpose) and all(_batched(m, batched) for m in mats):
            rows = self.helper("rows")
            body = f"{rows}({self._print(mats[0].arg)}).mT @ {rows}({self._print(mats[1])})"
            return body if coeff == 1 else f"{self._atom(coeff)} * ({body})"
        if not _batched(expr, batched):
            return self._print(expr)
        return f"{self.helper('sum_batch')}({self._print(expr)})"


for _name in SIZE_FUNCTIONS:  # _print_log, …: SymPy's printer dispatches on the function's class name
    setattr(GeneratedCodeMixin, f"_print_{_name}", lambda self, expr, _name=_name: self._size_function(expr, _name))


def _unwrapped(text: str) -> str:
    """text without brackets around all of it ((c * Q) → c * Q): an argument needs none."""
    if not (text.startswith("(") and text.endswith(")")):
        return text
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and i < len(text) - 1:
            return text  # (a) @ (b): the first bracket closes early
    return text[1:-1]


def _is_ones(term: Basic, shape: tuple) -> bool:
    """Is term c 𝟏𝟏ᵀ (a scalar c) of the given shape?"""
    coeff, mats = factors(term)
    return len(mats) == 1 and isinstance(mats[0], OneMatrix) and mats[0].shape == shape and not coeff.free_symbols


def _batched(expr: Basic, batched: set) -> bool:
    return any(str(s.name) in batched for s in matrix_symbols(expr))
