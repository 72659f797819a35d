"""The context-parallel cases of specs with work outside their cores (ring_cases.py runs them over the world): mha
with grouped-query heads, a causal mask, a constant n × m mask and zig-zag balance; transformer_block with a
key_padding_mask; the gallery's sigmoid (no normaliser), softplus (a division by row sums) and differential (two
cores) attention; a positional spec whose window reads the sequence's lengths. Each rank passes its rows of the
sequence-long inputs (and of the n × m mask) and the whole weights; its output rows, its inputs' gradient rows,
the weights' gradients summed over the ranks (all_reduce) and its rows of the JVP are compared with the
single-process torch module's (float64).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from symattn.distributed import context_parallel

SEQUENCE = ("n", "m")  # the axes that are the sequence: each rank holds its rows of them


def _inputs(module, sizes: dict, batch: tuple) -> dict:
    """Seeded float64 inputs of a module by its AXES (sequence-long ones batched), its scalars 0-d."""
    torch.manual_seed(3)
    inputs = {}
    for name in module.TANGENT_OF:
        axes = module.AXES.get(name)
        if axes is None:
            inputs[name] = torch.tensor(0.4, dtype=torch.float64)
            continue
        shape = tuple(sizes[a] if isinstance(a, str) else a for a in axes)
        lead = batch if axes[0] in SEQUENCE else ()
        inputs[name] = torch.randn(*lead, *shape, dtype=torch.float64) / (1 if axes[0] in SEQUENCE else shape[0] ** 0.5)
    return inputs


def _rows(x: torch.Tensor, axis: int, rows: torch.Tensor) -> torch.Tensor:
    return x.index_select(axis, rows)


def spec_case(case: dict, rows_of) -> dict:
    """One spec's case over the world: the largest differences (forward and gradients, JVP) from the torch module."""
    rank, world = dist.get_rank(), dist.get_world_size()
    module = importlib.import_module(case["module"])
    host = importlib.import_module(case["module"].replace("_torch", "_triton"))
    inputs = _inputs(host, case["sizes"], case.get("batch", ()))
    balance, options = case.get("balance"), dict(case.get("options", {}))
    sequence = {name for name, axes in host.AXES.items() if axes[0] in SEQUENCE}
    mine = {a: rows_of(case["sizes"][a], world, rank, balance) for a in SEQUENCE if a in case["sizes"]}
    local_options = dict(options)
    for name, (axis, dim) in case.get("row_options", {}).items():  # masks: their rows of the sequence
        local_options[name] = _rows(options[name], axis, mine[dim])
    local = {
        name: (_rows(x, -2, mine[host.AXES[name][0]]) if name in sequence else x).clone().requires_grad_()
        for name, x in inputs.items()
    }
    whole = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    out = module.forward(**whole, **options)
    torch.manual_seed(4)
    dO = torch.randn_like(out)
    out.backward(dO)
    ring_out = context_parallel(module.forward, balance=balance)(**local, **local_options)
    queries = mine[case.get("output", "n")]
    ring_out.backward(_rows(dO, -2, queries))
    errors = {"forward": (ring_out - _rows(out, -2, queries)).abs().max().item()}
    gaps = []
    for name, x in local.items():
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if name in sequence:
            gaps.append((grad - _rows(whole[name].grad, -2, mine[host.AXES[name][0]])).abs().max().item())
        else:  # the rank's share of a weight's gradient, summed over the ranks
            dist.all_reduce(grad)
            gaps.append((grad - whole[name].grad).abs().max().item())
    errors["backward"] = max(gaps)
    torch.manual_seed(5)
    dots = {name: torch.randn_like(x) for name, x in inputs.items()}
    local_dots = {name: _rows(t, -2, mine[host.AXES[name][0]]) if name in sequence else t for name, t in dots.items()}
    ring = context_parallel(module.forward, balance=balance)
    primal, tangent = ring.jvp(**{k: v.detach() for k, v in local.items()}, tangents=local_dots, **local_options)
    want, want_tangent = module.jvp(**inputs, tangents=dots, **options)
    errors["jvp"] = (primal - _rows(want, -2, queries)).abs().max().item()
    errors["tangent"] = (tangent - _rows(want_tangent, -2, queries)).abs().max().item()
    return errors


GALLERY_SIZES = {"n": 13, "d_model": 6, "d_k": 4, "d_v": 5}


def cases(package: str) -> dict[str, dict]:
    """The cases by name: package holds the rendered gallery and positional modules (test_context_parallel.py)."""
    torch.manual_seed(6)
    mask = torch.rand(16, 16) < 0.25  # True: not allowed (the diagonal allowed: every row sees a key)
    mask.fill_diagonal_(False)
    padding = torch.rand(2, 13) < 0.3
    padding[..., 0] = False
    bias = torch.randn(13, 13, dtype=torch.float64)  # a float n × m mask, added to the scores
    generated = "symattn.generated"
    return {
        "mha_mask_and_padding": {  # an n × m mask (the rank's rows of every key) and a key padding mask together
            "module": f"{generated}.mha_torch",
            "sizes": {"n": 13, "m": 13, "H*d_k": 8, "H_kv*d_k": 8},
            "batch": (2,),
            "options": {"num_heads": 2, "attn_mask": bias, "key_padding_mask": padding},
            "row_options": {"attn_mask": (-2, "n"), "key_padding_mask": (-1, "m")},
        },
        "mha_grouped": {
            "module": f"{generated}.mha_torch",
            "sizes": {"n": 16, "m": 16, "H*d_k": 8, "H_kv*d_k": 4},
            "batch": (2,),
            "balance": "causal",
            "options": {"num_heads": 4, "num_kv_heads": 2, "causal": True, "attn_mask": mask},
            "row_options": {"attn_mask": (-2, "n")},
        },
        "transformer_block": {
            "module": f"{generated}.transformer_block_torch",
            "sizes": {"n": 13, "H*d_k": 8, "d_ff": 12},
            "batch": (2,),
            "options": {"num_heads": 2, "key_padding_mask": padding},
            "row_options": {"key_padding_mask": (-1, "n")},
        },
        "sigmoid": {"module": f"{package}.sigmoid_attention_torch", "sizes": GALLERY_SIZES, "batch": (2,)},
        "softplus": {"module": f"{package}.softplus_attention_torch", "sizes": GALLERY_SIZES},
        "differential": {"module": f"{package}.differential_attention_torch", "sizes": GALLERY_SIZES, "batch": (2,)},
        "positions": {"module": f"{package}.ring_positions_torch", "sizes": {"n": 13, "m": 9, "d": 4}, "batch": (3,)},
    }


def dropin_case(rows_of) -> dict:
    """The drop-in nn.MultiheadAttention (torch's layout: sequence first) over the world with a key padding mask,
    need_weights=False; and the drop-in pre-LN GELU TransformerEncoderLayer (the configuration
    the spec's Triton module computes) with a key padding mask: the rank's output rows, its input rows' gradient
    and the weights' gradients summed over the ranks against one process's (float64)."""
    from symattn.generated import mha_torch, transformer_block_torch

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    n = 14
    x = torch.randn(n, 2, 16, dtype=torch.float64)  # (L, N, E): batch_first=False
    padding = torch.rand(2, n) < 0.3
    padding[:, 0] = False
    mine = rows_of(n, world, rank, None)
    attention = mha_torch.MultiheadAttention(16, 4, dtype=torch.float64)
    options = {"dim_feedforward": 24, "dropout": 0.0, "norm_first": True, "activation": "gelu", "batch_first": True}
    layer = transformer_block_torch.TransformerEncoderLayer(16, 2, dtype=torch.float64, **options)
    calls = {
        "mha": (
            attention,
            lambda f, x, rows: f(x, x, x, key_padding_mask=padding[:, rows], need_weights=False)[0],
            x,
            0,
        ),
        "encoder_layer": (layer, lambda f, x, rows: f(x, src_key_padding_mask=padding[:, rows]), x.transpose(0, 1), 1),
    }
    errors = {}
    for name, (module, call, inputs, axis) in calls.items():
        whole = inputs.clone().requires_grad_()
        out = call(module, whole, slice(None))
        torch.manual_seed(8)
        grad = torch.randn_like(out)
        out.backward(grad)
        want = {k: p.grad.clone() for k, p in module.named_parameters()}
        module.zero_grad()
        local = inputs.index_select(axis, mine).clone().requires_grad_()
        ring_out = call(context_parallel(module), local, mine)
        ring_out.backward(grad.index_select(axis, mine))
        gaps = [(ring_out - out.index_select(axis, mine)).abs().max().item()]
        gaps.append((local.grad - whole.grad.index_select(axis, mine)).abs().max().item())
        for k, p in module.named_parameters():
            dist.all_reduce(p.grad)
            gaps.append((p.grad - want[k]).abs().max().item())
        errors[name] = max(gaps)
    return errors
