"""The row-parallel tree GEMM compiles for sm_90 (the H200) in every plan the row-parallel layers meet.

Offline, with the triton wheel's ptxas and cuobjdump, no GPU: the tree kernel (TMA and pointer
forms) at out_proj / o_proj / fc2 widths, decode to prefill row counts, 2 to 16 slices per rank, bf16
and fp32 models. The SASS must show HGMMA (wgmma) for bf16 tiles of 64 rows and more, HMMA for 16-row
tiles, TMA loads where descriptors are used, and no local memory: the stack of partial sums fits in
registers (``linear_tree_acc_regs``), which the plan's tile halving promises, or lives in global
memory (``linear_tree_global_stack``) beside one accumulator, as in today's GEMM. Both stacks compile,
and so does the split-slices grid at the decode and mid tiles (its tile counter an acquire-release
atomic at GPU scope).
"""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script, sass_script

pytestmark = pytest.mark.compile

_COMPILE_TREE = sass_script({"N", "C", "stride_xm", "stride_wn", "stride_ym"}, r"""
from aligned_mamba.ops.linear import triton_tree as tt

import dataclasses

glob = dataclasses.replace(cfg, linear_tree_global_stack=not cfg.linear_tree_global_stack)
plans, seen = {}, set()
for N in (2048, 4096):
    for M in (1, 64, 256, 8192):
        for local in (2, 4, 8, 16):
            for dt in ("bf16", "fp32"):
                w = torch.empty(N, 8, dtype=torch.bfloat16 if dt == "bf16" else torch.float32)
                plans[(dt, local, tt.tree_plan(M, w, local, cfg, sms=132))] = None
                # the other stack (linear_tree_global_stack): a global stack keeps the regime's tile
                gp = tt.tree_plan(M, w, local, glob, sms=132)
                if gp.tma and (dt, local, gp) not in seen:
                    seen.add((dt, local, gp))
                    tag = f"tree:{dt}:L{local}:{gp.block_m}x{gp.block_n}x{gp.block_k}:w{gp.num_warps}s{gp.num_stages}"
                    stack = tt.global_stack(gp, local, glob)
                    comp(tag + f":tma:{dt}:global{int(glob.linear_tree_global_stack)}", tt._tree_tma_kernel,
                         dict(x_desc=f"tensordesc<{dt}[{gp.block_m}, {gp.block_k}]>",
                              w_desc=f"tensordesc<{dt}[{gp.block_n}, {gp.block_k}]>",
                              y_desc=f"tensordesc<{dt}[{gp.block_m}, {gp.block_n // gp.epi_split}]>",
                              b_ptr="*" + dt, st_ptr="*fp32"),
                         dict(HAS_BIAS=True, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=gp.block_m,
                              BLOCK_N=gp.block_n, BLOCK_K=gp.block_k, GROUP_M=gp.group_m, PRECISION=gp.precision,
                              EPI_SPLIT=gp.epi_split, PERSISTENT=gp.persistent, GLOBAL_STACK=stack,
                              FLATTEN=glob.linear_tree_flatten and not stack),
                         num_warps=gp.num_warps, num_stages=gp.num_stages)
for dt, local, p in plans:
    tag = f"tree:{dt}:L{local}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}"
    opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
    c = dict(LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
             GROUP_M=p.group_m, PRECISION=p.precision)
    stack = tt.global_stack(p, local, cfg)
    if p.tma:  # TP 1 (bias, the model dtype) and a rank's fp32 subtree
        for out, bias in ((dt, True), ("fp32", False)):
            comp(tag + f":tma:{out}", tt._tree_tma_kernel,
                 dict(x_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_k}]>",
                      w_desc=f"tensordesc<{dt}[{p.block_n}, {p.block_k}]>",
                      y_desc=f"tensordesc<{out}[{p.block_m}, {p.block_n // p.epi_split}]>", b_ptr="*" + dt,
                      st_ptr="*fp32"),
                 dict(c, HAS_BIAS=bias, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent,
                      FLATTEN=cfg.linear_tree_flatten and not stack, GLOBAL_STACK=stack), **opts)
        # the other loop form (linear_tree_flatten), TP 1's launch
        comp(tag + f":tma:{dt}:flatten{int(not cfg.linear_tree_flatten)}", tt._tree_tma_kernel,
             dict(x_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_k}]>",
                  w_desc=f"tensordesc<{dt}[{p.block_n}, {p.block_k}]>",
                  y_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_n // p.epi_split}]>", b_ptr="*" + dt,
                  st_ptr="*fp32"),
             dict(c, HAS_BIAS=True, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent,
                  FLATTEN=not cfg.linear_tree_flatten and not stack, GLOBAL_STACK=stack), **opts)
    # the pointer kernel: the plan's own launch without TMA, or a TMA plan's fallback tile
    f = tt.fallback_plan(p, local, cfg) if p.tma else p
    comp(f"tree:{dt}:L{local}:{f.block_m}x{f.block_n}x{f.block_k}:w{f.num_warps}s{f.num_stages}:ptr",
         tt._tree_ptr_kernel, dict(x_ptr="*" + dt, w_ptr="*" + dt, y_ptr="*" + dt, b_ptr="*" + dt),
         dict(c, HAS_BIAS=True, BLOCK_M=f.block_m, BLOCK_N=f.block_n, FLATTEN=cfg.linear_tree_flatten),
         num_warps=f.num_warps,
         num_stages=f.num_stages)
print(json.dumps(done))
""")


@pytest.mark.slow
def test_the_tree_gemm_compiles_for_sm90_without_spills(sm90_cache):
    done = run_sm90_script(_COMPILE_TREE, sm90_cache)
    assert len(done) >= 20, [d["name"] for d in done]
    for d in done:
        assert d["LDL"] == d["STL"] == 0, d  # the stack of partial sums stays in registers
        _, dt, _, tile = d["name"].split(":")[:4]
        bm = int(tile.split("x")[0])
        if dt == "bf16":
            assert d["HGMMA" if bm >= 64 and ":tma:" in d["name"] else "HMMA"] > 0 or d["HGMMA"] > 0, d
        if ":tma:" in d["name"]:
            assert d["UTMALDG"] > 0, d


_COMPILE_SPLIT = sass_script({"N", "C", "stride_xm", "stride_wn", "stride_ym"}, r"""
from aligned_mamba.ops.linear import triton as lt
from aligned_mamba.ops.linear import triton_tree as tt

compile_ = triton.compile
ptx = []


def keep_ptx(src, target=None, options=None):
    k = compile_(src, target=target, options=options)
    ptx.append(k.asm["ptx"])
    return k


triton.compile = keep_ptx
w = torch.empty(2048, 8, dtype=torch.bfloat16)
for M in (1, 64):
    p = lt.plan(M, w, cfg, sms=132)
    # TP 1 (bias, bf16) at every local; a rank's fp32 subtree once
    for local, out, bias in ((2, "bf16", True), (4, "bf16", True), (8, "bf16", True), (4, "fp32", False)):
        if out == "fp32" and M == 1:
            continue
        jn = tt.join_block_n(p, local, cfg)
        comp(f"split:bf16:L{local}:{p.block_m}x{p.block_n}x{p.block_k}:w{p.num_warps}s{p.num_stages}j{jn}:{out}",
             tt._tree_split_kernel,
             dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*" + out, b_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32"),
             dict(HAS_BIAS=bias, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m, BLOCK_N=p.block_n,
                  BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision, JOIN_N=jn),
             num_warps=p.num_warps, num_stages=p.num_stages)
        done[-1]["acq_rel_adds"] = len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx[-1]))
print(json.dumps(done))
""")


@pytest.mark.slow
def test_the_split_grid_compiles_for_sm90_without_spills(sm90_cache):
    done = run_sm90_script(_COMPILE_SPLIT, sm90_cache)
    assert len(done) == 7, [d["name"] for d in done]
    for d in done:
        assert d["LDL"] == d["STL"] == 0, d  # one accumulator, then the fold of JOIN_N columns
        bm = int(d["name"].split(":")[3].split("x")[0])
        assert d["HGMMA" if bm >= 64 else "HMMA"] > 0, d
        assert d["acq_rel_adds"] == 1, d  # the tile's counter: release the partials, acquire the others'
