"""``context_parallel``: a generated torch module's forward over a ring of ranks (CONTRACT.md, "Long sequences
across devices").

Each rank calls the wrapper with the arguments a single-device call takes, its sequence-long inputs (the core's
queries, keys and values) holding only its block of rows; it returns the rank's rows of the output,
differentiable by autograd. The spec is the module's (its ``SPEC``); its n × m core and normaliser are found as
the Triton kernels find them (``find_cores``), the normaliser chooses the merge (``merge.MERGES``), and the
per-block work is the spec's memory-efficient torch module's (``<spec>_torch_memeff`` beside it: the row
statistic it saves is what a merge needs).

This first slice takes a spec that is one core reading its inputs directly (``attention``), causal or not, with a
key_padding_mask or none (its block travels with the keys); an n × m mask and a spec with work outside its core
are refused in one line.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from types import ModuleType

import sympy as sp
import torch
import torch.distributed as dist

from symattn.codegen.backends.triton.core import Core, find_cores
from symattn.distributed.layout import check_balance, layout
from symattn.distributed.merge import merge_for
from symattn.distributed.passes import Plan, RingFunction, ring_forward
from symattn.distributed.ring import Ring
from symattn.errors import SymattnError
from symattn.specs import spec as builtin_spec
from symattn.specs import specs as builtin_specs

MASKS = ("M", "attn_mask")  # the masks of the module's forward this slice refuses (key_padding_mask travels with K)


def _module(forward: Callable) -> ModuleType:
    """The generated module a forward function belongs to (its module names a SPEC)."""
    module = sys.modules.get(getattr(forward, "__module__", None) or "")
    if module is None or not isinstance(getattr(module, "SPEC", None), str) or not callable(forward):
        raise SymattnError(f"context_parallel: expected a generated torch module's forward, got {forward!r}")
    return module


def _blocks_module(module: ModuleType) -> ModuleType:
    """The memory-efficient torch module of the module's spec (itself where it is one): its _forward saves the row
    statistic a merge reads."""
    name = module.__name__
    if name.endswith("_torch_memeff"):
        return module
    package = name.rpartition(".")[0]
    target = f"{package}.{module.SPEC}_torch_memeff" if package else f"{module.SPEC}_torch_memeff"
    try:
        return importlib.import_module(target)
    except ImportError:
        raise SymattnError(
            f"context_parallel: {module.SPEC} needs its memory-efficient torch module {target} beside {name} "
            "(symattn generate --backend torch --variant memeff)"
        ) from None


def _core(name: str) -> Core:
    """The spec's one core, checked to read the spec's inputs directly and to be its output (nothing outside it)."""
    if name not in builtin_specs():
        raise SymattnError(f"context_parallel: {name!r} is not a built-in spec; this first slice takes 'attention'")
    spec = builtin_spec(name)
    cores = find_cores(spec)
    core = cores.cores[0]
    inputs = set(spec.inputs)
    direct = all(isinstance(x, sp.MatrixSymbol) and x in inputs for x in (core.query, core.key, core.value))
    if len(cores.cores) != 1 or cores.rest != core.output or not direct or core.tiles or core.scalars:
        raise SymattnError(
            f"context_parallel: {name} has work outside its n × m core ({cores.rest} of O = N(A) V with Q = "
            f"{core.query}); this first slice takes a spec that is one core reading its inputs, as 'attention'"
        )
    return core


class ContextParallel:
    """A generated forward over a ring of ranks: call it as the forward, each rank with its block of rows."""

    def __init__(self, forward: Callable, group=None, balance: str | None = None) -> None:
        module = _module(forward)
        self.core = _core(module.SPEC)
        self.merge = merge_for(module.SPEC, self.core.normaliser)
        check_balance(balance)
        self.forward, self.blocks, self.balance = forward, _blocks_module(module), balance
        self.spec = module.SPEC
        self.group = group.get_group() if hasattr(group, "get_group") else group  # a 1-d DeviceMesh: its group
        self.jvp_signature = inspect.signature(module.jvp)
        # the block module's options after causal (scale, block_size), in its _forward's order
        names = list(inspect.signature(self.blocks._forward).parameters)
        self.options = tuple(names[names.index("causal") + 1 :])
        self.signature, self.fixed = inspect.signature(forward), {}
        if isinstance(forward, torch.nn.Module):  # the generated nn.Module: its options are its attributes
            self.signature = inspect.signature(forward.forward)
            options = inspect.signature(module.forward).parameters.keys() - self.signature.parameters.keys()
            self.fixed = {name: getattr(forward, name) for name in sorted(options) if hasattr(forward, name)}

    def _arguments(self, args, kwargs) -> tuple[list[torch.Tensor], bool, tuple, torch.Tensor | None]:
        """(Q, K, V by the core's names, causal, the block module's options after causal, the keys' padding column),
        the masks of MASKS refused."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"context_parallel({self.spec}): {e}") from None
        given = dict(bound.arguments) | self.fixed
        masks = [name for name in MASKS if given.get(name) is not None]
        if masks:
            raise SymattnError(
                f"context_parallel: {masks[0]} is not supported yet (causal and key_padding_mask are; an n × m mask "
                "at global positions is not)"
            )
        names = [str(x.name) for x in (self.core.query, self.core.key, self.core.value)]
        tensors = [given.get(name) for name in names]
        if any(not isinstance(t, torch.Tensor) for t in tensors):
            raise TypeError(f"context_parallel({self.spec}): expected tensors {', '.join(names)}")
        causal = given.get("causal", False)
        if type(causal).__name__ not in ("bool", "bool_"):  # as the module takes it: True or False
            raise ValueError(f"causal must be True or False, got {causal!r}")
        options = tuple(given.get(name) for name in self.options)
        return tensors, bool(causal), options, _padding(given.get("key_padding_mask"), tensors[1])

    def plan(self, Q: torch.Tensor, K: torch.Tensor, causal: bool, options: tuple, padded: bool) -> Plan:
        """The call's plan: the ranks' row counts gathered (one all_gather) and laid out."""
        ring = Ring(self.group)
        queries, keys = ring.lengths(Q.device, Q.shape[-2], K.shape[-2])
        if causal and queries != keys:
            raise SymattnError(
                f"context_parallel: causal needs each rank's query and key blocks of one length, got {queries} and "
                f"{keys} rows"
            )
        laid = (layout(queries, self.balance), layout(keys, self.balance))
        return Plan(self.blocks, self.merge, ring, *laid, causal, dict(zip(self.options, options)), padded)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        """The rank's rows of the output, differentiable by the ring's backward."""
        (Q, K, V), causal, options, padding = self._arguments(args, kwargs)
        self._initialised()
        return RingFunction.apply(self.plan(Q, K, causal, options, padding is not None), Q, K, V, padding)

    def jvp(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rank's rows of O, of its derivative along the tangents): called as the module's jvp, tangents a dict
        by input name (an input left out: zero), each of this rank's rows. The tangents of K and V travel round the
        ring with their blocks; the partials and their statistics' tangents merge by the normaliser's rule."""
        try:
            bound = self.jvp_signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"context_parallel({self.spec}).jvp: {e}") from None
        tangents = bound.arguments.get("tangents")
        if not isinstance(tangents, dict):
            raise TypeError(f"tangents: expected a dict from input names to tensors, got {type(tangents).__name__}")
        given = {name: x for name, x in bound.arguments.items() if name != "tangents" and name not in self.fixed}
        (Q, K, V), causal, options, padding = self._arguments((), given)
        names = [str(x.name) for x in (self.core.query, self.core.key, self.core.value)]
        unknown = [name for name in tangents if name not in names]
        if unknown:
            raise SymattnError(f"tangents: {unknown[0]!r} is no input; inputs: {', '.join(names)}")
        dots = [tangents.get(name) for name in names]
        dots = [torch.zeros_like(x) if t is None else t for x, t in zip((Q, K, V), dots)]
        wrong = [
            name for name, x, t in zip(names, (Q, K, V), dots) if not isinstance(t, torch.Tensor) or t.shape != x.shape
        ]
        if wrong:
            raise SymattnError(f"tangents: {wrong[0]}'s tangent must be a tensor of its rows' shape")
        self._initialised()
        with torch.no_grad():
            plan = self.plan(Q, K, causal, options, padding is not None)
            keys = [K, V, *dots[1:]] + ([] if padding is None else [padding])
            merged, _ = ring_forward(plan, [Q, dots[0]], keys)
        return merged[0], merged[2]  # (O, L, Ȯ, L̇)

    @staticmethod
    def _initialised() -> None:
        if not dist.is_initialized():
            raise SymattnError("context_parallel: torch.distributed is not initialised (init_process_group first)")


def _padding(mask, K: torch.Tensor) -> torch.Tensor | None:
    """The rank's key_padding_mask ((..., m_r) bool, True: ignore the key) as a column (..., m_r, 1) of 0 and −∞
    added to its keys' scores, which travels round the ring with them; None without one."""
    if mask is None:
        return None
    shape = (*K.shape[:-2], K.shape[-2])
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise SymattnError(f"key_padding_mask: expected a bool tensor of this rank's keys, shape {shape}, got {got}")
    column = torch.zeros(shape, dtype=K.dtype, device=K.device).masked_fill_(mask, float("-inf"))
    return column.unsqueeze(-1)


def context_parallel(forward: Callable, group=None, *, balance: str | None = None) -> ContextParallel:
    """forward (a generated torch module's, or its nn.Module, whose options such as scale are its attributes) over
    the ranks of group (default: the world; a 1-d DeviceMesh: its group): each rank passes its block of the
    sequence's rows (contiguous in rank order, or ``balance="causal"``: the zig-zag chunks r and 2P − 1 − r,
    concatenated) and gets its rows of the output; backward gives its rows' gradients, ``.jvp`` its rows' tangents.
    Keys and values travel round the ring; the partial outputs merge by the core's normaliser."""
    return ContextParallel(forward, group, balance)
