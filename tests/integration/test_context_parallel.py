"""Context parallelism (symattn.distributed.context_parallel) for the generated attention module: each of 4 gloo
processes on the CPU (and of a group of 2 of them) holds its block of the sequence's rows and gets its rows of the
output, of every gradient and of the JVP (``.jvp``, tangents by input name), equal (float64, ≤ 1e-10) to the
single-process module's (forward, backward, ``jvp``) and to torch autograd (reverse and forward mode) of an
independent softmax attention, plain, cross (fewer keys than queries) and causal, at lengths the world size does
not divide (one with fewer rows than ranks: a rank holds none), contiguous and zig-zag balanced, over the world,
a group of two of its ranks and a 1-d DeviceMesh; with a key_padding_mask (its block travels with the keys), rows
with no key left giving zeros.

Checked besides: no rank holds more than two other ranks' key blocks at once (``ring.HELD``'s peak, which a plain
ring of 4 reaches), key blocks a causal mask hides are neither sent (rank 0 receives none) nor computed (the
pairs of chunks each rank computes: r + 1 contiguous, 2P + 1 balanced: the same on every rank), and the one-line
refusals. One spawn runs every case (ring_cases.py, in a subprocess of its own session).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import importlib  # noqa: E402
import runpy  # noqa: E402

import sympy as sp  # noqa: E402

import symattn as sa  # noqa: E402
from symattn.codegen.generate import render  # noqa: E402
from symattn.errors import SymattnError  # noqa: E402
from symattn.lang.positions import I, J  # noqa: E402
from symattn.specs import dim  # noqa: E402

GALLERY = Path(__file__).resolve().parents[2] / "examples" / "specs"

CASES = ("plain", "plain_uneven", "cross", "causal", "causal_uneven", "causal_balanced", "few_rows", "padding")
CASES += ("padding_causal",)


def positions_spec() -> sa.Spec:
    """Cross attention with a relative bias and a window aligned to the last key, which reads the lengths n and m:
    A = Q Kᵀ/√d − |i − j|/2 where 0 ≤ i − j + m − n < 6, −∞ elsewhere."""
    n, m, d = dim("n"), dim("m"), dim("d")
    q, k, v = sa.matrix("Q", n, d), sa.matrix("K", m, d), sa.matrix("V", m, d)
    offset = I - J + m - n
    window = sa.entries(
        n, m, lambda i, j: -sp.Abs(i - j) / 2 + sp.Piecewise((0, (offset >= 0) & (offset < 6)), (-sp.oo, True))
    )
    return sa.Spec(
        "ring_positions", "a window aligned to the last key", (q, k, v), sa.softmax(q * k.T / sp.sqrt(d) + window) * v
    )


def _render(folder: Path, specs: dict) -> Path:
    """The torch (first order) and Triton modules of specs, written to the package folder."""
    folder.mkdir()
    (folder / "__init__.py").write_text("", encoding="utf-8")
    for name, spec in specs.items():
        (folder / f"{name}_torch.py").write_text(render(spec, "torch", second_order=False), encoding="utf-8")
        (folder / f"{name}_triton.py").write_text(render(spec, "triton"), encoding="utf-8")
    return folder


def _gallery(name: str) -> sa.Spec:
    return runpy.run_path(str(GALLERY / f"{name}.py"))["spec"]


def _run(args: list[str], seconds: int) -> str:
    """Run a script in its own session (its gloo processes killed with it on a timeout); its stderr."""
    with subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            pytest.fail(f"{args[0]} did not finish in {seconds} s:\n{stderr[-3000:]}")
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return stdout


def _spawn(tmp_path: Path, world: int) -> list[dict]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    pytest.importorskip("triton", reason="the ring runs the cores' eager form from the Triton modules")
    specs = {name: _gallery(name) for name in ("sigmoid_attention", "softplus_attention", "differential_attention")}
    package = _render(tmp_path / "ringspecs", specs | {"ring_positions": positions_spec()})
    script = Path(__file__).with_name("ring_cases.py")
    out = tmp_path / "ring"
    _run([str(script), str(world), f"file://{tmp_path / 'rendezvous'}", str(out), str(package)], 300)
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


@pytest.mark.slow
def test_context_parallel_attention_matches_one_process(tmp_path: Path) -> None:
    ranks = _spawn(tmp_path, 4)
    _check([results["world"] for results in ranks])
    for results in ranks:  # the balanced causal case over a 1-d DeviceMesh, the uneven one by the nn.Module
        assert max(results["world"]["mesh"]["errors"].values()) <= 1e-10
        assert max(results["world"]["module"]["errors"].values()) <= 1e-10
    for results in ranks:  # the drop-ins with torch's arguments: output, input and weights' gradients
        assert set(results["world"]["dropins"]) == {"mha", "encoder_layer"}
        assert max(results["world"]["dropins"].values()) <= 1e-10, results["world"]["dropins"]
    for results in ranks:  # specs with work outside their cores: forward, gradients (weights' summed), JVP
        for name, errors in results["world"]["specs"].items():
            assert set(errors) == {"forward", "backward", "jvp", "tangent"}, name
            assert max(errors.values()) <= 1e-10, (name, errors)
    _check([ranks[rank]["pair"] for rank in (1, 3)])  # the group of global ranks 1 and 3
    assert all(results["world"]["plain"]["peak"] == 2 for results in ranks)  # world 4: the bound reached, never passed


@pytest.mark.slow
def test_the_long_context_training_example_trains_as_one_process() -> None:
    """examples/long_context_training.py: FSDP2 + context parallelism over 2 gloo processes, three SGD steps of a
    model around the generated TransformerBlock (causal, zig-zag balanced), the losses those of one process."""
    pytest.importorskip("triton", reason="the ring runs the cores' eager form from the Triton modules")
    example = GALLERY.parent / "long_context_training.py"
    stdout = _run([str(example), "--world", "2", "--n", "32", "--steps", "3"], 300)
    assert "largest difference" in stdout and stdout.count("in one process") == 3, stdout


def _check(ranks: list[dict]) -> None:
    """Every rank's results of one group (in its rank order)."""
    world = len(ranks)
    for rank, results in enumerate(ranks):
        for name in CASES:
            result = results[name]
            assert result["rows"] > 0 or (name, rank, world) == ("few_rows", 3, 4), (world, rank, name)
            assert set(result["errors"]) == {"module", "autograd", "jvp module", "jvp autograd"}
            for against, error in result["errors"].items():
                assert error <= 1e-10, (world, rank, name, against, error)
            assert result["peak"] <= 2, (world, rank, name, result["peak"])
        assert results["causal"]["pairs"] == rank + 1, rank  # key blocks after the rank's rows: not computed
        assert results["causal_balanced"]["pairs"] == 2 * world + 1, rank
        assert results["plain"]["pairs"] == world, rank
        found = results["refusals"]
        assert all(message and "\n" not in message for message in found.values()), found
        assert "odd number" in found["odd"]
        assert f"(…, 4, {4 * world})" in found["tile"]  # the rank's 4 rows of every key
        assert "key_padding_mask: expected a bool tensor (…, 4)" in found["padding"]
    assert ranks[0]["causal"]["peak"] == 0  # rank 0 reads no other block: none is sent to it


def _refusal(call) -> str:
    with pytest.raises(SymattnError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_context_parallel_refuses_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the ring runs the cores' eager form from the Triton modules")
    from symattn.generated import attention_torch, mha_torch, transformer_block_torch

    from symattn.distributed import context_parallel

    specs = {name: _gallery(name) for name in ("relu_attention", "pointer_attention")}
    sys.path.insert(0, str(tmp_path))
    try:
        _render(tmp_path / "refused", specs)
        relu, pointer = (importlib.import_module(f"refused.{name}_torch") for name in specs)
    finally:
        sys.path.remove(str(tmp_path))
    wrapped = context_parallel(attention_torch.forward)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert "mixes rows: 1/n reads the sequence's length n" in _refusal(lambda: context_parallel(relu.forward))
    assert "has a column per position" in _refusal(lambda: context_parallel(pointer.forward))
    assert "balance must be" in _refusal(lambda: context_parallel(attention_torch.forward, balance="zigzag"))
    assert "K's tangent" in _refusal(lambda: wrapped.jvp(x, x, x, {"K": x[:2]}))
    with pytest.raises(ValueError, match="'W' is no input"):
        wrapped.jvp(x, x, x, {"W": x})
    if not torch.distributed.is_initialized():
        assert "init_process_group" in _refusal(lambda: wrapped(x, x, x))
    assert "generated torch or Triton module" in _refusal(lambda: context_parallel(torch.softmax))
    layer = transformer_block_torch.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0)  # post-LN ReLU
    assert "has no jvp" in _refusal(lambda: context_parallel(layer).jvp(x, {}))
    attention = mha_torch.MultiheadAttention(6, 2)
    assert "pass need_weights=False" in _refusal(lambda: context_parallel(attention)(x, x, x))
    mask = torch.zeros(4, 4, dtype=torch.bool)
    assert "attn_mask is checked" in _refusal(
        lambda: context_parallel(attention)(x, x, x, attn_mask=mask, need_weights=False)
    )
    with pytest.raises(ValueError, match="causal must be True or False"):
        wrapped(x, x, x, causal=1)
