"""The wheel works on its own: built from this tree, installed into an empty directory, used from
outside the repository (no configs/ beside it), it finds its contracts and runs the main job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheel")
    target = tmp_path_factory.mktemp("target")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)], check=True,
                   capture_output=True, timeout=600)
    (wheel,) = wheels.glob("aligned_mamba-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"aligned_mamba/contracts/default.yaml", "aligned_mamba/contracts/chunk128.yaml"} <= set(names)
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=600)
    return target


def _run(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(target)  # ahead of the editable install of this checkout
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_installed_wheel_finds_its_contracts(installed: Path, tmp_path: Path) -> None:
    code = ("import aligned_mamba, json; from aligned_mamba import Contract; "
            "print(json.dumps([aligned_mamba.__file__, Contract.from_yaml('default').to_dict(), "
            "Contract.from_yaml('chunk128').chunk_size]))")
    out = _run(installed, tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr
    where, default, chunk = json.loads(out.stdout)
    assert where.startswith(str(installed)), where  # the wheel's copy, not this checkout
    assert default["chunk_size"] == 256 and chunk == 128


def test_the_installed_wheel_runs_the_main_job(installed: Path, tmp_path: Path) -> None:
    """The main job from the wheel, on the embedded default at a smaller size than the README's (its
    default run is tests/core/test_cli.py's): still past a chunk boundary, so the baseline differs."""
    out = _run(installed, tmp_path, "-m", "aligned_mamba.cli", "check", "--jobs", "1", "--prompt-len", "200",
               "--gen-len", "100", "--requests", "2", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["ok"] and all(c["mismatched_rows"] == 0 for c in r["cases"] if c["exact_replay"])
    assert r["control"]["could_fail"] and r["control"]["baseline_mismatched_rows"] > 0, r["control"]
    assert "OK: every exact-replay case is bit-identical" in out.stdout



def test_every_package_of_the_tree_is_listed() -> None:
    """pyproject.toml lists the packages explicitly (the contracts' folder is mapped in); a package folder
    the list misses would be absent from the wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for top in ("aligned_mamba", "trainer_hooks", "rollout")
            for p in (ROOT / top).rglob("__init__.py")}
    assert not tree - listed, f"add to pyproject.toml [tool.setuptools] packages: {sorted(tree - listed)}"
