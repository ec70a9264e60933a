"""The MoE expert kernels compile for sm_90 (the H200) in every variant the launchers use, with the
backend's pinned configs, no GPU, to PTX (ptxas is left to the GPU tests): the grouped GEMM with the
fused squared ReLU (up), plain (down, and both data gradients over transposed weights, the first with
the squared ReLU's derivative), and the expert weight gradient with and without a gathered operand,
the weighted combine and the plain sum, the combine's backward, the few-row path (the decode tile,
the fp32 router GEMM on its small and large tiles, the routing kernel with and without its dispatch
tables, and the tables alone). bf16 dots run on tensor cores, warpgroup MMA for the grouped GEMM's
large tile; nothing is contracted into an FMA."""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script

pytestmark = pytest.mark.compile

_COMPILE = r"""
import inspect, json, os
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.moe import triton as mt

cfg = TritonKernelConfigs()
i64 = "*i64"
done = {}


def comp(fn, types, consts, warps, stages, div16=(), fusion=False):
    # as a launch specializes them: pointers and ints that are multiples of 16 (Nemotron-3-Nano's
    # sizes and strides are) get divisibility 16, an int equal to 1 is a constant
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    # the checks read the PTX and the shared memory (known before the PTX): no ptxas
    k = compile_until(src, dict(num_warps=warps, num_stages=stages, enable_fp_fusion=fusion), until="ptx")
    ptx = k.asm["ptx"]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, mma="mma.sync" in ptx,
                shared=k.metadata.shared, cp_async=ptx.count("cp.async"))


for dt in ("bf16", "fp32"):
    # up (gathered rows, the squared ReLU), down, and the data gradients (weights read transposed)
    # (the first data gradient with the squared ReLU's derivative in its epilogue)
    for name, gather, relu2, drelu2, unit in (("up", True, True, False, "stride_bk"),
                                              ("down", False, False, False, "stride_bk"),
                                              ("data-grad", False, False, False, "stride_bn"),
                                              ("data-grad drelu2", False, False, True, "stride_bn")):
        t = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "c_ptr", "u_ptr")}
        t.update(arow_ptr=i64, tile_expert_ptr=i64, tile_row0_ptr=i64, tile_row1_ptr=i64)
        c = dict(GATHER=gather, RELU2=relu2, DRELU2=drelu2, BLOCK_M=cfg.moe_block_m, BLOCK_N=cfg.moe_block_n,
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
    t = dict(y_ptr=f"*{dt}", pos_ptr=i64, w_ptr="*fp32", out_ptr=f"*{dt}", add_ptr=f"*{dt}")
    # with the shared expert's rows added, or not; unweighted (the input gradient's sum)
    for k, add, wtd in ((2, False, True), (6, False, True), (6, True, True), (6, False, False)):
        done[f"{dt} combine k={k} add={add} weighted={wtd}"] = comp(
            mt._combine_kernel, t, dict(K=k, BLOCK_D=cfg.moe_combine_block_d, HAS_ADD=add, WEIGHTED=wtd), 4, 1)
    t = dict(g_ptr=f"*{dt}", y_ptr=f"*{dt}", token_ptr=i64, perm_ptr=i64, w_ptr="*fp32", dy_ptr=f"*{dt}",
             dw_ptr="*fp32")
    done[f"{dt} combine-bwd"] = comp(mt._combine_bwd_kernel, t, dict(BLOCK_D=cfg.moe_combine_block_d), 4, 1)
    # the few-row tiles: up and down through the decode tile (mma on 16 rows)
    bm, bn, warps, stages = mt.gemm_tile(1, torch.bfloat16 if dt == "bf16" else torch.float32, cfg)
    for name, gather, relu2 in (("up", True, True), ("down", False, False)):
        t = {n: f"*{dt}" for n in ("a_ptr", "b_ptr", "c_ptr", "u_ptr")}
        t.update(arow_ptr=i64, tile_expert_ptr=i64, tile_row0_ptr=i64, tile_row1_ptr=i64)
        c = dict(GATHER=gather, RELU2=relu2, DRELU2=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.moe_block_k,
                 PRECISION="ieee", stride_bk=1)
        done[f"{dt} decode {name}"] = comp(mt._grouped_gemm_kernel, t, c, warps, stages,
                                          {"N", "K", "stride_am", "stride_be", "stride_bn", "stride_cm"})
    # the router GEMM (fp32 weights, x in the model dtype), launched as the triton linear is (fusion on)
    t = dict(x_ptr=f"*{dt}", w_ptr="*fp32", out_ptr="*fp32")
    for name, bt, bn, warps in (("router", cfg.moe_router_block_t, cfg.moe_router_block_n, cfg.moe_router_warps),
                                ("large router", cfg.moe_router_large_block_t, cfg.moe_router_large_block_n,
                                 cfg.moe_router_large_warps)):
        c = dict(BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=cfg.linear_fp32_block_k)
        done[f"{dt} {name}"] = comp(mt._router_kernel, t, c, warps, 2, ("K", "stride_x", "stride_w"), fusion=True)
# the routing kernel: Nemotron-3-Nano's 128 experts top-6 (with and without groups), with the tables or not
t = dict(logits_ptr="*fp32", bias_ptr="*fp32", scale="fp32")
t.update({n: i64 for n in ("experts_ptr", "token_ptr", "perm_ptr", "pos_ptr", "offsets_ptr", "tile_expert_ptr",
                           "tile_row0_ptr", "tile_row1_ptr")})
t["weights_ptr"] = "*fp32"
for ng, tg, route, disp in ((1, 1, True, True), (1, 1, True, False), (8, 4, True, True), (8, 4, True, False),
                            (1, 1, False, True)):
    c = dict(E=128, E_PAD=128, N_GROUP=ng, TOPK_GROUP=tg, K=6, NORM=True, BLOCK_T=cfg.moe_route_block_t,
             ROUTE=route, DISPATCH=disp, TILE_M=cfg.moe_decode_block_m if route else cfg.moe_block_m, BLOCK_P=64)
    done[f"route groups={ng} route={route} dispatch={disp}"] = comp(mt._route_kernel, t, c, cfg.moe_route_warps, 1)
print(json.dumps(done))
"""


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90(sm90_cache):
    done = run_sm90_script(_COMPILE, sm90_cache)
    assert len(done) == 2 * 15 + 5, sorted(done)
    for name, r in done.items():
        if name.startswith("route") or name.endswith("router"):  # no dots on tensor cores: fp32 or none
            assert r["shared"] <= 227 * 1024, (name, r)
            assert name.endswith("router") or r["fma"] == 0, (name, r)  # the sigmoid's steps each rounded
            continue
        if name.startswith("bf16") or "combine" in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # the combine's products and sums each rounded
            assert "combine" in name or r["wgmma"] or r["mma"], (name, r)  # tensor cores
        if name.startswith("bf16 grouped"):
            assert r["wgmma"], (name, r)  # the 64-row tile runs on Hopper's warpgroup MMA
        if name.startswith("bf16 decode"):
            assert r["mma"] or r["wgmma"], (name, r)  # 16 rows: mma
        if name in ("bf16 grouped up", "bf16 grouped down", "bf16 decode up", "bf16 decode down"):
            assert r["cp_async"], (name, r)  # the K loop's loads are pipelined (moe_stages)
        assert r["shared"] <= 227 * 1024, (name, r)  # fits an H200 SM's shared memory
