"""Named subexpressions: one table from definitions to the symbols that name them.

``Names`` holds each definition with its name, and its transpose with the name's
transpose, and puts the names back into an expression in one of two ways:

- ``substitute`` (code generation) works top-down on values derived in full: an
  expression that is a definition becomes its name; in a product, the longest
  definitions that are runs of consecutive factors are replaced left to right (so
  Q Kᵀ is found inside scale·X W_Q W_Kᵀ Xᵀ, and Z = F 𝟏ₙ inside F 𝟏_{n×m}, where
  SymPy merged 𝟏ₙ 𝟏ᵀₘ), their coefficients divided out (a
  coefficient that may be 0, a trainable scalar's τ, is never divided by).
- calling the table (display) works bottom-up, definitions in the order they were
  added, each already written with the earlier names: ``Names(spec.intermediates)``
  makes ``1/√d_k · X W_Q W_Kᵀ Xᵀ`` read ``A`` and ``G W_Vᵀ Xᵀ`` read ``G Vᵀ``. A
  definition with a coefficient is matched only where the rest of the coefficient
  is a number. The verifier never sees display names.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from sympy import Basic, MatrixExpr, MatrixSymbol
from sympy.matrices.expressions import MatAdd, MatMul, OneMatrix

from symattn.lang.algebra import factors, product, total, transpose, transposed_factors
from symattn.lang.graph import children, rebuilt
from symattn.lang.naming.safe import expression


def differential_name(name: str, taken: Collection[str]) -> str:
    """d<name>: the name of name's gradient or differential; d<name>_2, d<name>_3, … when d<name> is in taken (an
    input dX beside X, an intermediate labelled dQ beside an input Q), skipping the d<other> of every other name
    in taken, so that distinct names in taken always get distinct names."""
    candidate, k = "d" + name, 1
    while candidate in taken or (k > 1 and candidate[1:] in taken):  # d(X_2) is X_2's own
        k += 1
        candidate = f"d{name}_{k}"
    return candidate


def fresh_name(stem: str, taken: Collection[str], bare: bool = False, first: int = 1, sep: str = "") -> str:
    """The first of stem (when bare), stem<sep><first>, stem<sep><first + 1>, … that is not in taken."""
    if bare and stem not in taken:
        return stem
    k = first
    while f"{stem}{sep}{k}" in taken:
        k += 1
    return f"{stem}{sep}{k}"


class Names:
    """A table from subexpressions to the symbols that name them (``named``: display names, in forward order)."""

    def __init__(self, named: Sequence[tuple[str, MatrixExpr]] = ()) -> None:
        self.table: dict[Basic, Basic] = {}  # definition → name, definitionᵀ → nameᵀ (the first one given)
        # (name, coefficient, factors) of every definition and of its transpose, in the order added
        self.patterns: list[tuple[Basic, Basic, list[Basic]]] = []
        self.by_first: dict[Basic, list[int]] = {}  # first factor → indices of the patterns that start with it
        self.memo: dict[Basic, Basic] = {}  # expression → expression with the names put in
        self.index: tuple[dict, dict] | None = None  # substitute's products and sums (see _indices)
        self.symbols: dict[str, MatrixSymbol] = {}
        self.definitions: list[tuple[MatrixSymbol, Basic]] = []  # name = definition with earlier names, in order
        for label, expr in named:
            short = self(expr)
            symbol = MatrixSymbol(label, *expr.shape)
            self.symbols[label] = symbol
            self.definitions.append((symbol, short))
            self.add(short, symbol)

    def add(self, expr: Basic, symbol: MatrixSymbol) -> None:
        """Name expr by symbol, and exprᵀ by symbolᵀ."""
        self.table[expr] = symbol
        self.table.setdefault(transpose(expr), symbol.T)
        coeff, mats = factors(expr)
        self.memo.clear()
        self.index = None
        for pattern in ((symbol, coeff, mats), (symbol.T, coeff, transposed_factors(mats))):
            self.by_first.setdefault(pattern[2][0], []).append(len(self.patterns))
            self.patterns.append(pattern)

    # Code generation: top-down.

    def substitute(self, expr: Basic, skip: Basic | None = None) -> Basic:
        """expr with every named subexpression (but skip) replaced by its name.

        In a product, runs of consecutive factors that spell a named product are replaced; in a
        sum, terms that spell a named sum (Y₁ = X + P₁ X W_V inside X + P₁ X W_V + P₂ Y₁ W_V, which
        SymPy's sums flatten) are. Each distinct subexpression is visited once (a DAG's shared parts
        are not walked again); the named products and sums are indexed, longest first, by their first
        factor or by each of their terms, once per table (``_indices``).
        """
        runs, sums = self._indices()
        done: dict[Basic, Basic] = {}
        plans: dict[Basic, Plan] = {}
        stack = [expr]  # an explicit stack: a 200-deep chain is no deeper for Python than a shallow one
        while stack:
            e = stack[-1]
            if e in done:
                stack.pop()
                continue
            if e not in plans:
                plans[e] = self._plan(e, runs, sums, skip)
                pending = [c for c in plans[e][0] if c not in done]
                if pending:
                    stack.extend(pending)
                    continue
            children, build = plans.pop(e)
            done[e] = build([done[c] for c in children])
            stack.pop()
        return done[expr]

    def _plan(self, e: Basic, runs: dict, sums: dict, skip: Basic | None) -> Plan:
        """The subexpressions of e to substitute in first, and how e is rebuilt from what they become."""
        if e in self.table and e != skip:
            name = self.table[e]
            return (), lambda _: name
        if not children(e):
            return (), lambda _: e
        if isinstance(e, MatMul):
            return _plan_product(e, runs, skip)
        if isinstance(e, MatAdd) and sums:
            return _plan_sum(e, sums, skip)
        return children(e), lambda args: rebuilt(e, args)

    def _indices(self) -> tuple[dict, dict]:
        """The named products by first factor and the named sums by each term, most factors or terms first."""
        if self.index is None:
            runs: dict[Basic, list] = {}  # first factor → (definition, (coefficient, factors), name)
            sums: dict[Basic, list] = {}  # term → (definition, terms, name)
            for k, v in sorted(self.table.items(), key=lambda kv: -len(kv[0].args)):
                if isinstance(k, MatMul):
                    coeff, mats = factors(k)
                    if len(mats) > 1:
                        runs.setdefault(mats[0], []).append((k, (coeff, tuple(mats)), v))
                elif isinstance(k, MatAdd):
                    for t in k.args:
                        sums.setdefault(t, []).append((k, k.args, v))
            self.index = runs, sums
        return self.index

    # Display: bottom-up.

    def __call__(self, expr: Basic) -> Basic:
        """expr with the names put in bottom-up, every occurrence of a definition (or its transpose) replaced.

        Each distinct subexpression is named once (the answers are kept until a definition is added), on an
        explicit stack: printing every step of a deep spec stays linear in its DAG.
        """
        memo = self.memo
        root = expression(expr)
        stack: list[tuple[Basic, bool]] = [(root, False)]
        while stack:
            e, expanded = stack.pop()
            if e in memo and not expanded:
                continue
            if not children(e):
                memo[e] = e
            elif expanded:
                args = [memo[a] for a in children(e)]
                out = rebuilt(e, args)
                memo[e] = self._match(out)
            else:
                stack.append((e, True))
                stack.extend((a, False) for a in children(e) if a not in memo)
        return memo[root]

    def _match(self, e: Basic) -> Basic:
        """e with every run of factors that spells a definition replaced by its name."""
        if not isinstance(e, MatrixExpr):
            return e
        coeff, mats = factors(e)
        changed = True
        while changed:
            changed = False
            # only the patterns whose first factor occurs can match; tried in the order added
            candidates = sorted({k for m in mats for k in self.by_first.get(m, ())})
            for k in candidates:
                replacement, p_coeff, p_mats = self.patterns[k]
                found = _find(mats, p_mats)
                if found is None:
                    continue
                rest = coeff / p_coeff
                if p_coeff != 1 and not rest.is_number:
                    continue
                mats = mats[:found] + [replacement] + mats[found + len(p_mats) :]
                coeff, changed = rest, True
                break
        return product(coeff, *mats, canonical=False)


# what a subexpression's substitution needs first, and how it is rebuilt from their results
Plan = tuple[Sequence[Basic], Callable[[list[Basic]], Basic]]


def _plan_product(expr: MatMul, runs: dict, skip: Basic | None) -> Plan:
    """A product with every run of factors that spells a named product replaced by its name; the other
    factors are substituted in."""
    coeff, mats = factors(expr)
    pieces: list[Basic | None] = []  # a name, or None where the next substituted factor goes
    rest: list[Basic] = []
    i = 0
    while i < len(mats):
        for definition, (c, run), name in _runs_at(mats, i, runs):
            # c divided out only where it cannot be 0: a dimension's √d_k, never a trainable scalar τ (τ = 0 is legal)
            if definition == skip or not (c == 1 or c.is_zero is False):
                continue
            found = tuple(mats[i : i + len(run)])
            if found == run:
                coeff = coeff / c
                pieces.append(name)
                i += len(run)
                break
            # SymPy merged a name's 𝟏ₙ with the 𝟏ᵀₘ beside it: F 𝟏_{n×m} reads Z 𝟏ᵀₘ (Z = F 𝟏ₙ), 𝟏_{m×n} F Zᵀ-wise
            if found[:-1] == run[:-1] and (after := _split_ones(run[-1], found[-1], last=True)) is not None:
                coeff = coeff / c
                pieces.append(name)
                mats = [*mats[: i + len(run) - 1], after, *mats[i + len(run) :]]
                i += len(run) - 1
                break
            if found[1:] == run[1:] and (before := _split_ones(run[0], found[0], last=False)) is not None:
                coeff = coeff / c
                pieces.extend((None, name))
                rest.append(before)
                i += len(run)
                break
        else:
            pieces.append(None)
            rest.append(mats[i])
            i += 1

    def build(done: list[Basic]) -> Basic:
        substituted = iter(done)
        return product(coeff, *(next(substituted) if p is None else p for p in pieces), canonical=False, flatten=True)

    return rest, build


def _runs_at(mats: list[Basic], i: int, runs: dict) -> list:
    """The named products that may start at factor i: by that factor, or for a block of ones 𝟏_{m×n} there,
    by the row 𝟏ᵀₙ a name may start with."""
    found = runs.get(mats[i], [])
    if isinstance(mats[i], OneMatrix) and mats[i].shape[0] != 1:
        found = [*found, *runs.get(OneMatrix(1, mats[i].shape[1]), ())]
    return found


def _split_ones(named: Basic, found: Basic, last: bool) -> Basic | None:
    """What is left of a block of ones found where a name has ones: 𝟏ᵀₘ of 𝟏_{n×m} at a name's last factor
    𝟏ₙ (last), 𝟏ₘ of 𝟏_{m×n} at its first factor 𝟏ᵀₙ; None where there is no such split."""
    if not (isinstance(named, OneMatrix) and isinstance(found, OneMatrix)) or named == found:
        return None
    if last and named.shape[1] == 1 and found.shape[0] == named.shape[0]:
        return OneMatrix(1, found.shape[1])
    if not last and named.shape[0] == 1 and found.shape[1] == named.shape[1]:
        return OneMatrix(found.shape[0], 1)
    return None


def _plan_sum(expr: MatAdd, sums: dict, skip: Basic | None) -> Plan:
    """A sum with every set of its terms that spells a named sum replaced by its name (most terms first);
    the other terms are substituted in."""
    rest = list(expr.args)
    names: list[Basic] = []
    candidates = {c[0]: c for t in expr.args for c in sums.get(t, ()) if c[0] != skip}
    for _, named_terms, name in sorted(candidates.values(), key=lambda c: -len(c[1])):
        if len(named_terms) < len(expr.args) and all(t in rest for t in named_terms):
            rest = [t for t in rest if t not in named_terms]
            names.append(name)
    if not names:
        return expr.args, lambda done: rebuilt(expr, done)
    return rest, lambda done: total(*names, *done)


def _find(mats: list[Basic], target: list[Basic]) -> int | None:
    """Index where target occurs as consecutive factors of mats."""
    k = len(target)
    first = target[0]
    for i in range(len(mats) - k + 1):
        if mats[i] == first and mats[i : i + k] == target:
            return i
    return None
