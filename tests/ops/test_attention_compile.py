"""The Triton attention and relu2 kernels (forward, and the backwards) compile for sm_90 (the H200) in
the configurations the backend launches, to PTX (no GPU needed; ptxas is left to the GPU tests), and the
compiled attention keeps the arithmetic the bits rest on: no FMA contraction, dots on tensor cores for bf16
models, also when the forward saves its log-sum-exp for the backward."""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script

pytestmark = pytest.mark.compile

_COMPILE = r"""
import inspect, json, os, re
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.attention import triton as at
from aligned_mamba.ops.attention import triton_backward as ab
from aligned_mamba.ops.elementwise import triton as et

cfg = TritonKernelConfigs()
i64 = "*i64"
done = {}


def comp(fn, types, consts, warps, stages):
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    # the checks read the PTX: no ptxas
    k = compile_until(src, dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False), until="ptx")
    ptx = k.asm["ptx"]
    # the float arithmetic (per op, in the order the PTX issues it): a paged launch must have the slot one's
    arith = [ln.split()[0] for ln in ptx.splitlines() if ln.strip() and re.match(
        r"\s*(ex2|mul|add|sub|max|div|rcp|fma|wgmma.mma_async|mma.sync)[.a-z0-9]*\.(f32|bf16|f16)", ln)]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, mma="mma.sync" in ptx, arith=arith)


PART = "%PART%"
for dt in ("bf16", "fp32"):
    for D in (64, 128):
        for rep in (1, 4, 8, 16):
            for decode in ((False, True) if PART == "forward" else ()):
                tok = at.tokens_per_tile(rep, cfg, decode)
                t = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
                t.update(lse_ptr="*fp32", row0_ptr=i64, ntok_ptr=i64, pos0_ptr=i64, slot_ptr=i64, qk_scale="fp32")
                c = dict(REP=rep, REP_P=at.rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, PRECISION="ieee")
                w = cfg.attn_decode_warps if decode else cfg.attn_warps
                s = cfg.attn_decode_stages if decode else cfg.attn_stages
                t.update(bt_ptr="*i32")
                for lse in ((False, True) if not decode else (False,)):  # the trainer's forward saves lse
                    done[f"{dt} D{D} rep{rep} {'decode' if decode else 'prefill'}{' lse' if lse else ''}"] = comp(
                        at._attention_kernel, t, {**c, "STORE_LSE": lse}, w, s)
            for decode in ((False, True) if PART == "paged" and (dt == "bf16" or (D, rep) == (128, 4)) else ()):
                # over a paged cache: the same kernel with the block table read on the device
                tok = at.tokens_per_tile(rep, cfg, decode)
                t = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
                t.update(lse_ptr="*fp32", row0_ptr=i64, ntok_ptr=i64, pos0_ptr=i64, slot_ptr=i64, qk_scale="fp32",
                         bt_ptr="*i32")
                c = dict(REP=rep, REP_P=at.rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, PRECISION="ieee")
                w = cfg.attn_decode_warps if decode else cfg.attn_warps
                s = cfg.attn_decode_stages if decode else cfg.attn_stages
                name = f"{dt} D{D} rep{rep} {'decode' if decode else 'prefill'}"
                done[name] = comp(at._attention_kernel, t, c, w, s)
                done[name + " paged"] = comp(at._attention_kernel, t, {**c, "PAGED": True}, w, s)
            # the backward: every bf16 shape at GQA 1/4/16, fp32 at one (compile time on a CPU runner)
            if PART != "backward" or rep == 8 or (dt == "fp32" and (D, rep) != (64, 4)):
                continue
            # the backward's two kernels
            t = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr")}
            t.update(lse_ptr="*fp32", delta_ptr="*fp32", qk_scale="fp32", scale="fp32")
            t.update({n: i64 for n in ("blk_ptr", "krow_ptr", "nk_ptr", "qrow_ptr", "nq_ptr", "row0_ptr", "ntok_ptr",
                                       "pos0_ptr")})
            for name, fn, bm, bn in (("dkdv", ab._dkdv_kernel, cfg.attn_bwd_kv_block_m, cfg.attn_bwd_kv_block_n),
                                     ("dq", ab._dq_kernel, cfg.attn_bwd_q_block_m, cfg.attn_bwd_q_block_n)):
                c = dict(REP=rep, REP_P=at.rep_pad(rep), TOK=bm // at.rep_pad(rep), D=D, BLOCK_N=bn, PRECISION="ieee")
                done[f"{dt} D{D} rep{rep} bwd {name}"] = comp(fn, t, c, cfg.attn_bwd_warps, cfg.attn_bwd_stages)
if PART == "paged":
    pass
elif PART == "forward":
    done["bf16 relu2"] = comp(et._relu2_kernel, dict(x_ptr="*bf16", y_ptr="*bf16"), dict(BLOCK=cfg.relu2_block), 4, 1)
else:
    done["bf16 relu2 bwd"] = comp(et._relu2_bwd_kernel, dict(x_ptr="*bf16", g_ptr="*bf16", dx_ptr="*bf16"),
                                  dict(BLOCK=cfg.relu2_block), 4, 1)
if PART != "paged":
    for r in done.values():
        r.pop("arith")
print(json.dumps(done))
"""


@pytest.mark.slow
@pytest.mark.parametrize("part", ["forward", "backward"])  # two processes: each within the script's time limit
def test_attention_kernels_compile_for_sm90(part, sm90_cache):
    done = run_sm90_script(_COMPILE.replace("%PART%", part), sm90_cache)
    assert len(done) == (2 * 2 * 4 * 3 if part == "forward" else (2 * 3 + 1) * 2) + 1, sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") and "bwd" not in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # no contraction around the dots (the launcher's why)
        if name.startswith("bf16") and ("prefill" in name or "bwd d" in name):
            assert r["wgmma"], (name, r)  # the prefill tile and the backward run on Hopper's warpgroup MMA


@pytest.mark.slow
def test_the_paged_kernel_compiles_for_sm90_with_the_slot_caches_arithmetic(sm90_cache):
    """The launch over a paged cache (``PAGED``: the block table read on the device) for sm_90: no FMA
    contraction, bf16 prefill on warpgroup MMA, and the same float operations (bf16: in the same order)
    as the slot cache's launch of the same shape (only the addresses differ: the bits rest on that)."""
    done = run_sm90_script(_COMPILE.replace("%PART%", "paged"), sm90_cache)
    assert len(done) == 2 * (2 * 4 * 2 + 2), sorted(done)
    for name, r in done.items():
        if name.startswith("bf16"):
            assert r["fma"] == 0, (name, r)
            assert r["wgmma"] or "decode" in name, name
        if name.endswith(" paged"):
            slot = done[name[: -len(" paged")]]
            # bf16: the same sequence; fp32 (dots as FMA chains, interleaved by the scheduler with
            # independent ops): the same operations
            a, b = r["arith"], slot["arith"]
            same = a == b if name.startswith("bf16") else sorted(a) == sorted(b)
            assert same and len(r["arith"]) > 10, (name, len(r["arith"]), len(slot["arith"]))
