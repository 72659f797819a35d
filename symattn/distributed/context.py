"""``context_parallel``: a generated module's forward over a ring of ranks (CONTRACT.md, "Long sequences across
devices").

Each rank calls the wrapper with the arguments a single-device call takes, its sequence-long inputs holding only
its block of rows; it returns the rank's rows of the output, differentiable by autograd, and ``.jvp`` its rows'
tangents. The work is the spec's Triton module's (``<spec>_triton`` beside a torch module, or the Triton module
itself): its ``_compute`` runs everything outside the n × m cores on the rank's rows (row-local, which the module
states in ``MIXED_ROWS``), differentiated by autograd, and hands each core to the ring (``RingCore``) in place of
the kernels; the ring runs the core's eager form piece by piece (``passes``) and merges by its normaliser
(``merge``). No kernel is launched: the per-block work is torch's, on the CPU or the GPU.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from types import ModuleType

import torch
import torch.distributed as dist
from torch.autograd import forward_ad

from symattn.distributed.layout import check_balance, layout
from symattn.distributed.merge import merge_for
from symattn.distributed.passes import Plan, RingFunction, ring_forward
from symattn.distributed.ring import Ring
from symattn.errors import SymattnError


def _host(forward: Callable) -> tuple[ModuleType, ModuleType]:
    """(the generated module forward belongs to, the Triton module whose _compute and eager cores do the work)."""
    owner = type(forward) if isinstance(forward, torch.nn.Module) else forward
    module = sys.modules.get(getattr(owner, "__module__", None) or "")
    if module is None or not isinstance(getattr(module, "SPEC", None), str) or not callable(forward):
        raise SymattnError(f"context_parallel: expected a generated torch or Triton module's forward, got {forward!r}")
    if hasattr(module, "_compute") and hasattr(module, "MIXED_ROWS"):
        return module, module
    package = module.__name__.rpartition(".")[0]
    target = f"{package}.{module.SPEC}_triton" if package else f"{module.SPEC}_triton"
    try:
        return module, importlib.import_module(target)
    except ImportError as e:
        raise SymattnError(
            f"context_parallel: {module.SPEC} needs its Triton module {target} beside {module.__name__} (symattn "
            f"generate --backend triton; the triton package, no GPU): {e}"
        ) from None


class RingCore:
    """What the Triton module's _compute calls for each core in place of its kernels: the ring over the core."""

    def __init__(self, wrapper: ContextParallel, mask: torch.Tensor | None) -> None:
        self.wrapper, self.mask = wrapper, mask

    def __call__(self, core: tuple, Q, K, V, causal, deterministic, symbols, *tensors) -> torch.Tensor:
        """O of the core by the ring (its eager form per block; deterministic unread: the ring's sums are in order)."""
        if not dist.is_initialized():
            raise SymattnError("context_parallel: torch.distributed is not initialised (init_process_group first)")
        eager, record = core[3], core[4]
        merge = merge_for(self.wrapper.spec, record)
        padding = None
        if self.mask is not None:
            if record["mask"] is None:
                raise SymattnError(
                    f"context_parallel: {self.wrapper.spec}'s core reads no mask a key_padding_mask adds to"
                )
            padding = _column(self.mask, forward_ad.unpack_dual(K).primal)
        ring = Ring(self.wrapper.group)
        queries, keys = ring.lengths(Q.device, Q.shape[-2], K.shape[-2])
        if causal and queries != keys:
            raise SymattnError(
                f"context_parallel: causal needs each rank's query and key blocks of one length, got {queries} and "
                f"{keys} rows"
            )
        _check_tiles(tensors[: record["tiles"]], Q.shape[-2], sum(keys))
        whole = dict(symbols)
        for name, total in zip(record["rows"], (sum(queries), sum(keys))):
            if name in whole:  # a formula reading a length reads the whole sequence's
                whole[name] = total
        balance = self.wrapper.balance
        laid = (layout(queries, balance), layout(keys, balance))
        dual = any(_tangent(x) is not None for x in (Q, K, V, *tensors))
        padded, tiles = padding is not None, record["tiles"]
        plan = Plan(eager, merge, ring, *laid, causal, whole, padded, record["mask"], dual, tiles)
        if not dual:
            return RingFunction.apply(plan, Q, K, V, padding, *tensors)
        primal = [forward_ad.unpack_dual(x).primal for x in (K, V)]
        moving = [_tangent(x) if _tangent(x) is not None else torch.zeros_like(p) for x, p in zip((K, V), primal)]
        block = primal + moving + ([] if padding is None else [padding])
        return merge.finish(ring_forward(plan, Q, block, tensors)).to(V.dtype)


class _Route:
    """What a drop-in's call to the spec's Triton module reaches inside context parallelism: its forward, run by
    the Triton module's _compute with the ring for its cores."""

    def __init__(self, wrapper: ContextParallel, mask) -> None:
        self.wrapper, self.mask, self.taken = wrapper, mask, False

    def forward(self, *args, **kwargs) -> torch.Tensor:
        self.taken = True
        bound = self.wrapper.compute.bind(*args, **kwargs)
        bound.apply_defaults()
        return self.wrapper.host._compute(RingCore(self.wrapper, self.mask), **bound.arguments)


def _tangent(x) -> torch.Tensor | None:
    return forward_ad.unpack_dual(x).tangent if isinstance(x, torch.Tensor) else None


def _check_tiles(tensors, rows: int, keys: int) -> None:
    """A SymattnError of one line unless each n × m tile holds the rank's rows (or 1) of every key (or 1)."""
    for x in tensors:
        if (
            isinstance(x, torch.Tensor)
            and x.dim() >= 2
            and (x.shape[-2] not in (1, rows) or x.shape[-1] not in (1, keys))
        ):
            raise SymattnError(
                f"context_parallel: an n × m mask or bias holds the rank's rows of every key, (…, {rows}, {keys}), "
                f"got {tuple(x.shape)}"
            )


class ContextParallel:
    """A generated forward over a ring of ranks: call it as the forward, each rank with its block of rows."""

    def __init__(self, forward: Callable, group=None, balance: str | None = None) -> None:
        module, self.host = _host(forward)
        self.spec = module.SPEC
        if self.host.MIXED_ROWS:
            raise SymattnError(
                f"context_parallel: {self.spec}'s work outside its n × m cores mixes rows: {self.host.MIXED_ROWS}"
            )
        check_balance(balance)
        self.balance = balance
        self.group = group.get_group() if hasattr(group, "get_group") else group  # a 1-d DeviceMesh: its group
        self.compute = inspect.signature(self.host.forward)
        self.jvp_signature = inspect.signature(self.host.jvp)
        self.signature, self.module, self.own, self.dropin = inspect.signature(forward), forward, (), None
        if isinstance(forward, torch.nn.Module):  # its weights and options are its attributes
            self.signature = inspect.signature(forward.forward)
            # a drop-in takes torch's arguments (src, need_weights, …): it runs as itself, its kernels' call routed
            self.dropin = module if self.signature.parameters.keys() - self.compute.parameters.keys() else None
            names = self.compute.parameters.keys() - self.signature.parameters.keys()
            self.own = tuple(name for name in sorted(names) if hasattr(forward, name))

    def _arguments(self, signature: inspect.Signature, args, kwargs) -> tuple[dict, torch.Tensor | None]:
        """(the arguments of the host's function of signature's name, the module's own filled in and defaults
        applied, key_padding_mask None; the rank's key_padding_mask)."""
        try:
            # the module's weights read at each call (FSDP gathers them whole in its forward's pre-hook)
            given = dict(signature.bind(*args, **kwargs).arguments) | {x: getattr(self.module, x) for x in self.own}
            host = self.jvp_signature if "tangents" in signature.parameters else self.compute
            bound = host.bind(**given)
        except TypeError as e:
            raise TypeError(f"context_parallel({self.spec}): {e}") from None
        bound.apply_defaults()
        return _without_padding(dict(bound.arguments))

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """The rank's rows of the output, differentiable by the ring's backward."""
        if self.dropin is not None:
            return self._dropin(args, kwargs)
        arguments, mask = self._arguments(self.signature, args, kwargs)
        return self.host._compute(RingCore(self, mask), **arguments)

    def _dropin(self, args, kwargs):
        """A drop-in's call with torch's arguments: the module runs as itself (its layouts, projections and masks),
        the call it makes to the spec's kernels taken by the ring (its module's ``_RING``); its key padding mask
        travels with the keys. need_weights (n × m weights over every rank's keys) and an n × m mask (torch's checks
        it against the rank's keys) are refused; a configuration
        whose call never reaches the kernels is refused after the call, its result dropped."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"context_parallel({type(self.module).__name__}): {e}") from None
        bound.apply_defaults()
        if bound.arguments.get("need_weights"):
            raise SymattnError(
                f"context_parallel: {type(self.module).__name__} returns no attention weights across ranks; pass "
                "need_weights=False"
            )
        masks = [k for k, v in bound.arguments.items() if k.endswith("mask") and "padding" not in k and v is not None]
        if masks:  # torch's layer checks it against the rank's keys: an n × m mask holds every rank's
            raise SymattnError(
                f"context_parallel: {type(self.module).__name__}'s {masks[0]} is checked against the rank's keys; "
                f"pass the n × m mask to the generated {self.spec} module (M: the rank's rows of every key)"
            )
        arguments, mask = _without_padding(bound.arguments)
        bound.arguments.update(arguments)
        route = _Route(self, mask)
        self.dropin._RING.append(route)
        try:
            out = self.module(*bound.args, **bound.kwargs)
        finally:
            self.dropin._RING.pop()
        if not route.taken:
            raise SymattnError(
                f"context_parallel: this configuration of {type(self.module).__name__} does not run the spec's "
                f"{self.spec} core (it has no Triton module: {self.host.__name__} computes another); use the "
                "generated module's configuration"
            )
        return out

    def jvp(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rank's rows of the output, of its derivative along the tangents): called as the module's jvp,
        tangents a dict by input name (an input left out: zero), each of this rank's rows. The tangents of the keys
        and values travel round the ring with their blocks; forward-mode autograd carries them through the merges."""
        if self.dropin is not None:
            raise SymattnError(
                f"context_parallel: {type(self.module).__name__} has no jvp (wrap the generated forward)"
            )
        arguments, mask = self._arguments(self.jvp_signature, args, kwargs)
        tangents = self.host._tangents(arguments.pop("tangents"))
        inputs = [arguments.pop(name) for name in self.host.TANGENT_OF]
        for name, x in zip(self.host.TANGENT_OF, inputs):
            if name in tangents and getattr(tangents[name], "shape", None) != getattr(x, "shape", None):
                raise SymattnError(f"tangents: {name}'s tangent must be a tensor of its rows' shape {tuple(x.shape)}")
        with forward_ad.dual_level():
            duals = self.host._duals(tangents, *inputs)
            out = self.host._compute(RingCore(self, mask), **arguments, **dict(zip(self.host.TANGENT_OF, duals)))
            primal, tangent = forward_ad.unpack_dual(out)
        return primal, torch.zeros_like(primal) if tangent is None else tangent


def _without_padding(arguments: dict) -> tuple[dict, torch.Tensor | None]:
    """(the arguments with their key padding mask — key_padding_mask, a drop-in's src_key_padding_mask — None, that
    mask): it travels round the ring with the keys instead (``_column``)."""
    name = next((k for k in arguments if k.endswith("key_padding_mask")), None)
    if name is None:
        return arguments, None
    return {**arguments, name: None}, arguments[name]


def _column(mask, K: torch.Tensor) -> torch.Tensor:
    """The rank's key_padding_mask ((..., m_r) bool, True: ignore the key) as a column (..., m_r, 1) of 0 and −∞
    added to its keys' scores, which travels round the ring with them."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape[-1:] != K.shape[-2:-1]:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise SymattnError(
            f"key_padding_mask: expected a bool tensor (…, {K.shape[-2]}) of this rank's keys, got {got}"
        )
    column = torch.zeros(mask.shape, dtype=K.dtype, device=K.device).masked_fill_(mask, float("-inf"))
    return column.unsqueeze(-1)


def context_parallel(forward: Callable, group=None, *, balance: str | None = None) -> ContextParallel:
    """forward (a generated torch or Triton module's, or its nn.Module, whose weights and options are its
    attributes) over the ranks of group (default: the world; a 1-d DeviceMesh: its group): each rank passes its
    block of the sequence's rows (contiguous in rank order, or ``balance="causal"``: the zig-zag chunks r and
    2P − 1 − r, concatenated) and gets its rows of the output; backward gives its rows' gradients and its share of
    every weight's, ``.jvp`` its rows' tangents. Keys and values travel round the ring; the shares of each core
    merge by its normaliser."""
    return ContextParallel(forward, group, balance)
