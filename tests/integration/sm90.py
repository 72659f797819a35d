"""The generated Triton modules' kernels compiled for an H100 (sm_90) in a process without the interpreter: no GPU
needed. In full: TTIR, TTGIR, LLVM IR, PTX and the cubin by the wheel's ptxas. Cut: TTIR, TTGIR and the LLVM IR
stage's passes up to shared memory's allocation (which sets ``metadata.shared``), no lowering to LLVM, its O3 or PTX
(most of a compile's time); a kernel compiled in full and cut elsewhere has its own TTGIR cut too, the test's check
that the cut counts as the full compile does.

Each kernel is compiled at the launch the module's own ``_launch`` gives it on an sm_90 GPU for a dtype (16-bit or
float32 pointers) and a head dimension d (d_v = d): its BLOCK_M × BLOCK_N, num_warps and num_stages, BLOCK_D =
BLOCK_DV = d padded to a power of two; the delta kernel takes the backward's query part's BLOCK_M and Triton's default
warps and stages, as the module launches it. A backward kernel's name may end in "@keys", "@queries" or "@atomic":
its key part alone at the key part's launch, its query part alone at the query part's, the key part adding dQ by
atomic adds into float32 (deterministic=False); without: the module's first backward launch, both parts where their
two settings coincide (one launch), else the key part. Every optional tile present (HAS_*, TANGENT_*, GRAD_* on),
causal, PRECISION "ieee" for float32 (the default float32 matmul precision), a learned table's histogram 32 slots.
The compiled kernel's ``metadata.shared`` is the dynamic shared memory a GPU launch asks for (bytes). Settings that
coincide are compiled once. torch and triton are imported once for every module (one subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

H100_SHARED = 232448  # an H100's most dynamic shared memory per block (227 KiB, sm_90's opt-in limit), in bytes
HEAD_DIMS = (64, 128, 256)
DTYPES = ("fp16", "fp32")

COMPILE = """
import importlib.util, inspect, json, re, sys
from pathlib import Path
from types import SimpleNamespace
import triton
import triton.backends.nvidia.compiler as nvidia
from triton import knobs
from triton._C.libtriton import ir, nvidia as nv, passes
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

LAUNCHED = {"forward": "forward", "delta": "backward_queries", "backward": "backward_keys", "jvp": "jvp"}  # _launch's
PARTS = {  # a backward kernel's launch by its name's ending: _launch's kernel, KEYS, QUERIES, ATOMIC
    "": ("backward_keys", True, None, False),  # QUERIES: where the two parts' launches coincide (_backward_parts)
    "keys": ("backward_keys", True, False, False),
    "queries": ("backward_queries", False, True, False),
    "atomic": ("backward_keys", True, False, True),
}


class Lowered(Exception):  # raised by the cut LLVM IR stage: the metadata with its shared memory
    pass


def allocated(*arguments):
    # a stages hook: the LLVM IR's stage cut to its passes up to shared memory's allocation (which sets
    # metadata.shared), then Lowered raised: the lowering to LLVM and its O3 (most of a kernel's compile) left out
    if not arguments:
        return "allocated", "allocated"  # (the cache's key)
    backend, stages, options, language, capability = arguments

    def allocate(src, metadata):
        pm = ir.pass_manager(src.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        version = nvidia.get_ptx_version_from_options(options, backend.target.arch)
        nv.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, version)
        pm.run(src, "allocate")
        raise Lowered({**metadata, "shared": src.get_int_attr("ttg.shared")})

    stages["llir"] = allocate


def compiled(fn, dtype, constexprs, options, full):
    # the kernel's metadata and, in full, its TTIR and PTX (asserted with a cubin); cut at the allocation otherwise
    knobs.runtime.add_stages_inspection_hook = None if full else allocated
    source = ASTSource(fn, *signature_of(fn, dtype, constexprs))
    try:
        kernel = triton.compile(source, GPUTarget("cuda", 90, 32), options)
    except Lowered as lowered:
        return lowered.args[0], None, None
    assert kernel.asm["ptx"] and kernel.asm["cubin"], fn.__name__
    metadata = {**kernel.metadata._asdict(), "metadata_group": kernel.metadata_group}  # (the IR files made)
    return metadata, kernel.asm["ttir"], kernel.asm["ptx"]


def signature_of(fn, dtype, constexprs):
    names = list(inspect.signature(fn.fn).parameters)
    signature, constants = {}, {}
    for i, p in enumerate(names):
        if p in constexprs:
            signature[p], constants[(i,)] = "constexpr", constexprs[p]
        elif p in ("CAUSAL", "RESIDUAL") or p.startswith(("HAS_", "TANGENT_", "GRAD_")):
            signature[p], constants[(i,)] = "constexpr", True
        elif p == "PRECISION":  # float32: the default float32 matmul precision's (no TF32)
            signature[p], constants[(i,)] = "constexpr", "tf32" if dtype == "fp16" else "ieee"
        elif p == "WIDE":
            signature[p], constants[(i,)] = "constexpr", False
        elif p.startswith("TABLE_"):  # a learned table's histogram slots
            signature[p], constants[(i,)] = "constexpr", 32
        elif p == "MAP":  # a per-call block map of a mask on data (int8: empty, partial, full)
            signature[p] = "*i8"
        elif p.startswith(("TAB_", "P_")):  # a table read at positions, its tangent, its partial histograms
            signature[p] = "*fp32"
        elif p == "R" and "RESIDUAL" in names:  # O's rounding, in O's dtype
            signature[p] = f"*{dtype}"
        elif p in ("L", "D", "C", "R") or p[:2] in ("T_", "G_", "R_", "TT"):  # C: the scalar arguments, float32
            signature[p] = "*fp32"
        elif p == "DQ" and constexprs.get("ATOMIC"):  # the key part's atomic adds: float32
            signature[p] = "*fp32"
        elif p in ("Q", "K", "V", "O", "DO", "DL", "DK", "DV", "DQ", "Q_DOT", "K_DOT", "V_DOT", "O_DOT"):
            signature[p] = f"*{dtype}"
        else:
            signature[p] = "i32"
    return signature, constants


def launch(module, name, names, dtype, head):
    # the constexprs and options of the kernel's launch on an sm_90 GPU (a stand-in tensor: is_cuda, element size)
    x = SimpleNamespace(is_cuda=True, element_size=lambda: 2 if dtype == "fp16" else 4)
    width = head * (2 if "BLOCK_DV" in names else 1)  # _launch's row: d + d_v, or d for a map (no V)
    name, _, part = name.partition("@")
    kind = re.sub(r"^_|_kernel\\d*$", "", name)
    launched, keys, queries, atomic = PARTS[part] if kind == "backward" else (LAUNCHED[kind], None, None, None)
    got = module._launch(x, width, launched)
    if kind == "backward" and queries is None:  # the module's first backward launch: both parts where they coincide
        queries = got == module._launch(x, width, "backward_queries")
    padded = module._width(head)
    constexprs = {"BLOCK_M": got["BLOCK_M"], "BLOCK_N": got["BLOCK_N"], "BLOCK_D": padded, "BLOCK_DV": padded}
    constexprs |= {"KEYS": keys, "QUERIES": queries, "ATOMIC": atomic}
    options = {k: got[k] for k in ("num_warps", "num_stages")} if kind != "delta" else {}  # delta: triton's defaults
    return {k: v for k, v in constexprs.items() if k in names}, options


modules, done, jobs = {}, {}, json.loads(sys.argv[1])
swept = {(path, name) for path, name, *_, full in jobs if not full}  # the kernels also cut at other settings
for path, name, dtype, head, full in jobs:
    if path not in modules:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        modules[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[path])
    fn = getattr(modules[path], name.partition("@")[0])
    names = list(inspect.signature(fn.fn).parameters)
    constexprs, options = launch(modules[path], name, names, dtype, head)
    key = (path, name, dtype, full, json.dumps(constexprs, sort_keys=True), json.dumps(options, sort_keys=True))
    if key not in done:
        metadata, ttir, ptx = compiled(fn, dtype, constexprs, options, full)
        # a kernel cut at other settings: its full compile's TTGIR cut at the allocation too (the same count: the check)
        cut = None
        if full and (path, name) in swept:
            ttgir = next(p for k, p in metadata["metadata_group"].items() if k.endswith(".ttgir"))
            knobs.runtime.add_stages_inspection_hook = allocated
            try:
                triton.compile(ttgir, GPUTarget("cuda", 90, 32), options)
            except Lowered as lowered:
                cut = lowered.args[0]["shared"]
        # the batch·head index widened to int64 before it multiplies a stride (offsets past 2**31 elements)
        wide = ttir and re.search(r"(%\\w+) = tt.get_program_id y : i32.*arith.extsi \\1 : i32 to i64", ttir, re.S)
        done[key] = {
            "BLOCK_M": constexprs.get("BLOCK_M"),
            "BLOCK_N": constexprs.get("BLOCK_N"),
            "num_warps": metadata["num_warps"],
            "num_stages": metadata["num_stages"],
            "shared": metadata["shared"],
            "index": None if ttir is None else "int64" if wide else "int32",
            # float32 products in IEEE precision (PRECISION "ieee": no TF32 tensor-core instruction in the PTX)
            "tf32": None if ptx is None else "tf32" in ptx,
            "cut": cut,
        }
    row = {"module": Path(path).stem, "kernel": name, "dtype": dtype, "head": head, **done[key]}
    print(json.dumps(row), flush=True)
"""


def compile_kernels(jobs: list[tuple[Path, str, str, int, bool]], folder: Path) -> list[dict]:
    """Each job (a module's path, a kernel's name, "fp16" or "fp32", the head dimension, whether in full: PTX and
    cubin too) compiled for sm_90 at its launch there, in one subprocess: per job its module's stem, kernel, dtype,
    head, BLOCK_M, BLOCK_N, num_warps, num_stages, shared (bytes), index ("int64" where the batch·head index is
    widened) and tf32 (whether the PTX has a TF32 instruction; None unless in full), cut (a kernel in full that other
    jobs cut at the allocation: the shared memory counted so; None otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(folder)}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (triton 3.9 warns where it is unset; its default)
    listed = json.dumps([[str(path), *rest] for path, *rest in jobs])
    done = subprocess.run([sys.executable, "-c", COMPILE, listed], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]
