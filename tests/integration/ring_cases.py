# ruff: noqa: E741 (O, the attention output, is the derivation's name)
"""The context-parallel cases one spawn of gloo processes runs (test_context_parallel.py runs this file in a
subprocess: ``python ring_cases.py WORLD INIT OUT``): over the world (4), then over a group of two of its ranks
(global ranks 1 and 3). Every rank runs every case on its block of the same seeded float64 data and saves, per
case, the largest differences from the single-process generated module and from an
independent torch-autograd softmax attention, and the peak count of other ranks' key blocks alive; each rank leaves
by ``os._exit`` (gloo_step.py's docstring says why).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ring_specs import cases as spec_cases
from ring_specs import dropin_case, spec_case
from symattn.generated import attention_torch, attention_triton
from torch.distributed.device_mesh import init_device_mesh

from symattn.distributed import context_parallel
from symattn.distributed.ring import HELD
from symattn.errors import SymattnError

# (name, batch shape, (query rows, key rows), causal, balance, scale): lengths that no world size divides among them
CASES = [
    ("plain", (2, 3), (16, 16), False, None, None),
    ("plain_uneven", (2,), (13, 13), False, None, 0.7),
    ("cross", (2,), (13, 9), False, None, None),
    ("causal", (2, 3), (16, 16), True, None, None),
    ("causal_uneven", (), (11, 11), True, None, None),
    ("causal_balanced", (2,), (24, 24), True, "causal", None),
    ("few_rows", (2,), (3, 3), True, None, None),  # fewer rows than ranks: a rank of none
    ("padding", (3,), (13, 13), False, None, None, True),
    ("padding_causal", (3,), (16, 16), True, "causal", None, True),  # rows with no key left: zeros
]
KEEP_ALIVE: list = []
PAIR = [1, 3]  # the global ranks of the group of two
PAIRS = [0]  # the (query chunk, key chunk) pairs the ring's forward computed on this rank


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a − b| (0 for empty tensors)."""
    return (a - b).abs().max().item() if a.numel() else 0.0


def counted(eager):
    """The Triton module's eager core (one piece's work in the ring), counting its calls in PAIRS."""

    @functools.wraps(eager)
    def count(*args, **kwargs):
        PAIRS[0] += 1
        return eager(*args, **kwargs)

    return count


def padding_mask(batch, m: int) -> torch.Tensor:
    """A key_padding_mask (…, m): about a third of the keys ignored, and the first three of the last sequence."""
    torch.manual_seed(2)
    mask = torch.rand(*batch, m) < 0.3
    mask[..., -1, :3] = True
    return mask


def reference(Q, K, V, causal, scale, padding=None):
    """softmax(scale Q Kᵀ + causal mask + padding) V in plain torch ops (autograd differentiates it); a row with no
    key left gives zeros."""
    scale = Q.shape[-1] ** -0.5 if scale is None else scale
    A = scale * Q @ K.mT
    if padding is not None:
        A = A.masked_fill(padding.unsqueeze(-2), float("-inf"))
    if causal:
        n = A.shape[-1]
        A = A.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    empty = (A == float("-inf")).all(dim=-1, keepdim=True)  # no key left: P = 0 (A's row replaced, then zeroed)
    return (torch.softmax(A.masked_fill(empty, 0.0), dim=-1) * ~empty) @ V


def rows(n: int, world: int, rank: int, balance) -> torch.Tensor:
    """The global row indices rank holds: torch.tensor_split's block, or the zig-zag chunks r and 2P − 1 − r."""
    if balance is None:
        return torch.tensor_split(torch.arange(n), world)[rank]
    chunks = torch.tensor_split(torch.arange(n), 2 * world)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])


def case(group, batch, lengths: tuple[int, int], causal: bool, balance, scale, padded=False, module=None) -> dict:
    """One case on the ranks of group (a process group, None: the world, or a 1-d DeviceMesh): the largest
    differences, the peak of key blocks held, the pairs computed."""
    process_group = group.get_group() if hasattr(group, "get_group") else group
    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    torch.manual_seed(0)
    n, m = lengths
    Q, K = torch.randn(*batch, n, 5, dtype=torch.float64), torch.randn(*batch, m, 5, dtype=torch.float64)
    V, dO = torch.randn(*batch, m, 3, dtype=torch.float64), torch.randn(*batch, n, 3, dtype=torch.float64)
    mine, keys = rows(n, world, rank, balance), rows(m, world, rank, balance)
    local = [x[..., rows_, :].clone().requires_grad_() for x, rows_ in zip((Q, K, V), (mine, keys, keys))]
    padding = padding_mask(batch, m) if padded else None
    masks = {"key_padding_mask": padding, "causal": causal, "scale": scale}
    mine_masks = masks | {"key_padding_mask": None if padding is None else padding[..., keys]}
    HELD.reset()
    PAIRS[0] = 0
    if module is None:
        O = context_parallel(attention_torch.forward, group, balance=balance)(*local, **mine_masks)
    else:  # the nn.Module: its own scale
        O = context_parallel(module, group, balance=balance)(
            *local, **{k: v for k, v in mine_masks.items() if k != "scale"}
        )
    pairs = PAIRS[0]
    O.backward(dO[..., mine, :])
    errors = {}
    for name, forward in (("module", attention_torch.forward), ("autograd", None)):
        whole = [x.clone().requires_grad_() for x in (Q, K, V)]
        out = forward(*whole, **masks) if forward else reference(*whole, causal, scale, padding)
        out.backward(dO)
        errors[name] = max(
            gap(O, out[..., mine, :]),
            *(gap(x.grad, w.grad[..., r, :]) for x, w, r in zip(local, whole, (mine, keys, keys))),
        )
    torch.manual_seed(1)
    dots = {name: torch.randn_like(x) for name, x in zip("QKV", (Q, K, V))}
    ring = context_parallel(attention_torch.forward, group, balance=balance)
    mine_dots = {name: t[..., r, :] for (name, t), r in zip(dots.items(), (mine, keys, keys))}
    out, tangent = ring.jvp(*(x.detach() for x in local), mine_dots, **mine_masks)
    want = attention_torch.jvp(Q, K, V, dots, **masks)
    primal = (Q, K, V)
    independent = torch.func.jvp(lambda *x: reference(*x, causal, scale, padding), primal, tuple(dots.values()))
    for name, (o, t) in (("jvp module", want), ("jvp autograd", independent)):
        errors[name] = max(gap(out, o[..., mine, :]), gap(tangent, t[..., mine, :]))
    return {"errors": errors, "peak": HELD.peak, "rows": len(mine), "pairs": pairs}


def refusals(group) -> dict:
    """The one-line errors of an odd block under balance='causal', an n × m mask without every key's column, a
    key_padding_mask of another length than the rank's keys (None where nothing was raised)."""
    x = torch.randn(4, 3, dtype=torch.float64)
    wrapped = context_parallel(attention_torch.forward, group)
    calls = {
        "odd": lambda: context_parallel(attention_torch.forward, group, balance="causal")(x[:3], x[:3], x[:3]),
        "tile": lambda: wrapped(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool)),
        "padding": lambda: wrapped(x, x, x, key_padding_mask=torch.zeros(3, dtype=torch.bool)),
    }
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except SymattnError as e:
            found[name] = str(e)
    return found


def worker(rank: int, world: int, init: str, out: str, package: str) -> None:
    code = 1
    try:
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
        KEEP_ALIVE.append(dist.group.WORLD)
        torch.set_num_threads(1)
        core = attention_triton._CORE
        attention_triton._CORE = (*core[:3], counted(core[3]), core[4])
        results = {name: case(None, *args) for name, *args in CASES}
        results["refusals"] = refusals(None)
        results["module"] = case(None, *CASES[1][1:], module=attention_torch.Attention(scale=0.7))  # scale 0.7
        results["mesh"] = case(init_device_mesh("cpu", (world,)), *CASES[-1][1:])  # a 1-d DeviceMesh for group
        results["specs"] = {name: spec_case(c, rows) for name, c in spec_cases(package).items()}
        results["dropins"] = dropin_case(rows)
        pair = dist.new_group(PAIR)  # a group of two ranks out of the world: ranks 1 and 3, as 0 and 1
        KEEP_ALIVE.append(pair)
        if rank in PAIR:
            results = {"world": results, "pair": {name: case(pair, *args) for name, *args in CASES}}
            results["pair"]["refusals"] = refusals(pair)
        else:
            results = {"world": results}
        dist.barrier()
        torch.save(results, f"{out}.{rank}")
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    world, init, out, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    sys.path.insert(0, os.path.dirname(folder))  # the rendered modules' package
    mp.spawn(worker, args=(world, init, out, os.path.basename(folder)), nprocs=world, join=True)
