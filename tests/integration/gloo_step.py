"""One training step of the generated mha modules on two local gloo processes, as a script the DDP and FSDP2
tests run in a subprocess: the same models, data, loss, exit and single-process reference; each test gives its
own imports and ``step(rank, kind, init, out)``.

Each rank leaves with ``os._exit`` once its process group is destroyed: in torch 2.13 a gloo collective launched
during backward holds a Python object (the contextvars copy that ``backward()`` stashes in thread-local state),
so the gloo worker thread needs the GIL to free it; a ProcessGroupGloo destructor that runs on the main thread
(holding the GIL) joins that thread and can deadlock. The process groups and models stay referenced
(``KEEP_ALIVE``) until then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEAD = textwrap.dedent(
    """
    import datetime
    import os
    import sys
    import traceback

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from symattn.generated import mha_torch

    E, H, L, N, WORLD = 16, 4, 6, 4, 2
    # the process groups and models stay referenced until os._exit (gloo_step.py's docstring)
    KEEP_ALIVE: list = []


    def model(kind: str) -> torch.nn.Module:
        torch.manual_seed(0)
        if kind == "own":
            return mha_torch.MultiHeadAttention(E, num_heads=H, bias=True, dtype=torch.float64)
        return mha_torch.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)


    def data() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        return torch.randn(N, L, E, dtype=torch.float64), torch.randn(N, L, E, dtype=torch.float64)


    def loss(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = module(x, x, x)
        out = out[0] if isinstance(out, tuple) else out
        return ((out - target) ** 2).mean()
    """
)

TAIL = textwrap.dedent(
    """
    def worker(rank: int, kind: str, init: str, out: str) -> None:
        code = 1
        try:
            step(rank, kind, init, out)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no ProcessGroupGloo destructor runs; mp.spawn's join reads the exit code


    if __name__ == "__main__":
        kind, init, out = sys.argv[1:]
        mp.spawn(worker, args=(kind, init, out), nprocs=WORLD, join=True)
        single = model(kind)
        x, target = data()
        loss(single, x, target).backward()
        torch.save({name: p.grad for name, p in single.named_parameters()}, f"{out}.single")
    """
)


def run_step(tmp_path: Path, name: str, step: str, kind: str, timeout: float) -> Path:
    """Write HEAD + step + TAIL to tmp_path and run it for kind ("own" or "dropin") in a session of its own (its own
    ``file://`` rendezvous; on timeout the whole session is killed: the script, both ranks and multiprocessing's
    resource tracker). Returns the path prefix of the saved gradients: ``<out>.single`` and ``<out>.<rank>``."""
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    script = tmp_path / f"{name}.py"
    script.write_text(HEAD + textwrap.dedent(step) + TAIL, encoding="utf-8")
    out = tmp_path / "grads"
    args = [sys.executable, str(script), kind, f"file://{tmp_path / 'rendezvous'}", str(out)]
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"the {name} script did not finish in {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    assert process.returncode == 0, stderr[-3000:]
    return out
