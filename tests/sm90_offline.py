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
