"""Math notation for symattn's expression language: LaTeX and plain unicode text.

One structural printer, two notations. Identifiers become the seeds' names
(``W_Q`` → W^{Q}, ``d_k`` → d_k, ``bar_P`` → \\bar{P}, per-head ``Q_h`` → Q_{h});
``SplitHeads(Q W_Q)`` prints as the head block Q W^{Q}_{h}, ``MergeHeads`` as
Concat_h. SymPy's own LaTeX gets several nodes wrong (``OneMatrix`` as 1,
``Identity`` as \\mathbb{I}, entrywise exp as a lambda); here 𝟏 is \\mathbf{1}
(𝟏, 𝟏ᵀ or 𝟏𝟏ᵀ by shape), I is I and exp(A) is \\exp(A).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sympy as sp
from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import (
    HadamardPower,
    HadamardProduct,
    Identity,
    MatAdd,
    MatMul,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)
from sympy.matrices.expressions.matexpr import MatrixElement
from sympy.printing.printer import Printer

from symattn.autodiff.differentials import Differential, ScalarDifferential
from symattn.errors import UnsupportedNodeError
from symattn.lang.algebra import product
from symattn.lang.functions import FunctionRecord
from symattn.lang.graph import sort_key
from symattn.lang.ops import (
    LayerNorm,
    MergeHeads,
    RepeatHeads,
    RowInvStd,
    RowSum,
    SplitHeads,
    SumEntries,
    SumGroups,
)
from symattn.lang.positions import Entries, Scatter


@dataclass(frozen=True)
class Notation:
    """The tokens of one notation."""

    transpose: str
    hadamard: str
    minus: str
    left: str
    right: str
    one: str
    trace: str
    concat: str
    differential: str
    head: str
    sum_heads: str
    product: str = " "  # between the factors of a matrix product


LATEX = Notation(
    transpose="^{T}",
    hadamard=r" \odot ",
    minus=" - ",
    left="(",  # plain parentheses: a long line may break inside them (\left( … \right) may not)
    right=")",
    one=r"\mathbf{1}",
    trace=r"\operatorname{tr}",
    concat=r"\operatorname{Concat}_{h}",
    differential=r"\mathrm{d}",
    head="_{h}",
    sum_heads=r"\sum_{h} ",
    product=r"\,",  # P\,\mathrm{d}X\,W^{V}: a thin space, as textbooks set products of matrices
)

TEXT = Notation(
    transpose="ᵀ",
    hadamard=" ⊙ ",
    minus=" − ",
    left="(",
    right=")",
    one="𝟏",
    trace="tr",
    concat="Concat_h",
    differential="d",
    head="_h",
    sum_heads="Σ_h ",
)


BREAK = "\x01"  # where a long line may break (before a binary operator, between factors); see ``breaks``

GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "lambda", "mu", "sigma", "tau")  # gamma_1 → \gamma_{1}


def latex_name(identifier: str) -> str:
    """W_Q → W^{Q}, d_k → d_{k}, d_model → d_{\\text{model}}, Q_h → Q_{h}, bar_P → \\bar{P}, P1 → P_{1}."""
    bar = identifier.startswith("bar_")
    if bar:
        identifier = identifier[4:]
    head, _, tail = identifier.partition("_")
    numbered = re.fullmatch(r"([A-Za-z])(\d+)", head)  # P1 → P_{1}, as a textbook numbers matrices
    if numbered and not tail:
        head, tail = numbered.groups()
    base = head if len(head) == 1 else (rf"\{head}" if head in GREEK else rf"\mathrm{{{head}}}")
    if bar:
        base = rf"\bar{{{base}}}"
    if not tail:
        return base
    if head == "W" and re.fullmatch(r"[A-Z]", tail):
        return f"{base}^{{{tail}}}"
    if head == "W" and re.fullmatch(r"[A-Z]_h", tail):
        return f"{base}^{{{tail[0]}}}_{{h}}"
    if len(tail) == 1 or tail.isdigit():
        return f"{base}_{{{tail}}}"
    return rf"{base}_{{\text{{{tail}}}}}"


def text_name(identifier: str) -> str:
    """The identifier itself, a cotangent bar_P as P̄ (combining macron)."""
    if identifier.startswith("bar_"):
        rest = identifier[4:]
        return rest[0] + "\u0304" + rest[1:]
    return identifier


class MathPrinter(Printer):
    """Prints matrix expressions of symattn's language in one notation (SymPy's dispatch: ``_print_<Class>``)."""

    printmethod = "_symattn_math"
    _default_settings = {**Printer._default_settings, "notation": TEXT, "breaks": False}

    def __init__(self, notation: Notation = TEXT, settings: dict | None = None) -> None:
        """settings["breaks"]: mark with BREAK each place a long line may break (for ``breaks``)."""
        super().__init__({**(settings or {}), "notation": notation})
        self.n = self._settings["notation"]
        self.brk = BREAK if self._settings["breaks"] else ""

    def emptyPrinter(self, expr: Basic) -> str:
        """A node no ``_print_<Class>`` method prints."""
        raise UnsupportedNodeError(expr, "printing", [m[7:] for m in dir(self) if m.startswith("_print_")])

    def trace(self, matrix: Basic, per_head: bool = False) -> str:
        """tr(M), or Σ_h tr(M) for a matrix that holds one block per head."""
        body = f"{self.n.trace}{self.n.left}{self._print(matrix)}{self.n.right}"
        return self.n.sum_heads + body if per_head else body

    def name(self, identifier: str) -> str:
        return latex_name(identifier) if self.n is LATEX else text_name(identifier)

    def scalar(self, expr: Basic) -> str:
        if expr.has(SumEntries, Trace, ScalarDifferential):  # a coefficient dτ or sum(Ā ⊙ S): printed by node
            return self._print(expr)
        expr, reads = self._reads(expr)
        if self.n is LATEX:  # dimensions by the same names as matrices: d_model → d_{\text{model}}
            names = {s: latex_name(s.name) for s in expr.free_symbols if isinstance(s, sp.Symbol)}
            text = sp.latex(expr, symbol_names=names | reads)
            return text.replace(r"\frac{", r"\tfrac{")  # as tall as the matrices beside it
        text = sp.sstr(expr)
        text = re.sub(r"\bpi\b", "π", text)
        text = re.sub(r"sqrt\((\w+)\)", r"√\1", text)
        return text.replace("**", "^").replace("*", "·")

    def _reads(self, expr: Basic) -> tuple[Basic, dict[sp.Symbol, str]]:
        """expr with each table read b[r, c] a symbol printed b_{r, c} in LaTeX, b[r, c] in text (its name)."""
        reads = {}
        for read in sorted(expr.atoms(MatrixElement), key=sp.default_sort_key):
            table, (row, col) = self._print(read.parent), (self.scalar(x) for x in read.indices)
            text = rf"{{{table}}}_{{{row},\, {col}}}" if self.n is LATEX else f"{table}[{row}, {col}]"
            reads[read] = sp.Symbol(text)
        return expr.xreplace(reads), {s: s.name for s in reads.values()}

    def paren(self, text: str) -> str:
        return f"{self.n.left}{text}{self.n.right}"

    def operand(self, expr: Basic, wrap: tuple[type, ...]) -> str:
        text = self._print(expr)
        return self.paren(text) if isinstance(expr, wrap) else text

    # Leaves.

    def _print_Expr(self, expr: Basic) -> str:  # a scalar (dimension, number)
        return self.scalar(expr)

    def _print_MatrixSymbol(self, expr: MatrixSymbol) -> str:
        return self.name(str(expr.name))

    def _print_Entries(self, expr: Entries) -> str:
        """A matrix of positions as its entry formula: [−|i − j|/2]ᵢⱼ, \\left[…\\right]_{ij} in LaTeX."""
        formula = self.scalar(expr.formula)
        if self.n is LATEX:
            return rf"\left[{formula}\right]_{{i j}}"
        return f"[{formula}]ᵢⱼ"

    def _print_Scatter(self, expr: Scatter) -> str:
        """The transpose of a table read, in closed form: [Σ_{(i, j): (r, c) = (k, l)} (W)ᵢⱼ]ₖₗ."""
        row, col = (self.scalar(sp.sympify(x)) for x in expr.index)
        weights = self.paren(self._print(expr.weights))
        if self.n is LATEX:
            where = rf"(i, j):\, ({row},\, {col}) = (k, l)"
            return rf"\left[\sum_{{{where}}} {weights}_{{i j}}\right]_{{k l}}"
        return f"[Σ_{{(i, j): ({row}, {col}) = (k, l)}} {weights}ᵢⱼ]ₖₗ"

    def _print_OneMatrix(self, expr: OneMatrix) -> str:
        rows, cols = expr.shape
        if cols == 1:
            return self.n.one
        if rows == 1:
            return self.n.one + self.n.transpose
        return self.n.one + (self.n.product if self.n is LATEX else "") + self.n.one + self.n.transpose

    def _print_Identity(self, expr: Identity) -> str:
        return "I"

    def _print_ZeroMatrix(self, expr: ZeroMatrix) -> str:
        return "0"

    # Linear structure.

    def superscripted(self, expr: Basic) -> str:
        """expr ready to take a superscript: a plain symbol (or its differential) as is, else in parentheses."""
        text = self._print(expr)
        if isinstance(expr, FunctionRecord):  # f(A)ᵀ: the call's parenthesis bounds it
            return text
        plain = isinstance(expr, MatrixSymbol) or (
            isinstance(expr, Differential) and isinstance(expr.arg, MatrixSymbol)
        )
        if plain and (self.n is TEXT or "^" not in text):  # W^{Q}^{T} would be a double superscript
            return text
        return self.paren(text)

    def _print_Transpose(self, expr: Transpose) -> str:
        return self.superscripted(expr.arg) + self.n.transpose

    def _print_MatMul(self, expr: MatMul) -> str:
        coeff, mats = _coefficient(expr)
        body = (self.brk + self.n.product).join(self.operand(m, (MatAdd, HadamardProduct, MatMul)) for m in mats)
        if coeff == 1:
            return body
        if coeff == -1:
            return "-" + body
        if self.n is LATEX:
            return f"{self.scalar(coeff)}{self.n.product}{body}"
        if coeff.is_Integer or coeff.is_Symbol:
            return f"{self.scalar(coeff)} {body}"
        return f"({self.scalar(coeff)}) {body}"

    def _print_MatAdd(self, expr: MatAdd) -> str:
        terms = sorted(expr.args, key=lambda t: _is_negative(t))  # positive terms first
        text = ""
        for i, term in enumerate(terms):
            if _is_negative(term):
                negated = product(-1, term)  # SymPy's -term would re-canonicalise term deep
                text += (self.brk + self.n.minus if i else "-") + self.operand(negated, (MatAdd,))
            else:
                text += (self.brk + " + " if i else "") + self._print(term)
        return text

    def _print_Trace(self, expr: Trace) -> str:
        return self.trace(expr.arg)

    def _print_Mul(self, expr: Basic) -> str:
        if not expr.has(SumEntries, Trace, ScalarDifferential):
            return self.scalar(expr)
        # a trainable scalar's terms: c · sum(Ā ⊙ S) · dτ, the plain scalar first, the differential last
        plain = sp.Mul(*(a for a in expr.args if not a.has(SumEntries, Trace, ScalarDifferential)))
        parts = sorted((a for a in expr.args if a.has(SumEntries, Trace, ScalarDifferential)), key=_differential_last)
        texts = [self.paren(self._print(a)) if isinstance(a, sp.Add) else self._print(a) for a in parts]
        sign = "-" if plain == -1 else "" if plain == 1 else self.paren(self.scalar(plain)) if plain.is_Add else None
        head = [self.scalar(plain)] if sign is None else []
        return (sign or "") + " ".join(head + texts)

    def _print_Add(self, expr: Basic) -> str:
        if not expr.has(SumEntries, Trace, ScalarDifferential):
            return self.scalar(expr)
        return " + ".join(self._print(a) for a in expr.args).replace("+ -", "- ")

    def _print_ScalarDifferential(self, expr: Basic) -> str:
        text = self._print(expr.arg)
        return self.n.differential + (text if expr.arg.is_Symbol else self.paren(text))

    # scalars of dimensions and trainable scalars: d_k, H·d_k, √d_k, exp(τ)
    _print_Pow = _print_exp = _print_log = _print_tanh = _print_Mul

    def _print_MatPow(self, expr: Basic) -> str:
        """A^p, the matrix power."""
        base, p = expr.args
        power = f"^{{{self.scalar(p)}}}" if self.n is LATEX else f"^{self.scalar(p)}"
        return self.superscripted(base) + power

    # Entrywise nodes.

    def _print_HadamardProduct(self, expr: HadamardProduct) -> str:
        # plain factors first, as the seeds write them: P ⊙ (dA − …), not (dA − …) ⊙ P; then SymPy's order
        plain = (MatrixSymbol, Transpose, FunctionRecord)
        args = sorted(expr.args, key=lambda a: (not isinstance(a, plain), sort_key(a)))
        return (self.brk + self.n.hadamard).join(self.operand(a, (MatAdd, MatMul, HadamardProduct)) for a in args)

    def _print_HadamardPower(self, expr: HadamardPower) -> str:
        base, p = expr.args
        text = self.superscripted(base)
        return f"{text}^{{\\circ {self.scalar(p)}}}" if self.n is LATEX else f"{text}^∘{self.scalar(p)}"

    def _print_FunctionRecord(self, expr: FunctionRecord) -> str:
        """f(A), f as its record writes it in this notation."""
        return expr.notation(self.n is LATEX) + self.paren(self._print(expr.arg))

    def _print_RowSum(self, expr: RowSum) -> str:
        """rowsum(A) = A 𝟏."""
        return f"{self.operand(expr.arg, (MatAdd, HadamardProduct, MatMul))}{self.n.product}{self.n.one}"

    def _print_SumEntries(self, expr: SumEntries) -> str:
        """sum(A) = 𝟏ᵀ A 𝟏."""
        ones = self.n.one
        inner = self.operand(expr.arg, (MatAdd, HadamardProduct, MatMul))
        return f"{ones}{self.n.transpose}{self.n.product}{inner}{self.n.product}{ones}"

    # Heads.

    def _print_SplitHeads(self, expr: SplitHeads) -> str:
        """Head h's column block: (Q W^Q)_h = Q W^Q_h."""
        arg = expr.arg
        if isinstance(arg, MatrixSymbol) and "_" not in self._print(arg):
            return self._print(arg) + self.n.head
        if isinstance(arg, MatMul) and isinstance(arg.args[-1], MatrixSymbol) and _coefficient(arg)[0] == 1:
            front = self.n.product.join(self.operand(m, (MatAdd, HadamardProduct, MatMul)) for m in arg.args[:-1])
            last = self._print(arg.args[-1])
            last = last + self.n.head if self.n is LATEX else self.paren(last) + self.n.head
            return f"{front}{self.n.product}{last}"
        return self.paren(self._print(arg)) + self.n.head

    def _print_MergeHeads(self, expr: MergeHeads) -> str:
        return self.n.concat + self.paren(self._print(expr.arg))

    def _print_RepeatHeads(self, expr: RepeatHeads) -> str:
        """Rep(A): query head h reads kv block ⌊h / (H / H_kv)⌋ (grouped-query attention)."""
        name = r"\operatorname{Rep}" if self.n is LATEX else "Rep"
        return name + self.paren(self._print(expr.arg))

    def _print_SumGroups(self, expr: SumGroups) -> str:
        """GroupSum(A): kv block j is the sum of the blocks of the query heads it serves."""
        name = r"\operatorname{GroupSum}" if self.n is LATEX else "GroupSum"
        return name + self.paren(self._print(expr.arg))

    # Row statistics (LayerNorm).

    def _print_LayerNorm(self, expr: LayerNorm) -> str:
        """LN(A): each row standardised."""
        name = r"\operatorname{LN}" if self.n is LATEX else "LN"
        return name + self.paren(self._print(expr.arg))

    def _print_RowInvStd(self, expr: RowInvStd) -> str:
        """rstd(A): the column of 1 / √(row variance + ε)."""
        name = r"\operatorname{rstd}" if self.n is LATEX else "rstd"
        return name + self.paren(self._print(expr.arg))

    # Differentials.

    def _print_Differential(self, expr: Differential) -> str:
        arg = expr.arg
        if isinstance(arg, MatrixSymbol) or (isinstance(arg, Transpose) and isinstance(arg.arg, MatrixSymbol)):
            return self.n.differential + self._print(arg)
        return self.n.differential + self.paren(self._print(arg))


def _differential_last(a: Basic) -> bool:
    return isinstance(a, ScalarDifferential)


def _coefficient(expr: MatMul) -> tuple[Basic, list[Basic]]:
    scalars = [a for a in expr.args if not isinstance(a, MatrixExpr)]
    return sp.Mul(*scalars), [a for a in expr.args if isinstance(a, MatrixExpr)]


def _is_negative(term: Basic) -> bool:
    if isinstance(term, MatMul):
        coeff = _coefficient(term)[0]
        return bool(coeff.is_number and coeff < 0) or bool(coeff.could_extract_minus_sign())
    return False


def latex(expr: Basic) -> str:
    """expr in LaTeX (amsmath)."""
    return MathPrinter(LATEX).doprint(expr)


def text(expr: Basic) -> str:
    """expr in plain unicode."""
    return MathPrinter(TEXT).doprint(expr)
