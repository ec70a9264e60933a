"""What several of the attention's test modules share: the GPU tests' inputs and hybrids, the sm_90 compile
script of the kernels (the forward's, the backward's, the paged launch's)."""

from __future__ import annotations

import torch
from sm90_offline import run_sm90_script

BF16 = torch.bfloat16


def gpu_cfg():
    from aligned_mamba.ops.configs import TritonKernelConfigs
    return TritonKernelConfigs()


def gpu_qkv(T: int, H: int, G: int, D: int, seed: int, dtype: torch.dtype = BF16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(T, n, D, generator=g, device="cuda").to(dtype) for n in (H, G, G))


HYBRIDS = {
    "attention_first_gqa1_d64": dict(pattern="*M-M", num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    "attention_last_gqa4_d128": dict(pattern="M-M*", num_attention_heads=8, num_key_value_heads=2, head_dim=128),
    "two_attention_gqa8_d64": dict(pattern="M**-M", num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                                   n_groups=2),
}
SMALL = dict(hidden_size=256, vocab_size=512, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32,
             intermediate_size=512, chunk_size=64)


def hybrid(layout: str, **configs):
    """The layout's bf16 hybrid on the triton backend; ``configs`` replace kernel config fields."""
    import dataclasses

    from aligned_mamba.contract import Contract
    from aligned_mamba.models import build_model
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    over = dict(HYBRIDS[layout])
    cfg, tensors = make_tiny_hybrid(11, dtype="bfloat16", pattern=over.pop("pattern"), **{**SMALL, **over})
    contract = Contract(chunk_size=cfg.chunk_size, backend="triton", model_dtype="bfloat16",
                        kernel_configs=dataclasses.replace(gpu_cfg(), **configs))
    return build_model(cfg, tensors, contract, device="cuda")


def scattered_pages(B: int, max_len: int, page: int, seed: int):
    """A KVPages for B slots whose free list is shuffled, so consecutive blocks of a slot land on
    scattered pages (and slots interleave)."""
    from aligned_mamba.layers.attention import KVPages

    pages = KVPages(B, max_len, page, B * -(-max_len // page) + 1, "cuda")
    order = torch.randperm(pages.num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages.free = order
    return pages


def write_context(pages, kp: torch.Tensor, vp: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor,
                  cu: torch.Tensor, k: torch.Tensor, v: torch.Tensor, P: int):
    """The contexts' keys and values (packed rows ``cu[i] ..`` of k, v) written into pages through the
    block table, as the prefill writes them; returns each written key's (sequence, position, packed row)."""
    from aligned_mamba.ops.attention.blocked import page_index

    pages.ensure(slots.numpy(), ctx.numpy())
    seq = torch.repeat_interleave(torch.arange(len(ctx)), ctx)
    pos = torch.cat([torch.arange(int(c)) for c in ctx])
    src = (cu[:-1][seq] + pos).cuda()
    pg, off = page_index(pages.table, slots[seq].cuda(), pos.cuda(), P)
    kp[pg, off], vp[pg, off] = k[src], v[src]
    return seq, pos, src


KERNELS = r"""
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


def assert_the_kernels_compile_for_sm90(part: str, sm90_cache) -> None:
    """``KERNELS`` for one part ("forward" or "backward"; each in a process of its own, within the
    script's time limit): the count of kernels, no FMA contraction, warpgroup MMA where due."""
    done = run_sm90_script(KERNELS.replace("%PART%", part), sm90_cache)
    assert len(done) == (2 * 2 * 4 * 3 + 1 if part == "forward" else (2 * 3 + 1) * 2 + 2), sorted(done)
    for name, r in done.items():
        if name.startswith("bf16") and "bwd" not in name:  # (an fp32 model's IEEE dot is FMAs by construction)
            assert r["fma"] == 0, (name, r)  # no contraction around the dots (the launcher's why)
        if name.startswith("bf16") and ("prefill" in name or "bwd dkdv" in name or "bwd dq" in name):
            assert r["wgmma"], (name, r)  # the prefill tile and the backward run on Hopper's warpgroup MMA
