"""Rewrite rules over symattn's matrix language: one named function per identity.

Every rule takes one node and returns an equal expression or None; its identity
stands in one comment line. ``REWRITES`` never raise the cost of evaluating an
expression on its own (a flattened product is costed in its best order);
``COST_REWRITES`` (factoring, row sums of products, the rowsum–Hadamard
transfer that yields FlashAttention's D = rowsum(dO ⊙ O)) pay off only in some
contexts, so ``symattn.optimize.simplify`` keeps them only where the cost goes down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sympy as sp
from sympy import Basic, MatrixExpr
from sympy.matrices.expressions import (
    HadamardProduct,
    MatAdd,
    MatMul,
    OneMatrix,
    Trace,
    Transpose,
    ZeroMatrix,
)

from symattn.lang.algebra import factors, product, total
from symattn.lang.graph import sort_key
from symattn.lang.ops import RowSum, SumEntries
from symattn.optimize.transposes import (
    CONSTANTS,
    count_transposes,
    count_transposes_of_transposed,
    is_column,
    transposed,
)

Rule = Callable[[Basic], "Basic | None"]


# Building blocks: products and sums as built (the rules below do the canonicalising).


def _product(coeff: Basic, mats: Sequence[Basic]) -> Basic:
    """c F₁ … F_k as built (not flattened), zeros and identities resolved, a bare factor left bare."""
    return product(coeff, *mats, canonical=False, drop_units=True)


def _total(parts: Sequence[Basic]) -> Basic:
    """T₁ + … + T_k as built, a single term left bare."""
    return total(*parts, canonical=False)


# Transposes.


def transpose_of_transpose(e: Basic) -> Basic | None:
    # (Aᵀ)ᵀ → A
    if isinstance(e, Transpose) and isinstance(e.arg, Transpose):
        return e.arg.arg
    return None


def transpose_of_constant(e: Basic) -> Basic | None:
    # 𝟏ᵀ → 𝟏, 0ᵀ → 0, Iᵀ → I (shapes swapped)
    if isinstance(e, Transpose) and isinstance(e.arg, CONSTANTS):
        return transposed(e.arg)
    return None


def fewer_transposes(e: Basic) -> Basic | None:
    # (A Bᵀ)ᵀ → B Aᵀ, Aᵀ ⊙ Bᵀ → (A ⊙ B)ᵀ, Aᵀ + Bᵀ → (A + B)ᵀ: the orientation with fewer transposes
    if isinstance(e, Transpose) and isinstance(e.arg, (MatMul, MatAdd, HadamardProduct)):
        if count_transposes_of_transposed(e.arg) < count_transposes(e):
            return transposed(e.arg)
    elif isinstance(e, (MatMul, MatAdd, HadamardProduct)):
        if 1 + count_transposes_of_transposed(e) < count_transposes(e):
            return Transpose(transposed(e))
    return None


# Products and scalars.


def flatten_product(e: Basic) -> Basic | None:
    # c (d A B) C → (c d) A B C (the evaluation order is chosen later, by cost)
    if isinstance(e, MatMul) and any(isinstance(a, MatMul) for a in e.args):
        coeff, mats = sp.Integer(1), []
        for a in e.args:
            c, fs = factors(a) if isinstance(a, MatrixExpr) else (a, [])
            coeff, mats = coeff * c, mats + fs
        return _product(coeff, mats)
    return None


def unit_factors(e: Basic) -> Basic | None:
    # 1 · A → A, A I → A, 0 · A → 0, A 0 B → 0
    if isinstance(e, MatMul):
        coeff, mats = factors(e)
        folded = _product(coeff, mats)
        return folded if folded != e else None
    return None


def zero_terms(e: Basic) -> Basic | None:
    # A + 0 → A
    if isinstance(e, MatAdd) and any(isinstance(t, ZeroMatrix) for t in e.args):
        kept = [t for t in e.args if not isinstance(t, ZeroMatrix)]
        return _total(kept) if kept else ZeroMatrix(*e.shape)
    return None


def collect_like_terms(e: Basic) -> Basic | None:
    # c A + d A → (c + d) A
    if not isinstance(e, MatAdd):
        return None
    coefficients: dict[Basic, Basic] = {}
    for t in e.args:
        c, mats = factors(t)
        body = _product(sp.Integer(1), mats)
        coefficients[body] = coefficients.get(body, 0) + c
    if len(coefficients) == len(e.args):
        return None
    terms = [_product(c, [body]) for body, c in coefficients.items() if c != 0]
    return _total(terms) if terms else ZeroMatrix(*e.shape)


def common_scalar_out(e: Basic) -> Basic | None:
    # c A ± c B → c (A ± B)
    if not isinstance(e, MatAdd):
        return None
    coeffs = [factors(t)[0] for t in e.args]
    c = coeffs[0]
    if c in (1, -1) or any(x != c and x != -c for x in coeffs):
        return None
    return _product(c, [_total([_product(x / c, factors(t)[1]) for x, t in zip(coeffs, e.args)])])


def flatten_entrywise(e: Basic) -> Basic | None:
    # (A + B) + C → A + B + C, (A ⊙ B) ⊙ C → A ⊙ B ⊙ C
    for kind in (MatAdd, HadamardProduct):
        if isinstance(e, kind) and any(isinstance(a, kind) for a in e.args):
            return kind(*(b for a in e.args for b in (a.args if isinstance(a, kind) else (a,))))
    return None


def sort_commutative(e: Basic) -> Basic | None:
    # A + B = B + A, A ⊙ B = B ⊙ A: one fixed order, so equal subexpressions compare equal
    if isinstance(e, (MatAdd, HadamardProduct)):
        ordered = sorted(e.args, key=sort_key)  # SymPy's keys, computed leaves first
        return type(e)(*ordered) if tuple(ordered) != e.args else None
    return None


def sum_of_transpose(e: Basic) -> Basic | None:
    # sum(Aᵀ) → sum(A), tr(Aᵀ) → tr(A)
    if isinstance(e, (SumEntries, Trace)) and isinstance(e.arg, Transpose):
        return type(e)(e.arg.arg)
    return None


# Hadamard products.


def hadamard_with_ones(e: Basic) -> Basic | None:
    # A ⊙ 𝟏𝟏ᵀ → A
    if isinstance(e, HadamardProduct) and any(isinstance(f, OneMatrix) for f in e.args):
        kept = [f for f in e.args if not isinstance(f, OneMatrix)]
        if not kept:
            return e.args[0]
        return kept[0] if len(kept) == 1 else HadamardProduct(*kept)
    return None


def hadamard_with_zero(e: Basic) -> Basic | None:
    # A ⊙ 0 → 0
    if isinstance(e, HadamardProduct) and any(isinstance(f, ZeroMatrix) for f in e.args):
        return ZeroMatrix(*e.shape)
    return None


def hadamard_scalar_out(e: Basic) -> Basic | None:
    # (c A) ⊙ B → c (A ⊙ B)
    if not isinstance(e, HadamardProduct):
        return None
    parts = [factors(f) for f in e.args]
    coeff = sp.Mul(*(c for c, _ in parts))
    if all(c == 1 for c, _ in parts):
        return None
    return _product(coeff, [HadamardProduct(*(_product(sp.Integer(1), fs) for _, fs in parts))])


# Row sums and products with ones.


def product_with_ones(e: Basic) -> Basic | None:
    # X 𝟏_{m×k} → rowsum(X) 𝟏_{1×k}, e.g. (G ⊙ P) 𝟏𝟏ᵀ → rowsum(G ⊙ P) 𝟏ᵀ
    if not isinstance(e, MatMul):
        return None
    coeff, mats = factors(e)
    for i, f in enumerate(mats[1:], start=1):
        if isinstance(f, OneMatrix) and not is_column(mats[i - 1]):
            column = RowSum(_product(sp.Integer(1), mats[:i]))
            return _product(coeff, [column, OneMatrix(1, f.shape[1]), *mats[i + 1 :]])
    return None


def ones_times_ones(e: Basic) -> Basic | None:
    # 𝟏_{a×b} 𝟏_{b×c} → b 𝟏_{a×c} (after a matrix X, X 𝟏 is a row sum first: product_with_ones)
    if not isinstance(e, MatMul):
        return None
    coeff, mats = factors(e)
    for i in range(len(mats) - 1):
        left, right = mats[i], mats[i + 1]
        after_matrix = i > 0 and not is_column(mats[i - 1])
        if isinstance(left, OneMatrix) and isinstance(right, OneMatrix) and not after_matrix:
            merged = OneMatrix(left.shape[0], right.shape[1])
            return _product(coeff * left.shape[1], [*mats[:i], merged, *mats[i + 2 :]])
    return None


def rowsum_of_column(e: Basic) -> Basic | None:
    # rowsum(x) → x for an n × 1 column x
    if isinstance(e, RowSum) and is_column(e.arg):
        return e.arg
    return None


def rowsum_of_broadcast(e: Basic) -> Basic | None:
    # rowsum(c x 𝟏_{1×m}) → c m x
    if isinstance(e, RowSum) and isinstance(e.arg, MatMul):
        coeff, mats = factors(e.arg)
        if len(mats) >= 2 and isinstance(mats[-1], OneMatrix) and is_column(mats[-2]):
            return _product(coeff * mats[-1].shape[1], mats[:-1])
    return None


def rowsum_scalar_out(e: Basic) -> Basic | None:
    # rowsum(c A) → c rowsum(A)
    if isinstance(e, RowSum) and isinstance(e.arg, MatMul):
        coeff, mats = factors(e.arg)
        if coeff != 1:
            return _product(coeff, [RowSum(_product(sp.Integer(1), mats))])
    return None


def rowsum_of_sum(e: Basic) -> Basic | None:
    # rowsum(A + x 𝟏ᵀ) → rowsum(A) + m x, when a term is a broadcast column
    if isinstance(e, RowSum) and isinstance(e.arg, MatAdd):
        sums = [rowsum_of_broadcast(RowSum(t)) for t in e.arg.args]
        if any(s is not None for s in sums):
            return MatAdd(*(s if s is not None else RowSum(t) for s, t in zip(sums, e.arg.args)))
    return None


# Cost-guided rules: kept only where they lower the cost of the whole DAG.


def rowsum_hadamard_transfer(e: Basic) -> Basic | None:
    # rowsum((A Bᵀ) ⊙ C) → rowsum(A ⊙ (C B)); with C = P, A Bᵀ = dO Vᵀ: rowsum(dP ⊙ P) → rowsum(dO ⊙ O)
    if not (isinstance(e, RowSum) and isinstance(e.arg, HadamardProduct)):
        return None
    mats = e.arg.args
    for i, f in enumerate(mats):
        coeff, chain = factors(transposed(f.arg) if isinstance(f, Transpose) else f)
        if len(chain) < 2:
            continue
        a = _product(coeff, chain[:1])
        b = transposed(_product(sp.Integer(1), chain[1:]))
        others = mats[:i] + mats[i + 1 :]
        c = others[0] if len(others) == 1 else HadamardProduct(*others)
        return RowSum(HadamardProduct(a, MatMul(c, b)))
    return None


def rowsum_of_product(e: Basic) -> Basic | None:
    # rowsum(A B) → A rowsum(B)
    if isinstance(e, RowSum) and isinstance(e.arg, MatMul):
        coeff, chain = factors(e.arg)
        if len(chain) >= 2 and not isinstance(chain[-1], OneMatrix):
            return _product(coeff, [*chain[:-1], RowSum(chain[-1])])
    return None


def trace_of_product(e: Basic) -> Basic | None:
    # tr(A B) → sum(A ⊙ Bᵀ)
    if isinstance(e, Trace) and isinstance(e.arg, MatMul):
        coeff, chain = factors(e.arg)
        if len(chain) >= 2:
            rest = transposed(_product(sp.Integer(1), chain[1:]))
            return coeff * SumEntries(HadamardProduct(chain[0], rest))
    return None


def sum_of_product(e: Basic) -> Basic | None:
    # sum(A B) → sum(A rowsum(B))
    if isinstance(e, SumEntries) and isinstance(e.arg, MatMul):
        coeff, chain = factors(e.arg)
        if len(chain) >= 2 and not is_column(chain[-1]):
            return coeff * SumEntries(_product(sp.Integer(1), [*chain[:-1], RowSum(chain[-1])]))
    return None


def _factor_common(e: Basic, side: int) -> Basic | None:
    """Group the terms of a sum that share their first (side 0) or last (side −1) factor."""
    if not isinstance(e, MatAdd):
        return None
    groups: dict[Basic, list[int]] = {}
    parts = [factors(t) for t in e.args]
    for i, (_, chain) in enumerate(parts):
        if len(chain) >= 2:
            groups.setdefault(chain[side], []).append(i)
    shared = max(groups.items(), key=lambda kv: len(kv[1]), default=(None, []))
    factor, members = shared
    if len(members) < 2:
        return None
    rest = [_product(parts[i][0], parts[i][1][1:] if side == 0 else parts[i][1][:-1]) for i in members]
    grouped = _product(sp.Integer(1), [factor, _total(rest)] if side == 0 else [_total(rest), factor])
    others = [t for i, t in enumerate(e.args) if i not in members]
    return _total([grouped, *others])


def factor_common_left(e: Basic) -> Basic | None:
    # A B + A C → A (B + C)
    return _factor_common(e, 0)


def factor_common_right(e: Basic) -> Basic | None:
    # B A + C A → (B + C) A
    return _factor_common(e, -1)


REWRITES: tuple[Rule, ...] = (
    transpose_of_transpose,
    transpose_of_constant,
    flatten_product,
    unit_factors,
    flatten_entrywise,
    zero_terms,
    hadamard_with_zero,
    hadamard_with_ones,
    hadamard_scalar_out,
    collect_like_terms,
    common_scalar_out,
    ones_times_ones,
    product_with_ones,
    rowsum_of_column,
    rowsum_of_broadcast,
    rowsum_scalar_out,
    rowsum_of_sum,
    fewer_transposes,
    sum_of_transpose,
    sort_commutative,
)

COST_REWRITES: tuple[Rule, ...] = (
    rowsum_hadamard_transfer,
    rowsum_of_product,
    trace_of_product,
    sum_of_product,
    factor_common_left,
    factor_common_right,
)
