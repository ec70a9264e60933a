"""The MLP's fused kernels (``ops.linear.triton_relu2``) compile for sm_90 (the H200) as the launchers
call them, offline (the triton wheel's ptxas and cuobjdump, no GPU): the up projection with the relu2
epilogue in every plan Nemotron-H's MLP shapes meet (TMA and pointer kernels, with and without the
pre-activation). bf16 tiles of 64 rows and more run on HGMMA (wgmma), TMA where descriptors are used,
and nothing spills."""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script, sass_script

pytestmark = pytest.mark.compile

_ALIGNED = {"K", "N", "stride_xm", "stride_wn"}
_COMPILE = sass_script(_ALIGNED, r"""
from aligned_mamba.ops.linear import triton as lt
from aligned_mamba.ops.linear import triton_relu2 as rt

plans = {}
for N in (512, 7168, 21504):  # intermediate sizes: a small model's, a TP shard's, Nemotron-H-8B's
    for M in (1, cfg.linear_decode_max_m, 64, cfg.linear_block_m, cfg.linear_mid_max_m, 16384):
        for dt in ("bf16", "fp32"):
            p = lt.plan(M, torch.empty(N, 8, dtype=torch.bfloat16 if dt == "bf16" else torch.float32), cfg, sms=132)
            plans[(dt, p)] = None
for dt, p in plans:
    tag = f"up:{dt}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}"
    opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    c = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
             HAS_BIAS=False)
    for keep in (False, True):
        if p.tma:
            comp(tag + f":tma:keep{int(keep)}", rt._up_tma_kernel,
                 dict(x_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_k}]>",
                      w_desc=f"tensordesc<{dt}[{p.block_n}, {p.block_k}]>",
                      h_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_n // p.epi_split}]>", u_ptr="*" + dt,
                      b_ptr="*" + dt),
                 dict(c, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent, KEEP_PRE=keep), **opts)
        comp(tag + f":ptr:keep{int(keep)}", rt._up_ptr_kernel,
             dict(x_ptr="*" + dt, w_ptr="*" + dt, h_ptr="*" + dt, u_ptr="*" + dt, b_ptr="*" + dt),
             dict(c, KEEP_PRE=keep), **opts)
print(json.dumps(done))
""")


@pytest.mark.slow
def test_the_fused_mlp_kernels_compile_for_sm90_with_the_instructions_they_were_tiled_for(tmp_path):
    done = run_sm90_script(_COMPILE, tmp_path)
    assert len(done) >= 10, [d["name"] for d in done]
    for d in done:
        bf16 = d["name"].split(":")[1] == "bf16"
        bm = int(d["name"].split(":")[2].split("x")[0])
        if bf16:  # (an fp32 model's tile keeps a few bytes on the stack in the epilogue: no model shape's hot path)
            assert d["LDL"] == d["STL"] == 0, d  # no spills
            assert d["HGMMA" if bm >= 64 else "HMMA"] > 0, d
        if ":tma:" in d["name"]:
            assert d["UTMALDG"] > 0, d
