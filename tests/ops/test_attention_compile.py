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
from sm90_offline import compile_until, launch_constexprs
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.attention import triton as at
from aligned_mamba.ops.attention import triton_backward as ab
from aligned_mamba.ops.elementwise import triton as et

cfg = TritonKernelConfigs()
i64 = "*i64"
done = {}


def comp(fn, types, consts, warps, stages):
    consts = launch_constexprs(fn, consts)  # as a launch binds them (STORE_LSE, PAGED): no runtime branches
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
    done["bf16 D128 bwd delta"] = comp(ab._delta_kernel, dict(o_ptr="*bf16", do_ptr="*bf16", delta_ptr="*fp32"),
                                       dict(D=128, BLOCK_R=64), 4, 1)
if PART != "paged":
    for r in done.values():
        r.pop("arith")
print(json.dumps(done))
"""


@pytest.mark.slow
@pytest.mark.parametrize("part", ["forward", "backward"])  # two processes: each within the script's time limit
def test_attention_kernels_compile_for_sm90(part, sm90_cache):
    done = run_sm90_script(_COMPILE.replace("%PART%", part), sm90_cache)
    assert len(done) == (2 * 2 * 4 * 3 + 1 if part == "forward" else (2 * 3 + 1) * 2 + 2), sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") and "bwd" not in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # no contraction around the dots (the launcher's why)
        if name.startswith("bf16") and ("prefill" in name or "bwd dkdv" in name or "bwd dq" in name):
            assert r["wgmma"], (name, r)  # the prefill tile and the backward run on Hopper's warpgroup MMA


@pytest.mark.slow
def test_the_paged_kernel_compiles_for_sm90_with_the_slot_caches_arithmetic(sm90_cache):
    """The launch over a paged cache (``PAGED``: the block table read on the device) for sm_90: no FMA
    contraction, bf16 prefill on warpgroup MMA, and the same float operations, each as often, as the slot
    cache's launch of the same shape (only the addresses differ: the bits rest on that)."""
    done = run_sm90_script(_COMPILE.replace("%PART%", "paged"), sm90_cache)
    assert len(done) == 2 * (2 * 4 * 2 + 2), sorted(done)
    for name, r in done.items():
        if name.startswith("bf16"):
            assert r["fma"] == 0, (name, r)
            assert r["wgmma"] or "decode" in name, name
        if name.endswith(" paged"):
            slot = done[name[: -len(" paged")]]
            # the same operations, each as often (the scheduler interleaves independent ones with the
            # paged address arithmetic, so the PTX text order differs; the GPU tests check the bits)
            a, b = r["arith"], slot["arith"]
            assert sorted(a) == sorted(b) and len(a) > 10, (name, len(a), len(b))


_SPLIT = r"""
import hashlib, inspect, json, os, re
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until, launch_constexprs
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.attention import triton as at

cfg = TritonKernelConfigs()
S = 1024  # attn_split_n
done = {}


def comp(fn, types, consts, warps, stages):
    consts = launch_constexprs(fn, consts)
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    k = compile_until(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                      dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False), until="ptx")
    ptx = k.asm["ptx"]
    # without the debug line information, which moves with every edit of the source file
    bare = "\n".join(ln for ln in ptx.split(".section\t.debug")[0].splitlines()
                     if not ln.strip().startswith((".loc", ".file", "$L__", "//")))
    # the flavours of the merge's and the output's special ops (approximate or rounded, flush or not)
    ops = sorted(set(re.findall(r"\b((?:ex2|lg2|div|rcp)\.[a-z0-9.]*f32)", ptx)))
    arith = [ln.split()[0] for ln in ptx.splitlines() if ln.strip() and re.match(
        r"\s*(ex2|mul|add|sub|max|div|rcp|fma|wgmma.mma_async|mma.sync)[.a-z0-9]*\.(f32|bf16|f16)", ln)]
    return dict(fma=ptx.count("fma.rn.f32"), wgmma="wgmma" in ptx, ops=ops, arith=sorted(arith),
                digest=hashlib.sha256(bare.encode()).hexdigest()[:16])


for dt, D, rep in (("bf16", 128, 4), ("bf16", 64, 1), ("bf16", 128, 16), ("fp32", 64, 4)):
    t = {n: f"*{dt}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
    t.update({n: "*i64" for n in ("row0_ptr", "ntok_ptr", "pos0_ptr", "slot_ptr")})
    t.update(lse_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32", pa_ptr="*fp32", qk_scale="fp32", bt_ptr="*i32")
    for decode in (False, True):
        tok = at.tokens_per_tile(rep, cfg, decode)
        c = dict(REP=rep, REP_P=at.rep_pad(rep), TOK=tok, D=D, BLOCK_N=cfg.attn_block_n, PRECISION="ieee")
        w = cfg.attn_decode_warps if decode else cfg.attn_warps
        s = cfg.attn_decode_stages if decode else cfg.attn_stages
        name = f"{dt} D{D} rep{rep} {'decode' if decode else 'prefill'}"
        for paged in (False, True):
            p = " paged" if paged else ""
            # today's launch (attn_split_n 0), and the split one
            if (dt, D, rep) == ("bf16", 128, 4) or (dt == "fp32" and not paged and not decode):
                done[name + p + " S0"] = comp(at._attention_kernel, t, {**c, "PAGED": paged}, w, s)
            if decode:
                done[name + p + " partial"] = comp(at._attention_partial_kernel, t,
                                                   {**c, "PAGED": paged, "SPLIT_N": S}, w, s)
            else:
                for lse in (False, True):
                    done[name + p + (" lse" if lse else "") + " split"] = comp(
                        at._attention_kernel, t, {**c, "PAGED": paged, "SPLIT_N": S, "STORE_LSE": lse}, w, s)
    for lse in (False, True):
        done[f"{dt} D{D} rep{rep} combine{' lse' if lse else ''}"] = comp(
            at._attention_combine_kernel, t,
            dict(REP=rep, REP_P=at.rep_pad(rep), D=D, SPLIT_N=S, STORE_LSE=lse), 1, 1)
print(json.dumps(done))
"""

# The normalized PTX (debug line information left out) of today's kernel at attn_split_n 0, compiled
# at b23b7c9 (before the split) by triton 3.6.0: the split's code must leave it as it was. A deliberate
# change of the unsplit kernel updates these (benchmarks/ptx_digest.py's normalization).
_TODAY = {"triton": "3.6.0", "bf16 D128 rep4 prefill S0": "26e7c8c09b16731e",
          "bf16 D128 rep4 prefill paged S0": "00c9a471e162b6b0", "bf16 D128 rep4 decode S0": "413d8d6d33a1eb6a",
          "bf16 D128 rep4 decode paged S0": "0acef48faf4e4a00", "fp32 D64 rep4 prefill S0": "be7bdb32669bd5d4"}


@pytest.mark.slow
def test_the_split_kernels_compile_for_sm90_and_leave_todays_ptx(sm90_cache):
    """The split launches (``attn_split_n`` > 0: the prefill's fold, the decode's partial and combine
    kernels) for sm_90: no FMA contraction anywhere in bf16 (nor in the combine at all: a contracted
    merge there would not be the prefill's merge in registers), bf16 prefill on warpgroup MMA, the
    paged launches the slot cache's float operations, and the combine's exp2, division and log2 the
    same instructions as the prefill's fold. With
    attn_split_n 0 the kernel's PTX is the one before the split existed (its code compiles out)."""
    import triton

    done = run_sm90_script(_SPLIT, sm90_cache)
    assert len(done) == 4 * 8 + 5, sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") or "combine" in name:
            assert r["fma"] == 0, (name, r)
        if name.startswith("bf16") and "prefill" in name:
            assert r["wgmma"], (name, r)
        if " paged" in name:  # the same float operations, each as often, as the slot cache's launch
            slot = done[name.replace(" paged", "")]
            assert r["arith"] == slot["arith"] and len(r["arith"]) > 10, (name, len(r["arith"]), len(slot["arith"]))
        if "combine" in name:
            # the merge's exp2 and the output's division (and lse's log2) are the prefill fold's instructions
            fold = name.split(" combine")[0] + (" prefill lse split" if name.endswith("lse") else " prefill split")
            fold = done[fold]
            assert r["ops"] and set(r["ops"]) <= set(fold["ops"]), (name, r["ops"], fold["ops"])
    if triton.__version__ != _TODAY["triton"]:
        pytest.skip(f"today's PTX digests were taken with triton {_TODAY['triton']}, not {triton.__version__}")
    for name, digest in _TODAY.items():
        if name != "triton":
            assert done[name]["digest"] == digest, (name, done[name]["digest"])
