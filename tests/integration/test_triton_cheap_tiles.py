"""The printed Triton kernels' entrywise code in its cheap forms (issue 53, "cheaper tiles"): the weights by exp2 of
A₂ = log₂(e)·A with the row statistic in base 2, dS's scalar applied once to dQ and dK, no where on G and dS where
they are already zero, each function call once per tile. Read from the rendered source (no kernel runs: the
interpreter tests check the numbers)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
import sympy as sp

import symattn as sa
from symattn.codegen.backends.triton.printer import scalar_factor, zero_with
from symattn.codegen.generate import render

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"


def _gallery(name: str) -> sa.Spec:
    return runpy.run_path(str(GALLERY / f"{name}_attention.py"))["spec"]


def _kernels(source) -> dict[str, str]:
    """Each @triton.jit kernel's source in the rendered module, by its name."""
    found = {}
    for part in render(source, "triton").split("@triton.jit\ndef ")[1:]:
        name = part.split("(", 1)[0]
        found[name] = part.split("\n\n\n", 1)[0]
    return found


@pytest.fixture(scope="module")
def kernels() -> dict[str, dict[str, str]]:
    softcap = _gallery("softcap")
    return {
        "attention": _kernels("attention"),  # plain softmax attention with its additive mask M
        "softcap": _kernels(softcap),
        "masked softcap": _kernels(sa.with_mask(softcap)),
        "sigmoid": _kernels(_gallery("sigmoid")),  # no softmax: G = dP is not zero where masked
        "pointer": _kernels(_gallery("pointer")),  # a log-softmax map
    }


@pytest.mark.parametrize("name", ["attention", "softcap", "masked softcap", "pointer"])
def test_the_softmax_kernels_take_exp2_of_base_2_logits_and_keep_the_statistic_in_base_2(kernels, name):
    found = kernels[name]
    for kernel, body in found.items():
        assert "tl.exp(" not in body, f"{name} {kernel}: an exp of the scores left: {body}"
    assert "tl.exp2(a - shift[:, None])" in found["_forward_kernel"]
    assert "shift + tl.log2(safe)" in found["_forward_kernel"]  # L₂ = m + log₂ l
    assert "tl.exp2(a - lse[" in found["_backward_kernel"]  # P = 2^(A₂ − L₂) from the saved statistic


def test_log2e_is_folded_into_the_scores_coefficient(kernels):
    forward = kernels["attention"]["_forward_kernel"]
    assert "c0 = tl.load(C + 0)  # scale/log(2)" in forward
    assert "a = (c0 * s) + (1.4426950408889634 * tile_M)" in forward
    assert "72.13475204444816 * f0" in kernels["softcap"]["_forward_kernel"]  # 50 / ln 2


def test_plain_attention_applies_the_scale_once_to_dq_and_dk(kernels):
    backward = kernels["attention"]["_backward_kernel"]
    assert re.findall(r"^ +ds = (.*?)(?:  #.*)?$", backward, re.M) == ["g", "g"]  # no c · G per dS entry
    assert "dq = dq * c1" in backward and "dk = dk * c1" in backward
    softcap = kernels["softcap"]["_backward_kernel"]
    assert re.findall(r"^ +ds = (.*?)(?:  #.*)?$", softcap, re.M) == ["g * ((-1.0 * (f0 * f0)) + 1.0)"] * 2
    assert "dq = dq * c1" in softcap and "dk = dk * c1" in softcap


@pytest.mark.parametrize("name", ["attention", "softcap", "masked softcap"])
def test_the_softmax_backward_masks_p_only(kernels, name):
    backward = kernels[name]["_backward_kernel"]
    assert "g = p * (dp - delta[:, None])" in backward and "g = p * (dp - delta[None, :])" in backward
    assert "g = _kept(" not in backward and "ds = _kept(" not in backward
    assert backward.count("p = _kept(tl.exp2(") == 2  # the query part's and the key part's
    if name == "attention":  # the mask's gradient tile G ⊙ ∂A/∂M = G: 0 where masked already
        assert "tl.store(at_M, g, mask=inside)" in backward


def test_a_cotangent_not_zero_where_masked_keeps_its_where_and_ds_takes_no_second(kernels):
    backward = kernels["sigmoid"]["_backward_kernel"]  # G = dP: nonzero where masked, so G takes the where
    assert backward.count("g = _kept(dp") == 2 and "ds = _kept(" not in backward  # dS = G ⊙ σ(1 − σ): 0 there
    pointer = kernels["pointer"]["_backward_kernel"]  # the map's G = dO − P ⊙ r 𝟏ᵀ takes it; dS = G (/ c) does not
    assert pointer.count("g = tl.where(valid") == 2 and re.findall(r"^ +ds = (.*?)(?:  #.*)?$", pointer, re.M) == [
        "g",
        "g",
    ]


@pytest.mark.parametrize("name", ["softcap", "masked softcap"])
def test_the_tanh_is_computed_once_per_tile(kernels, name):
    found = kernels[name]
    calls = {kernel: body.count("tl.sigmoid(") for kernel, body in found.items() if "tl.sigmoid(" in body}
    # tanh = 2σ(2x) − 1: once in the forward's and the JVP's tile, once in each backward part's (was 1, 4, 2)
    assert calls == {"_forward_kernel": 1, "_backward_kernel": 2, "_jvp_kernel": 1}
    assert "a_dot = 50.0 * ((c0 * s_dot) * ((-1.0 * (f0 * f0)) + 1.0))" in found["_jvp_kernel"]


def test_dS_factors_and_its_zero_where_G_is():
    n = sp.Symbol("n")
    g, s, m = (sp.MatrixSymbol(x, n, n) for x in ("G", "S", "M"))
    c = sp.Symbol("c")
    assert scalar_factor(c * sp.HadamardProduct(3 * g, sa.tanh(s))) == (3 * c, sp.HadamardProduct(g, sa.tanh(s)))
    assert zero_with(g, g, s) and zero_with(sp.HadamardProduct(g, sa.tanh(c * s)), g, s)
    assert not zero_with(sp.HadamardProduct(g, sa.exp(s)), g, s)  # e^S may overflow: ∞ · 0
    assert not zero_with(sp.HadamardProduct(g, m), g, s)  # a tile may hold −∞ where the mask hides it
    assert not zero_with(sp.HadamardProduct(g, sp.HadamardPower(s, -1)), g, s)  # 1/S at S = 0
    assert not zero_with(s, g, s)
