"""The compile tests' helper (tests/sm90_offline.py): a compile stopped at a stage has that stage's text
and none after it, is cached apart from whole compiles (a partial entry never answers a whole
request; a whole one answers a partial request), and a kernel's constexpr defaults are bound as a
launch binds them."""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script

triton = pytest.importorskip("triton")
tl = triton.language
pytestmark = pytest.mark.compile


@triton.jit
def scale(x_ptr, n, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):  # compiled in the script below
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    if TWICE:
        v = v * 2.0
    tl.store(x_ptr + offs, v, mask=offs < n)


_SCRIPT = r"""
import json, os
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until, launch_constexprs
from test_sm90_offline import scale


def src(consts):
    sig = {"x_ptr": "*fp32", "n": "i32", **{k: "constexpr" for k in consts}}
    sig.setdefault("TWICE", "i32")  # what a script that leaves the default out compiles: a runtime argument
    return ASTSource(fn=scale, signature=sig, constexprs=consts)


sizes = lambda k: {s: len(k.asm.get(s, "")) for s in ("ttir", "ttgir", "llir", "ptx", "cubin")}
out = {"bound": launch_constexprs(scale, {"BLOCK": 64}),
       "given": launch_constexprs(scale, {"BLOCK": 64, "TWICE": True})}
out["runtime_branch"] = "scf.if" in compile_until(src({"BLOCK": 64}), {}, until="ttir").asm["ttir"]
out["bound_branch"] = "scf.if" in compile_until(src(out["bound"]), {}, until="ttir").asm["ttir"]
consts = {"BLOCK": 128, "TWICE": True}
out["ttir"] = sizes(compile_until(src(consts), {}, until="ttir"))
out["ptx"] = sizes(compile_until(src(consts), {}, until="ptx"))
out["whole_after_ptx"] = sizes(compile_until(src(consts), {}))
consts = {"BLOCK": 256, "TWICE": True}
compile_until(src(consts), {})
out["ptx_after_whole"] = sizes(compile_until(src(consts), {}, until="ptx"))
try:
    compile_until(src(consts), {}, until="sass")
except ValueError as e:
    out["refused"] = str(e)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_compile_stops_at_its_stage_and_never_answers_a_whole_one(tmp_path):
    r = run_sm90_script(_SCRIPT, tmp_path)  # a cache of its own: the test counts its entries' stages
    assert r["bound"] == {"BLOCK": 64, "TWICE": False} and r["given"] == {"BLOCK": 64, "TWICE": True}, r
    assert r["runtime_branch"] and not r["bound_branch"], r  # a default left out compiles both sides
    assert r["ttir"]["ttir"] > 0 and r["ttir"]["ttgir"] == r["ttir"]["ptx"] == r["ttir"]["cubin"] == 0, r
    assert r["ptx"]["ptx"] > 0 and r["ptx"]["cubin"] == 0, r
    assert r["whole_after_ptx"]["cubin"] > 0, r  # the PTX-only entry did not answer
    assert r["ptx_after_whole"]["cubin"] > 0, r  # the whole entry answered
    assert r["refused"].startswith("until='sass': must be one of"), r
