"""The implementations the benchmark runner times: each makes a runner for a case, or None where unavailable.

A runner's ``step`` does one forward + backward; ``result`` returns the output and
every gradient as float64 arrays (for the error check); ``peak_memory`` returns the
peak extra bytes of one step (see run.py for the method).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
import tempfile
import tracemalloc
from collections.abc import Callable

import numpy as np

try:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
except ImportError:  # the NumPy backend is still benchmarked
    torch = None
    F = None


def make_data(case) -> dict[str, np.ndarray]:
    """Inputs and output cotangent G for a case, drawn once (standard normal, weights scaled by 1/√d_model)."""
    rng = np.random.default_rng(20261122)
    lead = (case.batch,) if case.heads else ()
    data = {name: rng.standard_normal((*lead, case.n, case.d)) for name in ("Q", "K", "V", "G")}
    if case.heads:
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            data[name] = rng.standard_normal((case.d, case.d)) / math.sqrt(case.d)
    return {k: v.astype(case.dtype) for k, v in data.items()}


def inputs_of(case) -> list[str]:
    return ["Q", "K", "V", "W_Q", "W_K", "W_V", "W_O"] if case.heads else ["Q", "K", "V"]


def generated(case, backend: str, variant: str = ""):
    """The generated module for the case's spec, or None where it does not exist (yet)."""
    try:
        return importlib.import_module(f"symattn.generated.{case.spec}_{backend}{variant}")
    except ImportError:
        return None


class NumPyRunner:
    def __init__(self, module, case, data) -> None:
        self.module, self.case = module, case
        self.args = [data[k] for k in inputs_of(case)]
        self.options = {"num_heads": case.heads} if case.heads else {}
        self.g = data["G"]

    def _run(self):
        out, saved = self.module.forward(*self.args, **self.options)
        return out, self.module.backward(saved, self.g)

    def step(self) -> None:
        self._run()

    def result(self) -> dict[str, np.ndarray]:
        out, grads = self._run()
        return {"out": np.asarray(out, dtype=np.float64), **{k: np.asarray(v, np.float64) for k, v in grads.items()}}

    def peak_memory(self) -> int:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            self._run()
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()


class TorchRunner:
    """forward(*leaves) → output; backward with G; gradients on the leaves."""

    def __init__(self, forward: Callable, leaves: dict, g) -> None:
        self.forward, self.leaves, self.g = forward, leaves, g

    params: tuple = ()  # module weights whose gradients are reset too

    def clear(self) -> None:
        for t in (*self.leaves.values(), *self.params):
            t.grad = None

    def _run(self):
        self.clear()
        out = self.forward(*self.leaves.values())
        out.backward(self.g)
        return out

    def step(self) -> None:
        self._run()

    def result(self) -> dict[str, np.ndarray]:
        out = self._run()
        grads = {k: t.grad.double().numpy() for k, t in self.leaves.items() if t.grad is not None}
        return {"out": out.detach().double().numpy(), **grads}

    def peak_memory(self) -> int | None:
        from torch.profiler import ProfilerActivity, profile

        self.clear()  # freeing the last step's gradients inside the profile would count as negative
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            self._run()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        live = peak = 0
        for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
            live += e["args"]["Bytes"]
            peak = max(peak, live)
        return peak


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 pointed at /dev/null: the profiler's C++ side logs "USDT … profiler_start/stop" there."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _leaves(case, data, names) -> dict:
    return {k: torch.from_numpy(data[k].copy()).requires_grad_(True) for k in names}


def torch_runner(case, data, forward: Callable) -> TorchRunner | None:
    if torch is None:
        return None
    return TorchRunner(forward, _leaves(case, data, inputs_of(case)), torch.from_numpy(data["G"]))


# Plain torch forwards, differentiated by autograd.


def attention_forward(q, k, v):
    return torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1) @ v


def mha_forward(heads: int, attend: Callable):
    def forward(q, k, v, w_q, w_k, w_v, w_o):
        d_model = q.shape[-1]

        def split(x):
            return x.view(*x.shape[:-1], heads, d_model // heads).transpose(-2, -3)

        o = attend(split(q @ w_q), split(k @ w_k), split(v @ w_v)).transpose(-2, -3)
        return o.reshape(*o.shape[:-2], d_model) @ w_o

    return forward


class HandWrittenNumPy:
    """A hand-written NumPy closed form of single-head attention (the yardstick the issue quotes)."""

    def __init__(self, data) -> None:
        self.q, self.k, self.v, self.g = data["Q"], data["K"], data["V"], data["G"]

    def forward(self, q, k, v):
        scale = q.dtype.type(1 / math.sqrt(q.shape[-1]))
        p = (q * scale) @ k.T
        p -= p.max(axis=-1, keepdims=True)
        np.exp(p, out=p)
        p /= p.sum(axis=-1, keepdims=True)
        return p @ v, (p, scale)

    def _run(self):
        out, (p, scale) = self.forward(self.q, self.k, self.v)
        dv = p.T @ self.g
        d = np.sum(self.g * out, axis=-1, keepdims=True)
        ds = self.g @ self.v.T
        ds -= d
        ds *= p
        return out, {"Q": (ds @ self.k) * scale, "K": (ds.T @ self.q) * scale, "V": dv}

    def step(self) -> None:
        self._run()

    def result(self) -> dict[str, np.ndarray]:
        out, grads = self._run()
        return {"out": out.astype(np.float64), **{k: v.astype(np.float64) for k, v in grads.items()}}

    peak_memory = NumPyRunner.peak_memory


def make_numpy_handwritten(case, data):
    return None if case.heads else HandWrittenNumPy(data)


def make_numpy(case, data):
    module = generated(case, "numpy")
    return NumPyRunner(module, case, data) if module is not None else None


def make_numpy_memeff(case, data):
    module = generated(case, "numpy", "_memeff")
    return NumPyRunner(module, case, data) if module is not None else None


def _torch_generated(case, data, variant: str):
    module = generated(case, "torch", variant)
    if module is None or torch is None:
        return None
    options = {"num_heads": case.heads} if case.heads else {}
    return torch_runner(case, data, lambda *xs: module.forward(*xs, **options))


def make_torch(case, data):
    return _torch_generated(case, data, "")


def make_torch_memeff(case, data):
    return _torch_generated(case, data, "_memeff")


def make_autograd(case, data):
    if torch is None:
        return None
    forward = mha_forward(case.heads, attention_forward) if case.heads else attention_forward
    return torch_runner(case, data, forward)


def make_sdpa(case, data):
    if torch is None:
        return None
    sdpa = F.scaled_dot_product_attention
    return torch_runner(case, data, mha_forward(case.heads, sdpa) if case.heads else sdpa)


def make_mha_module(case, data):
    """torch.nn.MultiheadAttention (no biases, batch first) on Q, K, V; gradients for inputs and its weights."""
    if torch is None or not case.heads:
        return None
    dtype = getattr(torch, case.dtype)
    module = torch.nn.MultiheadAttention(case.d, case.heads, bias=False, batch_first=True, dtype=dtype)
    leaves = _leaves(case, data, ["Q", "K", "V"])
    runner = TorchRunner(lambda q, k, v: module(q, k, v, need_weights=False)[0], leaves, torch.from_numpy(data["G"]))
    runner.params = tuple(module.parameters())
    runner.comparable = False  # its own weights: not the same function as the others
    return runner


IMPLEMENTATIONS: dict[str, Callable] = {
    "numpy_handwritten": make_numpy_handwritten,
    "numpy_generated": make_numpy,
    "numpy_generated_memeff": make_numpy_memeff,
    "torch_generated": make_torch,
    "torch_generated_memeff": make_torch_memeff,
    "torch_autograd": make_autograd,
    "torch_sdpa": make_sdpa,
    "torch_mha_module": make_mha_module,
}


def reference_result(case, data) -> dict[str, np.ndarray] | None:
    """Output and gradients from torch autograd of the plain forward (same dtype)."""
    runner = make_autograd(case, data)
    return runner.result() if runner is not None else None


def max_relative_error(result: dict, reference: dict) -> float | None:
    """max over the arrays both have of max|x − ref| / max|ref| (None when nothing is comparable)."""
    errors = [
        float(np.max(np.abs(result[k] - reference[k])) / max(np.max(np.abs(reference[k])), 1e-30))
        for k in reference
        if k in result and np.shape(result[k]) == np.shape(reference[k])
    ]
    return max(errors) if errors else None
