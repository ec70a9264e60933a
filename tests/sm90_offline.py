"""Running a script that compiles Triton kernels for sm_90 offline (no GPU), for the compile tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def run_sm90_script(code: str, cache_dir: Path, timeout: int = 900) -> Any:
    """Run ``code`` in a fresh interpreter with compiled (not interpreted) Triton and its own cache;
    returns the JSON on its last stdout line. Skips where the triton wheel has no ptxas."""
    triton = pytest.importorskip("triton")
    if not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")):
        pytest.skip("no ptxas in the triton wheel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_SASS_PRELUDE = r'''
import inspect, json, os, re, subprocess, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligned_mamba.ops.configs import TritonKernelConfigs

cfg = TritonKernelConfigs()
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ALIGNED = %(aligned)r
done = []


def comp(name, fn, types, consts, **opts):
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in ALIGNED}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", res).groups())
    ops = {o: len(re.findall(r"\b" + o + r"\b", sass)) for o in ("HGMMA", "HMMA", "UTMALDG", "LDL", "STL")}
    done.append(dict(name=name, regs=regs, stack=stack, shared=k.metadata.shared, **ops))
'''


def sass_script(aligned: set[str], body: str) -> str:
    """A script for ``run_sm90_script``: ``body`` runs after a prelude that imports torch and triton
    (compiled, not interpreted), sets ``cfg`` (the pinned ``TritonKernelConfigs``) and defines
    ``comp(name, kernel, types, constexprs, **options)``, which compiles one kernel for sm_90 and
    appends its registers, stack, shared memory and SASS counts (HGMMA, HMMA, UTMALDG, LDL, STL) to
    ``done``. Integer arguments named in ``aligned`` are declared divisible by 16, as pointers are."""
    return _SASS_PRELUDE % {"aligned": sorted(aligned)} + body
