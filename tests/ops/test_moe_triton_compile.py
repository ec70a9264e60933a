"""The MoE expert kernels compile for sm_90 (the H200) in every variant the launchers use, with the
backend's pinned configs and no GPU (the triton wheel's ptxas): the grouped GEMM with the fused
squared ReLU (up), plain (down, and both data gradients over transposed weights), and the expert
weight gradient with and without a gathered operand, the weighted combine. bf16 dots run on tensor cores, warpgroup MMA
for the grouped GEMM's tile of 64 rows; nothing is contracted into an FMA."""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script

pytestmark = pytest.mark.compile

_COMPILE = r"""
import inspect, json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.moe import triton as mt

cfg = TritonKernelConfigs()
i64 = "*i64"
done = {}


def comp(fn, types, consts, warps, stages, div16=()):
    # as a launch specializes them: pointers and ints that are multiples of 16 (Nemotron-3-Nano's
    # sizes and strides are) get divisibility 16, an int equal to 1 is a constant
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False))
    ptx = k.asm["ptx"]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, mma="mma.sync" in ptx,
                shared=k.metadata.shared, cp_async=ptx.count("cp.async"))


for dt in ("bf16", "fp32"):
    # up (gathered rows, the squared ReLU), down, and the data gradients (weights read transposed)
    for name, gather, relu2, unit in (("up", True, True, "stride_bk"), ("down", False, False, "stride_bk"),
                                      ("data-grad", False, False, "stride_bn")):
        t = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "c_ptr", "u_ptr")}
        t.update(arow_ptr=i64, tile_expert_ptr=i64, tile_row0_ptr=i64, tile_row1_ptr=i64)
        c = dict(GATHER=gather, RELU2=relu2, BLOCK_M=cfg.moe_block_m, BLOCK_N=cfg.moe_block_n,
                 BLOCK_K=cfg.moe_block_k, PRECISION="ieee", **{unit: 1})
        div = {"N", "K", "stride_am", "stride_be", "stride_bn", "stride_bk", "stride_cm"} - {unit}
        done[f"{dt} grouped {name}"] = comp(mt._grouped_gemm_kernel, t, c, cfg.moe_warps, cfg.moe_stages, div)
    for gather in (True, False):
        t = {n: f"*{dt}" for n in ("g_ptr", "x_ptr", "dw_ptr")}
        t.update(xrow_ptr=i64, offsets_ptr=i64)
        c = dict(GATHER=gather, BLOCK_N=cfg.moe_wgrad_block_n, BLOCK_K=cfg.moe_wgrad_block_k,
                 BLOCK_T=cfg.moe_wgrad_block_t, PRECISION="ieee")
        done[f"{dt} wgrad gather={gather}"] = comp(mt._expert_wgrad_kernel, t, c, cfg.moe_wgrad_warps, 3,
                                                   ("N", "K", "stride_g", "stride_x", "stride_dwe"))
    t = dict(y_ptr=f"*{dt}", pos_ptr=i64, w_ptr="*fp32", out_ptr=f"*{dt}")
    for k in (2, 6):
        done[f"{dt} combine k={k}"] = comp(mt._combine_kernel, t, dict(K=k, BLOCK_D=cfg.moe_combine_block_d), 4, 1)
print(json.dumps(done))
"""


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90(tmp_path):
    done = run_sm90_script(_COMPILE, tmp_path)
    assert len(done) == 2 * 7, sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") or "combine" in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # the combine's products and sums each rounded
            assert "combine" in name or r["wgmma"] or r["mma"], (name, r)  # tensor cores
        if name.startswith("bf16 grouped"):
            assert r["wgmma"], (name, r)  # the 64-row tile runs on Hopper's warpgroup MMA
        if name in ("bf16 grouped up", "bf16 grouped down"):
            assert r["cp_async"], (name, r)  # the K loop's loads are pipelined (moe_stages)
        assert r["shared"] <= 227 * 1024, (name, r)  # fits an H200 SM's shared memory
