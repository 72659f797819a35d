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
from symattn.errors import SymattnError  # noqa: E402

CASES = ("plain", "plain_uneven", "cross", "causal", "causal_uneven", "causal_balanced", "few_rows", "padding")
CASES += ("padding_causal",)


def _spawn(tmp_path: Path, world: int) -> list[dict]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    script = Path(__file__).with_name("ring_cases.py")
    out = tmp_path / "ring"
    args = [sys.executable, str(script), str(world), f"file://{tmp_path / 'rendezvous'}", str(out)]
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            _, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            pytest.fail(f"ring_cases.py did not finish in 180 s:\n{stderr[-3000:]}")
    assert process.returncode == 0, stderr[-3000:]
    return [torch.load(f"{out}.{rank}") for rank in range(world)]


@pytest.mark.slow
def test_context_parallel_attention_matches_one_process(tmp_path: Path) -> None:
    ranks = _spawn(tmp_path, 4)
    _check([results["world"] for results in ranks])
    for results in ranks:  # the balanced causal case over a 1-d DeviceMesh, the uneven one by the nn.Module
        assert max(results["world"]["mesh"]["errors"].values()) <= 1e-10
        assert max(results["world"]["module"]["errors"].values()) <= 1e-10
    _check([ranks[rank]["pair"] for rank in (1, 3)])  # the group of global ranks 1 and 3
    assert all(results["world"]["plain"]["peak"] == 2 for results in ranks)  # world 4: the bound reached, never passed


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
        assert "odd number" in results["refusals"]["odd"] and "\n" not in results["refusals"]["odd"]
    assert ranks[0]["causal"]["peak"] == 0  # rank 0 reads no other block: none is sent to it


def _refusal(call) -> str:
    with pytest.raises(SymattnError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_context_parallel_refuses_in_one_line() -> None:
    from symattn.generated import attention_torch, mha_torch

    from symattn.distributed import context_parallel

    wrapped = context_parallel(attention_torch.forward)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert "work outside its n × m core" in _refusal(lambda: context_parallel(mha_torch.forward))
    assert "balance must be" in _refusal(lambda: context_parallel(attention_torch.forward, balance="zigzag"))
    assert "'W' is no input" in _refusal(lambda: wrapped.jvp(x, x, x, {"W": x}))
    assert "K's tangent" in _refusal(lambda: wrapped.jvp(x, x, x, {"K": x[:2]}))
    assert "attn_mask" in _refusal(lambda: wrapped(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool)))
    assert "key_padding_mask" in _refusal(lambda: wrapped(x, x, x, key_padding_mask=torch.zeros(3, dtype=torch.bool)))
    if not torch.distributed.is_initialized():
        assert "init_process_group" in _refusal(lambda: wrapped(x, x, x))
    assert "generated torch module" in _refusal(lambda: context_parallel(torch.softmax))
    with pytest.raises(ValueError, match="causal must be True or False"):
        wrapped(x, x, x, causal=1)
