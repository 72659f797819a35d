"""Tables read at positions in the memory-efficient variant (issue 52): each block of query rows reads the table at its
own positions (rows r₀ … r₁ − 1, the keys of its key range), forward and in the backward's recomputation, and the
table's cotangent is summed over the blocks: b̄ = Σ_blocks scatter_block(W_b), W_b = (G ⊙ [∂f/∂b])_b the block of
the score cotangent, each block's part summed in row-major order of its positions, the blocks in order.

The cases are test_positions_tables.py's (a learned relative bias b[|i − j|, 0], an offset b[i − j + n − 1, 0], row
and column tables with n ≠ m, a causal window clamped b[min(|i − j|, w), 0], T5's buckets, a per-head table
T[|i − j|, h], alone and under a causal mask, document ids per sequence beside a relative bias). The NumPy and torch
memory-efficient modules, at block sizes below n that do not divide it, must match torch autograd of the independent
forward there, output and every gradient (the table's included), float64; the torch module's JVP must match
torch.func.jvp, and its double backward torch's; the table's gradient is the same bits on every run; no saved tensor
holds n × m entries. With the mask argument too, they match the standard module. The runtimes' block scatters (per
head too) add up to the whole scatter.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import sympy as sp
from saved import saved_sizes
from test_positions_tables import CASES, _inputs, _names, _wanted, reference, table_spec

import symattn as sa
from symattn.codegen import generate as codegen
from symattn.errors import SymattnError
from symattn.specs import dim

torch = pytest.importorskip("torch")

KINDS = list(CASES)
BLOCKS = (4, 5)  # block sizes below N = 6 (and M = 7), neither dividing it: a last block shorter than the others


@functools.cache
def _module(kind: str, backend: str, variant: str = "memeff") -> types.ModuleType:
    spec = table_spec(kind)
    module = types.ModuleType(f"{spec.name}_{backend}_{variant}")
    exec(compile(codegen.render(spec, backend, variant, second_order=False), module.__name__, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_memeff_module_matches_autograd(kind, block_size):
    module = _module(kind, "torch")
    inputs = _inputs(kind, seed=11)
    want, cotangent, grads = _wanted(kind, inputs)
    learned = len(grads)
    leaves = [x.clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
    got = module.forward(*leaves, block_size=block_size)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(_names(kind), torch.autograd.grad(got, leaves[:learned], cotangent), grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_numpy_memeff_module_matches_autograd(kind, block_size):
    module = _module(kind, "numpy")
    inputs = _inputs(kind, seed=12)
    want, cotangent, grads = _wanted(kind, inputs)
    out, saved = module.forward(*(x.numpy() for x in inputs), block_size=block_size)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-12)
    got = module.backward(saved, cotangent.numpy())
    assert set(got) == set(_names(kind))
    for name, w in zip(_names(kind), grads):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("kind", [k for k in KINDS if not CASES[k].constants])  # (a constant read: no jvp yet)
def test_the_torch_memeff_jvp_matches_torch_func(kind):
    # Ȧ_b reads the tables' tangents at the block's positions, as A_b reads the tables
    module = _module(kind, "torch")
    inputs = _inputs(kind, seed=13)
    g = torch.Generator().manual_seed(14)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]
    out, tangent = module.jvp(*inputs, dict(zip(_names(kind), tangents)), block_size=4)
    want_out, want_tangent = torch.func.jvp(lambda *x: reference(kind, *x), tuple(inputs), tuple(tangents))
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tangent, want_tangent, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["relative", "heads_causal"])
def test_double_backward_through_the_memeff_module_matches_torch(kind):
    # the second closed form (taking its arrays whole) differentiates the blocks' reads and scatters: an hvp
    spec = table_spec(kind)
    module = types.ModuleType(f"{spec.name}_second_order")
    exec(compile(codegen.render(spec, "torch", "memeff"), module.__name__, "exec"), module.__dict__)
    inputs = _inputs(kind, seed=20)
    g = torch.Generator().manual_seed(21)
    tangents = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in inputs]

    def hvp(function):
        leaves = [x.clone().requires_grad_() for x in inputs]
        first = torch.autograd.grad(function(*leaves).square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum((f * t).sum() for f, t in zip(first, tangents)), leaves)

    got = hvp(lambda *x: module.forward(*x, block_size=4))
    for name, a, b in zip(_names(kind), got, hvp(lambda *x: reference(kind, *x))):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("kind", ["relative", "t5", "heads", "documents"])
def test_the_table_gradient_is_the_same_bits_on_every_run(kind, backend):
    module = _module(kind, backend)
    inputs = _inputs(kind, seed=15)
    learned = len(table_spec(kind).inputs)
    cotangent = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(16), dtype=torch.float64)

    def gradients():
        if backend == "torch":
            leaves = [x.clone().requires_grad_() if a < learned else x for a, x in enumerate(inputs)]
            out = module.forward(*leaves, block_size=4)
            return [g.numpy() for g in torch.autograd.grad(out, leaves[:learned], cotangent)]
        _, saved = module.forward(*(x.numpy() for x in inputs), block_size=4)
        return list(module.backward(saved, cotangent.numpy()).values())

    runs = [gradients() for _ in range(3)]
    assert all(a.tobytes() == b.tobytes() for run in runs[1:] for a, b in zip(runs[0], run))


def test_each_block_reads_the_table_at_its_positions_and_adds_its_scatter():
    source = codegen.render(table_spec("relative"), "torch", "memeff", second_order=False)
    assert "block_entries(lambda i, j: table_read(b, torch.abs((i - j)), 0), block, keys, n, dtype, device)" in source
    assert "db = add_blocks(db, sum_batch(block_scatter(dA_b, lambda i, j: (torch.abs((i - j)), 0), n, 1, block, " in (
        source
    )
    assert "table_scatter(" not in source.split("def _backward", 1)[1].split("class ", 1)[0]
    heads = codegen.render(table_spec("heads"), "numpy", "memeff", second_order=False)
    assert "block_scatter(dA_b, lambda i, j, h: (np.abs((i - j)), h), n, 2, block, keys, heads=2)" in heads


def test_the_window_blocks_read_only_their_keys_and_scatter_there():
    """b[min(|i − j|, w), 0] under j ≤ i: a block of rows r₀ … r₁ − 1 reads keys 0 … r₁ − 1 only (K and V sliced to
    them, the table read whole at the block's positions), and its scatter takes those keys' positions (the gradient
    checked above at several block sizes)."""
    source = codegen.render(table_spec("window"), "numpy", "memeff", second_order=False)
    assert "keys = key_window(0, min(min(block.stop, Q.shape[-2]), n), K.shape[-2], None)" in source
    assert "K_k = K[..., keys, :]" in source and "b_k" not in source
    assert ", 4, 1, block, keys)))" in source  # b̄ += sum_batch(block_scatter(W_b, (r, c), 4, 1, block, keys))


@pytest.mark.parametrize("kind", ["relative", "t5", "heads", "documents"])
def test_no_saved_tensor_holds_n_by_m_entries(kind):
    """At n = 256 the memory-efficient module saves Q, K, V, the tables, O and L: nothing of n·n entries, where the
    standard module saves P (the test's control)."""
    rows, case = 256, CASES[kind]
    n = dim("n")
    width = 4 if case.heads else 3
    tensors = [torch.randn(1, rows, width, dtype=torch.float64) for _ in range(3)]
    tables = [  # (a constant read at positions, the document ids: with the batch axis)
        torch.randn(*(1,) * (name in case.constants), int(sp.sympify(r).subs(n, rows)), int(c), dtype=torch.float64)
        for name, (r, c) in case.tables.items()
    ]
    memeff = saved_sizes(_module(kind, "torch"), [*tensors, *tables], block_size=32)
    assert memeff and max(memeff) < rows * rows
    standard = saved_sizes(_module(kind, "torch", "standard"), [*tensors, *tables])
    assert max(standard) >= rows * rows


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_the_blocks_scatters_add_up_to_the_whole_scatter(backend):
    # scatter(W) = Σ_blocks scatter_block(W_b): rows in blocks of 4 (the last one shorter), each with the keys of its
    # own range (W zero elsewhere, as a causal mask leaves the score cotangent); per head, W_b (…, H, b, k) against
    # the standard module's laid-out W (…, n, H·n), whose column j is head ⌊j/n⌋'s key j − n⌊j/n⌋
    if backend == "numpy":
        from symattn.numeric.numpy_runtime import block_scatter, table_scatter

        xp, array = np, np.asarray
    else:
        from symattn.codegen.backends.torch.positions_runtime import block_scatter, table_scatter

        xp, array = torch, torch.as_tensor
    rows, heads = 10, 2
    i, j = np.arange(rows)[:, None], np.arange(rows)[None, :]
    w = np.where(j <= i, np.random.default_rng(18).standard_normal((3, heads, rows, rows)), 0.0)
    parts = [
        block_scatter(
            array(w[..., start : start + 4, : start + 4]),
            lambda i, j, h: (xp.abs(i - j), h),
            rows,
            heads,
            slice(start, start + 4),
            slice(0, start + 4),
            heads=heads,
        )
        for start in range(0, rows, 4)
    ]
    laid_out = array(np.moveaxis(w, -3, -2).reshape(3, rows, heads * rows))
    whole = table_scatter(
        laid_out, lambda i, j: (xp.abs(i - j + rows * xp.floor(j / rows)), xp.floor(j / rows)), rows, heads
    )
    want = np.stack([[w[:, h][:, np.abs(i - j) == r].sum(-1) for h in range(heads)] for r in range(rows)])
    np.testing.assert_allclose(np.asarray(whole), np.moveaxis(want, -1, 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), rtol=1e-12, atol=1e-12)
    if backend == "torch":  # off CPU a stable sort and a segment sum: the same order, the same bits
        block, index = array(w[..., 4:8, :8]), lambda i, j, h: (xp.abs(i - j), h)
        sorted_part = block_scatter(block, index, rows, heads, slice(4, 8), slice(0, 8), heads=heads, by_sorting=True)
        assert torch.equal(sorted_part, parts[1])


def test_a_table_beside_a_mask_argument_skips_the_keys_the_mask_hides():
    """b[|i − j|, 0] plus the mask argument M (attn_mask, causal, key_padding_mask): each block reads the keys the
    mask leaves it (key_range) and scatters at those keys' positions; output and gradients (b's included) as the
    standard module's, which takes M whole."""
    n, d = dim("n"), dim("d")
    q, k, v, mask = (sp.MatrixSymbol(x, n, s) for x, s in (("Q", d), ("K", d), ("V", d), ("M", n)))
    b = sp.MatrixSymbol("b", n, 1)
    bias = sa.entries(n, n, lambda i, j: b[sp.Abs(i - j), 0]).expr
    spec = sa.Spec(
        name="table_and_mask",
        summary="a table and a mask",
        inputs=(q, k, v, b),
        output=sa.softmax(q * k.T / sp.sqrt(d) + bias + mask) * v,
        options={"mask": True, "causal": True, "key_padding_mask": True},
        constants=(mask,),
        parameters=("b",),
    )
    source = codegen.render(spec, "torch", "memeff", second_order=False)
    assert "keys = key_range(M, causal, block, K.shape[-2])" in source and "block_scatter(dA_b, " in source
    g = torch.Generator().manual_seed(19)
    tensors = [
        *(torch.randn(2, 9, 3, dtype=torch.float64, generator=g) for _ in range(3)),
        torch.randn(9, 1, dtype=torch.float64, generator=g),
    ]
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 2::3] = True
    masks = {"attn_mask": torch.rand(2, 9, 9, generator=g) < 0.3, "causal": True, "key_padding_mask": padding}
    cotangent = torch.randn(2, 9, 3, dtype=torch.float64, generator=g)
    results = []
    for variant, options in (("memeff", {"block_size": 4}), ("standard", {})):
        module = types.ModuleType(f"table_and_mask_{variant}")
        exec(compile(codegen.render(spec, "torch", variant, second_order=False), "m", "exec"), module.__dict__)
        leaves = [x.clone().requires_grad_() for x in tensors]
        out = module.forward(*leaves, **masks, **options)
        results.append([out, *torch.autograd.grad(out, leaves, cotangent)])
    for name, got, want in zip(["Y", "Q", "K", "V", "b"], *results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_a_per_head_cotangent_that_is_no_entrywise_map_is_refused_in_one_line():
    # split_heads(W, H) goes through sums, ⊙ and scalar multiples of merge_heads(X) and laid-out matrices of positions;
    # a product merge_heads(X) Z has no blocks per head, and a block of rows cannot scatter it
    from symattn.lang.ops import MergeHeads
    from symattn.lang.positions import I, J, Scatter
    from symattn.optimize.position_blocks import in_blocks

    n = dim("n")
    x, z = sp.MatrixSymbol("X", n, n), sp.MatrixSymbol("Z", 2 * n, 2 * n)
    index = sp.Lambda((I, J), sp.Tuple(sp.Abs(I - J + n * sp.floor(J / n)), sp.floor(J / n)))
    assert in_blocks(Scatter(3 * MergeHeads(x, 2), n, 2, index), sp.Symbol("b")).heads == 2
    with pytest.raises(SymattnError, match="cannot be summed per head over blocks of rows") as err:
        in_blocks(Scatter(MergeHeads(x, 2) * z, n, 2, index), sp.Symbol("b"))
    assert "\n" not in str(err.value)
