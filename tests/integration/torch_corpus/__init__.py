"""A corpus of attention implementations for ``sa.from_torch``: each entry makes its function or module and
example arguments at given sizes (float64), so the tests trace at one set of sizes and compare at another."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_corpus import functions as fn
from torch_corpus import hf
from torch_corpus import modules as mod

HEADS = 2  # a module's head count is part of its spec (a number): the same at every size


@dataclass(frozen=True)
class Entry:
    """name, and make(sizes, generator) → (function or module, arguments)."""

    name: str
    make: Callable


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _module(module: torch.nn.Module, g: torch.Generator) -> torch.nn.Module:
    """The module in float64, eval mode, its parameters drawn from g (deterministic, not too small)."""
    module = module.double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * _randn(g, *p.shape) if p.ndim else p + 0.1 * _randn(g))
    return module


def _annotated(s, g):
    mask = torch.ones(s["n"], s["m"], dtype=torch.bool).tril()
    args = (_randn(g, s["B"], s["n"], s["d"]), _randn(g, s["B"], s["m"], s["d"]), _randn(g, s["B"], s["m"], s["dv"]))
    return fn.annotated_attention, (*args, mask)


def _weights(s, g):
    x = _randn(g, s["B"], s["n"], s["d"])
    return fn.weights_attention, (x, _randn(g, s["d"], s["dk"]), _randn(g, s["d"], s["dk"]), _randn(g, s["d"], s["dv"]))


def _qkv(s, g):
    return (_randn(g, s["B"], s["n"], s["dk"]), _randn(g, s["B"], s["m"], s["dk"]), _randn(g, s["B"], s["m"], s["dv"]))


def _pointer(s, g):
    return fn.pointer_log_attention, (
        _randn(g, s["B"], s["n"], s["d"]),
        _randn(g, s["d"], s["dk"]),
        _randn(g, s["d"], s["dk"]),
    )


def _padded(s, g):
    padding = torch.zeros(s["B"], s["m"], dtype=torch.bool)
    padding[0, -2:] = True  # the first sequence's last two keys are padding
    return fn.padded_attention, (*_qkv(s, g), padding)


def _no_self(s, g):
    return fn.no_self_attention, (
        _randn(g, s["B"], s["n"], s["d"]),
        _randn(g, s["d"], s["dk"]),
        _randn(g, s["d"], s["dk"]),
    )


def _width(s):
    return HEADS * s["dh"]


ENTRIES = [
    Entry("annotated_attention", _annotated),
    Entry("weights_attention", _weights),
    Entry("causal_where_attention", lambda s, g: (fn.causal_where_attention, _qkv(s, g))),
    Entry(
        "sigmoid_attention",
        lambda s, g: (fn.sigmoid_attention, (*_qkv(s, g), torch.tensor(-math.log(s["m"]), dtype=torch.float64))),
    ),
    Entry("relu_attention", lambda s, g: (fn.relu_attention, _qkv(s, g))),
    Entry("pointer_log_attention", _pointer),
    Entry("padded_attention", _padded),
    Entry("no_self_attention", _no_self),
    Entry(
        "causal_self_attention",
        lambda s, g: (
            _module(mod.CausalSelfAttention(_width(s), HEADS, block_size=16), g),
            (_randn(g, s["B"], s["n"], _width(s)),),
        ),
    ),
    Entry(
        "bert_self_attention",
        lambda s, g: (_module(mod.BertSelfAttention(_width(s), HEADS), g), (_randn(g, s["B"], s["n"], _width(s)),)),
    ),
    Entry(
        "relative_bias_attention",
        lambda s, g: (
            _module(mod.RelativeBiasAttention(s["d"], s["dk"], s["n"]), g),
            (_randn(g, s["B"], s["n"], s["d"]),),
        ),
    ),
    Entry(
        "softcap_attention",
        lambda s, g: (_module(mod.SoftcapAttention(s["d"], HEADS, s["dh"]), g), (_randn(g, s["B"], s["n"], s["d"]),)),
    ),
    Entry(
        "einsum_attention",
        lambda s, g: (_module(mod.EinsumAttention(s["d"], HEADS, s["dh"]), g), (_randn(g, s["B"], s["n"], s["d"]),)),
    ),
    Entry(
        "cosine_attention", lambda s, g: (_module(mod.CosineAttention(s["d"]), g), (_randn(g, s["B"], s["n"], s["d"]),))
    ),
    Entry(
        "differential_attention",
        lambda s, g: (_module(mod.DifferentialAttention(s["d"], s["dk"]), g), (_randn(g, s["B"], s["n"], s["d"]),)),
    ),
    Entry(
        "timm_attention",
        lambda s, g: (_module(mod.TimmAttention(_width(s), HEADS), g), (_randn(g, s["B"], s["n"], _width(s)),)),
    ),
    Entry(  # one fused projection split in three: products with blocks of its weight
        "fused_causal_self_attention",
        lambda s, g: (
            _module(mod.FusedCausalSelfAttention(_width(s), HEADS), g),
            (_randn(g, s["B"], s["n"], _width(s)),),
        ),
    ),
    Entry(
        "timm_fused_attention",
        lambda s, g: (_module(mod.TimmFusedAttention(_width(s), HEADS), g), (_randn(g, s["B"], s["n"], _width(s)),)),
    ),
    Entry(  # GPT-2's Conv1D: addmm on the flattened rows, the weight (in, out)
        "gpt2_attention",
        lambda s, g: (
            _module(hf.First(hf.GPT2Attention(_width(s), HEADS)), g),
            (_randn(g, s["B"], s["n"], _width(s)),),
        ),
    ),
    Entry(
        "temperature_alibi_attention",
        lambda s, g: (_module(mod.TemperatureAlibiAttention(s["d"], s["n"]), g), (_randn(g, s["B"], s["n"], s["d"]),)),
    ),
    Entry(
        "pre_ln_block",
        lambda s, g: (_module(mod.PreLNBlock(_width(s), HEADS, s["ff"]), g), (_randn(g, s["B"], s["n"], _width(s)),)),
    ),
    Entry(
        "pre_ln_block_tanh",
        lambda s, g: (
            _module(mod.PreLNBlock(_width(s), HEADS, s["ff"], approximate="tanh"), g),
            (_randn(g, s["B"], s["n"], _width(s)),),
        ),
    ),
]

# the sizes the corpus is traced at, and the new ones it is compared at (every size differs)
EXAMPLE_SIZES = {"B": 2, "n": 5, "m": 6, "d": 7, "dk": 3, "dv": 4, "dh": 3, "ff": 11}
NEW_SIZES = {"B": 3, "n": 9, "m": 8, "d": 10, "dk": 5, "dv": 2, "dh": 5, "ff": 6}
