"""The MLP's fused kernels (``ops.linear.triton_relu2``): the up projection with the relu2 epilogue.

- compile (sm_90, the H200, offline with the triton wheel's ptxas and cuobjdump, no GPU): the kernels
  as the launchers call them, in every plan Nemotron-H's MLP shapes meet (TMA and pointer kernels,
  with and without the pre-activation). bf16 tiles of 64 rows and more run on HGMMA (wgmma), TMA
  where descriptors are used, and nothing spills.
- gpu (skipped without CUDA; run on the H200): every row of the fused MLP has the bits of linear,
  relu2, linear.
"""

from __future__ import annotations

import pytest
import torch
from sm90_offline import run_sm90_script, sass_script

BF16 = torch.bfloat16

_ALIGNED = {"K", "N", "stride_xm", "stride_wn"}
_COMPILE = sass_script(_ALIGNED, r"""
from aligned_mamba.ops.linear import triton_relu2 as rt

# intermediate sizes: a small model's, a TP shard's, Nemotron-H-8B's
plans = gemm_plans((512, 7168, 21504), (1, cfg.linear_decode_max_m, 64, cfg.linear_block_m, cfg.linear_mid_max_m,
                                        16384))
for dt, p in plans:
    tag = f"up:{dt}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}"
    opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    c = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
             HAS_BIAS=False)
    for keep in (False, True):
        if p.tma:
            comp(tag + f":tma:keep{int(keep)}", rt._up_tma_kernel,
                 dict(tma_descs(dt, p, y="h_desc"), u_ptr="*" + dt, b_ptr="*" + dt),
                 dict(c, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent, KEEP_PRE=keep), **opts)
        comp(tag + f":ptr:keep{int(keep)}", rt._up_ptr_kernel,
             dict(x_ptr="*" + dt, w_ptr="*" + dt, h_ptr="*" + dt, u_ptr="*" + dt, b_ptr="*" + dt),
             dict(c, KEEP_PRE=keep), **opts)
print(json.dumps(done))
""")


@pytest.mark.compile
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


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,inter,bias", [(4096, 21504, False), (256, 512, True)])
def test_fused_mlp_has_the_composed_ops_bits(hidden: int, inter: int, bias: bool) -> None:
    """The MLP with relu2 in the up GEMM's epilogue gives every row the bits of linear, relu2, linear
    (each row of a call of M rows, M across the decode, mid and large tiles); relu2 of the unrounded
    accumulator (one rounding fewer) differs, so the comparison can fail."""
    from aligned_mamba.ops.configs import TritonKernelConfigs
    from aligned_mamba.ops.elementwise.triton import relu2_triton
    from aligned_mamba.ops.linear.triton import linear_triton
    from aligned_mamba.ops.linear.triton_relu2 import linear_relu2_triton, mlp_relu2

    cfg = TritonKernelConfigs()
    g = torch.Generator(device="cuda").manual_seed(hidden)
    up = (torch.randn(inter, hidden, device="cuda", generator=g) / hidden ** 0.5).to(BF16)
    down = (torch.randn(hidden, inter, device="cuda", generator=g) / inter ** 0.5).to(BF16)
    ub, db = ((0.1 * torch.randn(n, device="cuda", generator=g)) if bias else None for n in (inter, hidden))
    x = torch.randn(4096, hidden, device="cuda", generator=g).to(BF16)
    for M in (1, 5, 16, 17, 64, 200, 256, 1000, 4096):
        u = linear_triton(x[:M], up, ub, cfg)
        h = relu2_triton(u, cfg)
        fh, fu = linear_relu2_triton(x[:M], up, ub, cfg, keep_pre=True)
        assert torch.equal(fu, u) and torch.equal(fh, h), M
        assert torch.equal(linear_relu2_triton(x[:M], up, ub, cfg)[0], h), M
        assert torch.equal(mlp_relu2(x[:M], up, ub, down, db, cfg=cfg), linear_triton(h, down, db, cfg)), M
    acc = x[:256].float() @ up.float().T + (0 if ub is None else ub)
    assert not torch.equal(torch.relu(acc).square().to(BF16), linear_relu2_triton(x[:256], up, ub, cfg)[0])
