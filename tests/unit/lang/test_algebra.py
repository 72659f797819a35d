"""The product/sum toolkit, the dimension plan and the one table of names (symattn.lang)."""

import numpy as np
import sympy as sp
from sympy import Identity, MatAdd, MatMul, MatrixSymbol, ZeroMatrix

from symattn.lang.algebra import factors, product, terms, total
from symattn.lang.dims import LENGTH, bind_dimensions, dim
from symattn.lang.naming.names import Names
from symattn.numeric.lambdify import lambdify

n, d, h = dim("n"), dim("d"), dim("H")
A, B, C = MatrixSymbol("A", n, n), MatrixSymbol("B", n, n), MatrixSymbol("C", n, n)


def test_factors_of_a_product_and_of_anything_else():
    # 2 A B → (2, [A, B]); A → (1, [A])
    assert factors(MatMul(2, A, B)) == (2, [A, B])
    assert factors(A) == (1, [A])
    assert factors(MatMul(A, MatMul(B, C))) == (1, [A, MatMul(B, C)])  # one level only


def test_terms_of_a_sum_and_of_anything_else():
    assert terms(MatAdd(A, B)) == (A, B)
    assert terms(A) == (A,)


def test_canonical_product_is_sympys_at_the_top_and_distributes_rationals():
    # 2 (A + B) = 2 A + 2 B; 3 (2 A) B = 6 A B
    assert product(2, MatAdd(A, B)) == MatAdd(MatMul(2, A), MatMul(2, B))
    assert product(3, MatMul(2, A), B) == MatMul(6, A, B)


def test_product_as_built_flattens_and_drops_units_only_when_asked():
    assert product(1, A, canonical=False) == A
    assert product(2, MatMul(A, B), C, canonical=False).args == (2, MatMul(A, B), C)
    assert product(2, MatMul(3, A, B), C, canonical=False, flatten=True) == MatMul(6, A, B, C)
    assert product(1, A, Identity(n), canonical=False, drop_units=True) == A
    assert product(0, A, B, canonical=False, drop_units=True) == ZeroMatrix(n, n)
    assert product(1, A, Identity(n), canonical=False) == MatMul(A, Identity(n))


def test_canonical_total_collects_like_terms_and_drops_zeros():
    # A + 2 A + 0 = 3 A; A − A = 0
    assert total(A, MatMul(2, A), ZeroMatrix(n, n)) == MatMul(3, A)
    assert total(A, MatMul(-1, A)) == ZeroMatrix(n, n)
    assert total(MatAdd(B, A), C) == MatAdd(A, B, C)
    assert total(B, A, canonical=False).args == (B, A)


def test_dimensions_are_read_off_shapes_in_order():
    # X: n × H·d with H known gives n = X.shape[-2], d = X.shape[-1] // H
    x = MatrixSymbol("X", n, h * d)
    plan = bind_dimensions([x], {h})
    assert [(b.symbol, b.input, b.axis, b.divisor) for b in plan] == [(n, "X", -2, None), (d, "X", -1, h)]
    assert plan[1].formula == LENGTH / h
    # n + 1 is no multiple of n: code generation leaves it, lambdify solves for it
    assert [b.symbol for b in bind_dimensions([MatrixSymbol("Y", n + 1, d)], set())] == [d]
    solved = bind_dimensions([MatrixSymbol("Y", n + 1, d)], set(), solve=True)
    assert solved[0].symbol == n and solved[0].formula == LENGTH - 1


def test_lambdify_binds_a_dimension_that_is_no_multiple():
    y = MatrixSymbol("Y", n + 1, d)
    assert lambdify([y], y)(np.ones((4, 3))).shape == (4, 3)


def test_names_substitute_runs_of_factors_and_transposes():
    # with S = A B: 2 A B C → 2 S C, (A B)ᵀ → Sᵀ
    names = Names()
    s = MatrixSymbol("S", n, n)
    names.add(MatMul(A, B), s)
    assert names.substitute(MatMul(2, A, B, C)) == MatMul(2, s, C)
    assert names.substitute(MatMul(A, B).T) == s.T


def test_a_name_ending_in_a_ones_column_is_found_where_sympy_merged_the_ones():
    # Z = A 𝟏ₙ; SymPy writes Z 𝟏ᵀ_d = A 𝟏ₙ 𝟏ᵀ_d as A 𝟏_{n×d}: substitute reads it Z 𝟏ᵀ_d
    names = Names()
    z = MatrixSymbol("Z", n, 1)
    names.add(MatMul(A, sp.OneMatrix(n, 1)), z)
    assert names.substitute(MatMul(A, sp.OneMatrix(n, d))) == MatMul(z, sp.OneMatrix(1, d))
    assert names.substitute(MatMul(sp.OneMatrix(d, n), A.T)) == MatMul(sp.OneMatrix(d, 1), z.T)


def test_display_names_put_in_bottom_up():
    short = Names([("S", MatMul(A, B)), ("P", sp.HadamardProduct(MatMul(A, B), C))])
    assert [str(sym) for sym, _ in short.definitions] == ["S", "P"]
    assert short(MatMul(3, A, B, C)) == MatMul(3, short.symbols["S"], C)


def test_canonical_products_built_directly_are_sympys():
    """Every product of a second closed form whose factors ``_canonical_as_is`` passes is, built directly, the node
    SymPy's ``doit`` gives, argument for argument; and the factor lists it refuses are the ones SymPy rewrites."""
    from sympy.matrices.expressions import OneMatrix as Ones

    from symattn.codegen.emit.second_order import second_order_schedule
    from symattn.codegen.schedule.build import schedule_spec
    from symattn.lang import algebra
    from symattn.lang.graph import nodes
    from symattn.specs.files import load_spec_file

    _, sched = second_order_schedule(schedule_spec(load_spec_file("examples/specs/linear_attention.py")))
    values = [a.value for a in (*sched.forward, *sched.backward)]
    products = [algebra.factors(e) for e in nodes(*values) if isinstance(e, MatMul)]
    # every pair of consecutive factors too: the products the engine builds from parts of these
    products += [(sp.Integer(-1), mats[i : i + 2]) for _, mats in products for i in range(len(mats) - 1)]
    checked = [(c, mats) for c, mats in products if algebra._canonical_as_is(c, mats)]
    assert len(checked) > 50
    for coeff, mats in checked:
        direct = algebra.product(coeff, *mats, canonical=False)
        assert direct.args == MatMul(coeff, *mats).doit(deep=False).args, (coeff, mats)
    assert not algebra._canonical_as_is(sp.Integer(1), [Ones(n, 1), Ones(1, d)])  # 𝟏𝟏ᵀ merges
    assert not algebra._canonical_as_is(sp.Integer(2), [A, A])  # A A = A²
    assert not algebra._canonical_as_is(sp.Integer(1), [Ones(1, 1), MatrixSymbol("r", 1, d)])  # 𝟏_{1×1} = I
