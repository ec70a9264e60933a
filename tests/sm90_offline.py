"""Compiling Triton kernels for sm_90 offline (no GPU), for the compile tests.

``run_sm90_script`` runs a test's compile script in a fresh interpreter with compiled (not
interpreted) Triton; the script imports ``compile_until`` and ``launch_constexprs`` from here
(tests/ is on its path). The tests give every script the session's one Triton cache (the
``sm90_cache`` fixture, tests/conftest.py), so a kernel that two tests compile alike (same source,
signature, constexprs and options: Triton's cache key) is compiled once per session.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


def run_sm90_script(code: str, cache_dir: Path, timeout: int = 900) -> Any:
    """Run ``code`` in a fresh interpreter with compiled (not interpreted) Triton and the Triton cache
    ``cache_dir``; returns the JSON on its last stdout line. Skips where the triton wheel has no ptxas."""
    import pytest

    triton = pytest.importorskip("triton")
    if not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")):
        pytest.skip("no ptxas in the triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(tests)
    env["PYTHONPATH"] = os.pathsep.join([root, tests, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def launch_constexprs(fn: Any, consts: dict[str, Any]) -> dict[str, Any]:
    """``consts`` and the defaults of ``fn``'s ``tl.constexpr`` parameters that it leaves out, as a
    launch binds them (a parameter left out of an ``ASTSource``'s constexprs would be compiled as a
    runtime argument: its ``if`` kept as a branch, both sides compiled)."""
    return {**consts, **{p.name: p.default for p in fn.params
                         if p.is_constexpr and p.has_default and p.name not in consts}}


def compile_until(src: Any, options: dict[str, Any], until: str = "cubin") -> Any:
    """``triton.compile(src, sm_90, options)`` run up to stage ``until`` (one of ``STAGES``): the later
    stages are left out and their ``asm`` entries empty, so a check that reads the TTIR or the PTX does
    not pay for the rest (ptxas is about half of a large kernel's compile). A partial compile is kept
    in its own subfolder of the Triton cache: it never answers a fuller one under the same key."""
    from triton.backends.compiler import GPUTarget

    if until not in STAGES:
        raise ValueError(f"until={until!r}: must be one of {STAGES}")
    left_out = STAGES[STAGES.index(until) + 1:]
    target = GPUTarget("cuda", 90, 32)
    with _compiling(src, options, until):
        return _compile(src, target, options, until, left_out)


@contextlib.contextmanager
def _compiling(src: Any, options: dict[str, Any], until: str) -> Iterator[None]:
    # one process at a time per kernel: two xdist workers that reach the same kernel at once compile it
    # once (the second finds the first's cache entry) instead of twice
    from triton import knobs

    key = hashlib.sha256(f"{src.hash()}-{sorted(options.items())}-{until}".encode()).hexdigest()
    locks = Path(knobs.cache.dir) / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / key, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _compile(src: Any, target: Any, options: dict[str, Any], until: str, left_out: tuple[str, ...]) -> Any:
    import triton
    from triton import knobs

    def leave_out(backend, stages, options, language, capability):
        for name in left_out:
            stages[name] = _left_out_stage(name, src.fn.__name__)

    if left_out:  # a whole compile of the same kernel, cached by another test, answers a partial one
        with knobs.runtime.scope():
            knobs.runtime.add_stages_inspection_hook = _not_cached  # called on a cache miss only
            try:
                return triton.compile(src, target=target, options=options)
            except _NotCached:
                pass
    with knobs.runtime.scope(), knobs.cache.scope():
        if left_out:
            knobs.runtime.add_stages_inspection_hook = leave_out
            knobs.cache.dir = os.path.join(knobs.cache.dir, "until-" + until)
        return triton.compile(src, target=target, options=options)


class _NotCached(Exception):
    pass


def _not_cached(*args: Any) -> None:
    raise _NotCached


def _left_out_stage(name: str, kernel: str):
    def stage(module: Any, metadata: dict[str, Any]) -> str | bytes:
        # what the left-out stages would have recorded, as unknown: CompiledKernel reads them
        metadata.setdefault("name", kernel)
        metadata.setdefault("shared", None)
        return b"" if name == "cubin" else ""
    return stage


_SASS_PRELUDE = r'''
import inspect, json, os, re, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligned_mamba.ops.configs import TritonKernelConfigs
from sm90_offline import launch_constexprs

cfg = TritonKernelConfigs()
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ALIGNED = %(aligned)r
done = []
read = {}  # per compiled kernel (Triton's hash): its SASS counts (a disassembly is 0.3 CPU s)


def comp(name, fn, types, consts, **opts):
    consts = launch_constexprs(fn, consts)
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in ALIGNED}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    if k.hash not in read:
        read[k.hash] = sass_counts(k.asm["cubin"])
    done.append(dict(name=name, shared=k.metadata.shared, **read[k.hash]))


def gemm_plans(Ns, Ms):
    """{(dtype name, plan): None}: every tile ``ops.linear.triton.plan`` gives weights of N rows at M rows
    (decode to prefill), bf16 and fp32 models, in order, each once."""
    from aligned_mamba.ops.linear import triton as lt

    plans = {}
    for N in Ns:
        for M in Ms:
            for dt in ("bf16", "fp32"):
                w = torch.empty(N, 8, dtype=torch.bfloat16 if dt == "bf16" else torch.float32)
                plans[(dt, lt.plan(M, w, cfg, sms=132))] = None
    return plans


def tma_descs(dt, p, out=None, y="y_desc"):
    """The TMA descriptor types of a GEMM tile ``p``: x [BM, BK] and w [BN, BK] in ``dt``, the output
    (argument ``y``) [BM, BN / epi_split] in ``out`` (default ``dt``)."""
    return {"x_desc": f"tensordesc<{dt}[{p.block_m}, {p.block_k}]>",
            "w_desc": f"tensordesc<{dt}[{p.block_n}, {p.block_k}]>",
            y: f"tensordesc<{out or dt}[{p.block_m}, {p.block_n // p.epi_split}]>"}


def sass_counts(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", res).groups())
    ops = {o: len(re.findall(r"\b" + o + r"\b", sass)) for o in ("HGMMA", "HMMA", "UTMALDG", "LDL", "STL")}
    # global loads by width: 16-byte vectors, and single bf16 / fp16 elements
    ops.update(LDG128=len(re.findall(r"\bLDG\.E\.128\b", sass)), LDG16=len(re.findall(r"\bLDG\.E\.U16\b", sass)))
    ops.update(EX2=len(re.findall(r"\bMUFU\.EX2\b", sass)))  # the hardware exp
    return dict(regs=regs, stack=stack, **ops)
'''


def sass_script(aligned: set[str], body: str) -> str:
    """A script for ``run_sm90_script``: ``body`` runs after a prelude that imports torch and triton
    (compiled, not interpreted), sets ``cfg`` (the pinned ``TritonKernelConfigs``) and defines
    ``comp(name, kernel, types, constexprs, **options)``, which compiles one kernel for sm_90 and
    appends its registers, stack, shared memory and SASS counts (HGMMA, HMMA, UTMALDG, LDL, STL, LDG128, LDG16, EX2) to
    ``done``; ``gemm_plans(Ns, Ms)`` (the GEMM plans of those widths and row counts) and
    ``tma_descs(dt, plan)`` (a GEMM tile's descriptor types). Integer arguments named in ``aligned``
    are declared divisible by 16, as pointers are."""
    return _SASS_PRELUDE % {"aligned": sorted(aligned)} + body
