"""Every Triton kernel compiles for sm_90 (the H200) in every configuration the backend launches.

The CPU tests run the kernels through the Triton interpreter, which accepts code that the compiler
refuses (a loop-carried variable whose shape changes, a name reused with another shape). This
compiles each kernel offline with the ptxas shipped in the triton wheel, no GPU needed, for fp32
models (fp32 FMA dots, "row" and "tile" decode) and bf16 models (tensor-core dots, no fp
contraction), with the flags the launchers pass.
"""

from __future__ import annotations

import pytest
from sm90_offline import run_sm90_script

pytestmark = pytest.mark.compile

_COMPILE_ALL = r"""
import inspect, json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.ssd import triton_backward as tb, triton_chunk as tc, triton_decode as td
from aligned_mamba.ops.ssd.triton_dot import DOT_MODES

cfg = TritonKernelConfigs()
BK, BP, BN, NW = cfg.block_k, cfg.block_p, cfg.block_n, cfg.num_warps
D = dict(H=32, G=1, L=256, P=64, N=128)
bf, i64 = "*bf16", "*i64"
done = []


TCS = %TCS%
ROW_STRIDES = dict(sx_q="i32", sdt_q="i32", sB_q="i32", sC_q="i32")  # the token rows' (views of the layer's rows)
STEP_TYPES = dict(x_ptr=bf, dt_ptr=bf, B_ptr=bf, C_ptr=bf, buf_x_ptr=bf, buf_dt_ptr=bf, buf_B_ptr=bf, y_ptr=bf,
                  slots_ptr=i64, pos_ptr=i64, cnt_ptr="*i32", lo="fp32", hi="fp32", sD_h="i32", sD_p="i32",
                  copy_ptr=bf, **ROW_STRIDES)
STEP_CONSTS = dict(D, R=td.DECODE_ROW_TILE, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN, BLOCK_NS=128, BLOCK_L=256,
                   PRECISION=cfg.dot_precision, PB=1, ZB=1024, RT_RANGE=td.STEP_RT_RANGE)


def comp(fn, types, consts, fuse, warps=NW):
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=warps, enable_fp_fusion=fuse)
    if consts.get("TC") and fn is tc._tile_output_kernel:
        opts.update(tc.TILE_OPTS)
    if consts.get("TC") and fn is td._tile_kernel:
        opts.update(td.TILE_OPTS)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    done.append(f"{fn.fn.__name__}:{consts.get('TC', 'fp32')}")


for TC in TCS:  # fp32 FMA dots; tensor-core dots, split2 and round
    fuse = not TC
    comp(tc._cumsum_kernel, {}, dict(H=32, L=256, BLOCK_L=256), fuse)
    model = dict(x_ptr=bf, xp_ptr=bf, B_ptr=bf, Bp_ptr=bf) if TC else {}  # x and B in the model dtype
    rows = dict(part_ptr=i64, row0_ptr=i64, length_ptr=i64)
    comp(tc._chunk_state_kernel, dict(chunk_ptr=i64, sx="i32", sb="i32", **model, **rows),
         dict(D, BLOCK_K=BK, BLOCK_P=BP, BLOCK_NS=128, PRECISION=cfg.dot_precision, TC=TC), fuse)
    h_in = dict(h_in_ptr=bf) if TC == DOT_MODES["round"] else {}  # "round" stores the boundary states as bf16
    copy = TC == DOT_MODES["round"]  # and a bf16 model's decode state their bf16 copy, which the tile reads
    comp(tc._state_pass_kernel, dict(need_ptr=i64, slot_ptr=i64, first_ptr=i64, count_ptr=i64, **h_in),
         dict(H=32, L=256, P=64, N=128, BLOCK_P=16, BLOCK_N=BN, WRITE_IN=True, RT_RANGE=True), fuse)
    comp(tc._cb_kernel, dict(B_ptr=bf, Bp_ptr=bf, C_ptr=bf, pre_ptr=i64, sb="i32", sc="i32", **rows),
         dict(G=1, L=256, N=128, R=cfg.row_tile, BLOCK_K=BK, BLOCK_N=BN, PRECISION=cfg.dot_precision, TC=TC),
         fuse)
    comp(tc._tile_output_kernel, dict(x_ptr=bf, xp_ptr=bf, C_ptr=bf, y_ptr=bf, h_row_ptr=i64, tile_chunk_ptr=i64,
                                      tile_pos_ptr=i64, tile_rows_ptr=i64, sD_h="i32", sD_p="i32", sx="i32", sc="i32",
                                      **rows, **h_in),
         dict(D, R=cfg.row_tile, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN, PRECISION=cfg.dot_precision, TC=TC), fuse)
    for with_cb in (False, True):
        comp(td._prep_kernel, dict(x_ptr=bf, dt_ptr=bf, B_ptr=bf, C_ptr=bf, buf_x_ptr=bf, buf_dt_ptr=bf, buf_B_ptr=bf,
                                   slots_ptr=i64, pos_ptr=i64, lo="fp32", hi="fp32", **ROW_STRIDES),
             dict(D, BLOCK_HG=32, BLOCK_PF=64, BLOCK_NF=128, KB=BK, HAS_LIMIT=with_cb, WITH_CB=with_cb, TC=TC,
                  R=td.DECODE_ROW_TILE, BLOCK_N=BN, PDL=with_cb), False)
    for pdl in (False, True):  # with and without programmatic dependent launch
        comp(td._tile_kernel, dict(buf_x_ptr=bf, buf_B_ptr=bf, C_ptr=bf, y_ptr=bf, slots_ptr=i64, pos_ptr=i64,
                                   sD_h="i32", sD_p="i32", sC_q="i32", **(dict(state_ptr=bf) if copy else {})),
             dict(D, R=td.DECODE_ROW_TILE, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN, BLOCK_L=256,
                  PRECISION=cfg.dot_precision, TC=TC, PDL=pdl, RT_RANGE=td.TILE_RT_RANGE), fuse)
    comp(td._update_kernel, dict(buf_x_ptr=bf, buf_B_ptr=bf, slots_ptr=i64, pos_ptr=i64, seq_ptr=i64, n="i32",
                                 copy_ptr=bf),
         dict(D, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=128, PRECISION=cfg.dot_precision, TC=TC, LISTED=TC == 1,
              QB=td.COMPLETION_BLOCK, PDL=bool(TC), COPY=copy), fuse)
    if TC:  # the one-launch step: bf16 models only
        comp(td._step_kernel, STEP_TYPES, dict(STEP_CONSTS, TC=TC, HAS_LIMIT=TC == 1, COPY=copy, READ_COPY=copy),
             False)
    # the scan's backward (fp32 chunk tensors but x, dy and dx: strided views of the packed rows, in the
    # model dtype; the dots' precision as the forward's)
    dims = dict(H=32, G=1, L=256, P=64, BLOCK_P=64, PRECISION=cfg.dot_precision, TC=TC, FLAT=tb.BWD_FLAT_GRID)
    BS, BT, HPP = cfg.bwd_block_s, cfg.bwd_block_t, tb.heads_per_program(tb.BWD_HEADS_PER_PROGRAM, 32)
    rows_x = dict(x_ptr=bf, dy_ptr=bf) if TC else {}
    strides = {f"s{t}_{d}": "i32" for t in "xyo" for d in "chl"}
    bwd_warps = tb.BWD_OPTS.get("num_warps", cfg.bwd_warps)  # the launch's (a sweep may override)
    comp(tb._bwd_dx_kernel, dict(sD_h="i32", sD_p="i32", **strides, **rows_x, **(dict(dx_ptr=bf) if TC else {})),
         dict(dims, N=128, BS=BS, BT=BT, BLOCK_N=128), fuse, bwd_warps)
    comp(tb._bwd_dcb_kernel, dict(strides, **rows_x), dict(dims, BS=BS, BT=BT, HPP=HPP), fuse, bwd_warps)
    for to_end, rb in ((True, BS), (False, BT)):  # the states' shares of dB and of dC (and da)
        comp(tb._bwd_rows_kernel, dict(su_c="i32", su_h="i32", su_l="i32", **(dict(u_ptr=bf) if TC else {})),
             dict(dims, N=128, BR=rb, BLOCK_N=128, HPP=HPP, TO_END=to_end), fuse, bwd_warps)
    blocks = {k: v for k, v in tb.STATE_OPTS.items() if k.startswith("BLOCK_")}
    for to_end in (True, False):  # the chunk states and dS
        comp(tb._weighted_state_kernel, dict({f"s{t}_{d}": "i32" for t in "uv" for d in ("c", "h", "g", "l")},
                                             **(dict(u_ptr=bf, v_ptr=bf) if TC else {})),
             dict(D, **blocks, TO_END=to_end, PRECISION=cfg.dot_precision, TC=TC), fuse,
             tb.STATE_OPTS.get("num_warps", cfg.bwd_warps))
if 0 in TCS:  # the kernels without a dot mode, with the fp32 part
    comp(tc._dt_kernel, dict(dt_ptr=bf, buf_dt_ptr=bf, chunk_slot_ptr=i64, pre_ptr=i64, length_ptr=i64, row0_ptr=i64,
                            lo="fp32", hi="fp32", sdt="i32"),
         dict(H=32, L=256, ROWS=32, BLOCK_H=32, HAS_LIMIT=True), False)
    comp(tc._pack_kernel, dict(x_ptr=bf, B_ptr=bf, buf_x_ptr=bf, buf_B_ptr=bf, xc_ptr=bf, Bc_ptr=bf, chunk_slot_ptr=i64,
                              pre_ptr=i64, length_ptr=i64, row0_ptr=i64, part_ptr=i64, sx="i32", sb="i32"),
         dict(D, ROWS=32, BLOCK_PF=64, BLOCK_NF=128), True)
    comp(tc._buffer_kernel, dict(x_ptr=bf, dt_ptr=bf, B_ptr=bf, buf_x_ptr=bf, buf_dt_ptr=bf, buf_B_ptr=bf, slot_ptr=i64,
                                keep_lo_ptr=i64, keep_hi_ptr=i64, keep_row0_ptr=i64, clear_hi_ptr=i64, sx="i32",
                                sdt="i32", sb="i32"),
         dict(D, ROWS=32, BLOCK_PF=64, BLOCK_NF=128), True)
    comp(td._row_kernel, dict(buf_x_ptr=bf, C_ptr=bf, y_ptr=bf, slots_ptr=i64, pos_ptr=i64, sD_h="i32", sD_p="i32",
                              sC_q="i32"),
         dict(D, HPP=2, RB_P=64, BLOCK_L=256, SB=16), True)
    comp(tb._dstate_pass_kernel, dict(first_ptr=i64, count_ptr=i64), dict(H=32, L=256, P=64, N=128, BLOCK_P=64,
                                                                         BLOCK_N=BN), True)
    comp(tb._bwd_epilogue_kernel, dict(raw_ptr=bf, graw_ptr=bf, row0_ptr=i64, row_lo_ptr=i64, row_hi_ptr=i64,
                                       s_raw="i32", lo="fp32", hi="fp32"),
         dict(H=32, L=256, PN=64 * 128, BS=cfg.bwd_block_s, BT=cfg.bwd_block_t, BLOCK_PN=2048, DT_ROWS=True,
              HAS_LIMIT=True), False, cfg.bwd_warps)
    comp(td._zero_kernel, dict(buf_x_ptr=bf, buf_dt_ptr=bf, buf_B_ptr=bf, slots_ptr=i64, pos_ptr=i64, seq_ptr=i64,
                              n="i32"),
         dict(D, BLOCK_L=256, ZB=1024, LISTED=True, QB=td.COMPLETION_BLOCK, PDL=True), True)
print(json.dumps(done))
"""


@pytest.mark.slow
@pytest.mark.parametrize("tcs", [(0,), (1, 2)])  # two processes, which xdist's two workers can share
def test_every_kernel_compiles_for_sm90(tcs, sm90_cache):
    done = run_sm90_script(_COMPILE_ALL.replace("%TCS%", repr(tcs)), sm90_cache)
    # 16 kernel configs per dot mode (6 of the backward's), the step kernel per tensor-core mode; dt, pack, buffer,
    # row, reverse pass, the backward's epilogue and zero kernels
    assert len(done) == len(tcs) * 16 + sum(1 for t in tcs if t) + 7 * (0 in tcs), done
    assert {d.split(":")[1] for d in done} - {"fp32"} == {str(t) for t in tcs}, done


_COMPLETION_DOTS = r"""
import inspect, json, os, re
os.environ.pop("TRITON_INTERPRET", None)
from triton.compiler import ASTSource
from sm90_offline import compile_until
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.ssd import triton_chunk as tc, triton_decode as td
from aligned_mamba.ops.ssd.triton_dot import DOT_MODES

cfg = TritonKernelConfigs()
i64 = "*i64"
ROUND = DOT_MODES["round"]  # the mode whose decode state keeps the bf16 copy


def dot_accumulators(fn, types, consts, fuse):
    # what each tt.dot of the kernel's TTIR accumulates onto: a zero constant, a loop-carried value,
    # or the result of another operation (named)
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    k = compile_until(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                      dict(num_warps=cfg.num_warps, enable_fp_fusion=fuse), until="ttir")  # reads the TTIR
    ir = k.asm["ttir"].splitlines()
    defs = {m.group(1): m.group(2) for m in (re.match(r"\s*(%[\w.]+) = ([\w.]+)", ln) for ln in ir) if m}
    out = []
    for ln in ir:
        m = re.search(r"= tt\.dot (%[\w.]+), (%[\w.]+), (%[\w.]+)", ln)
        if m:
            d = defs.get(m.group(3))
            line = next((x for x in ir if re.match(rf"\s*{re.escape(m.group(3))} = ", x)), "")
            out.append("loop" if d is None else "zero" if d == "arith.constant" and "dense<0.0" in line else d)
    return out


res = {}
for TC, L in ((0, 32), (0, 256), (1, 32), (2, 32)):
    fuse = not TC
    D = dict(H=4, G=2, L=L, P=64, N=32)
    bf = "*bf16" if TC else "*fp32"
    rows = dict(part_ptr=i64, row0_ptr=i64, length_ptr=i64, chunk_ptr=i64)
    prefill = dot_accumulators(tc._chunk_state_kernel,
                               dict(x_ptr=bf, xp_ptr=bf, B_ptr=bf, Bp_ptr=bf, sx="i32", sb="i32", **rows),
                               dict(D, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_NS=td.state_block_n(32),
                                    PRECISION=cfg.dot_precision, TC=TC), fuse)
    decode = dot_accumulators(td._update_kernel, dict(buf_x_ptr=bf, buf_B_ptr=bf, slots_ptr=i64, pos_ptr=i64,
                                                      seq_ptr=i64, n="i32", copy_ptr="*bf16"),
                              dict(D, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_N=td.state_block_n(32),
                                   PRECISION=cfg.dot_precision, TC=TC, LISTED=False, QB=td.COMPLETION_BLOCK,
                                   PDL=False, COPY=TC == ROUND), fuse)
    res[f"TC{TC} L{L}"] = [prefill, decode]
    if TC:  # the one-launch step's completion: its last dots, after the output's
        bfs = "*bf16"
        step = dot_accumulators(td._step_kernel, dict(x_ptr=bfs, dt_ptr=bfs, B_ptr=bfs, C_ptr=bfs, buf_x_ptr=bfs,
                                                      buf_dt_ptr=bfs, buf_B_ptr=bfs, y_ptr=bfs, slots_ptr=i64,
                                                      pos_ptr=i64, cnt_ptr="*i32", lo="fp32", hi="fp32",
                                                      sD_h="i32", sD_p="i32", sx_q="i32", sdt_q="i32",
                                                      sB_q="i32", sC_q="i32", copy_ptr=bfs),
                                dict(D, R=16, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n,
                                     BLOCK_NS=td.state_block_n(32), BLOCK_L=L, PRECISION=cfg.dot_precision, TC=TC,
                                     HAS_LIMIT=False, PB=1, ZB=1024, RT_RANGE=td.STEP_RT_RANGE, COPY=TC == ROUND,
                                     READ_COPY=TC == ROUND), False)
        res[f"step TC{TC} L{L}"] = [prefill, step[len(step) - len(prefill):]]
print(json.dumps(res))
"""


@pytest.mark.slow
def test_completion_dots_accumulate_as_the_chunk_states(sm90_cache):
    """A decode step's chunk completion (``_update_kernel``) adds the chunk state to the decayed
    boundary state after its dots, as the prefill's state pass adds the stored chunk state. With a
    one-block K loop (chunk size <= block_k) Triton folds ``d + dot(a, b, 0)`` into ``dot(a, b, d)``,
    a chain seeded with d: other bits (seen on the H200 at chunk 32, fp32). Each dot of the
    completion must accumulate onto what the prefill's chunk-state dot accumulates onto."""
    res = run_sm90_script(_COMPLETION_DOTS, sm90_cache)
    for case, (prefill, decode) in res.items():
        assert prefill and decode == prefill, (case, prefill, decode)


_STEP_FMA = r"""
import inspect, json, os
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligned_mamba.ops.configs import TritonKernelConfigs
from aligned_mamba.ops.ssd import triton_decode as td
from aligned_mamba.ops.ssd.triton_dot import DOT_MODES

cfg = TritonKernelConfigs()
bf, i64 = "*bf16", "*i64"
ROUND = DOT_MODES["round"]  # the mode whose decode state keeps the bf16 copy
D = dict(H=32, G=1, L=256, P=64, N=128)


def ptx(fn, types, consts, **opts):
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in inspect.signature(fn.fn).parameters}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps, **opts)).asm["ptx"]


out = {}
for TC, rt in ((1, False), (2, False), (1, True)):
    code = ptx(td._step_kernel, dict(x_ptr=bf, dt_ptr=bf, B_ptr=bf, C_ptr=bf, buf_x_ptr=bf, buf_dt_ptr=bf,
                                     buf_B_ptr=bf, y_ptr=bf, slots_ptr=i64, pos_ptr=i64, cnt_ptr="*i32", lo="fp32",
                                     hi="fp32", sD_h="i32", sD_p="i32", sx_q="i32", sdt_q="i32", sB_q="i32",
                                     sC_q="i32", copy_ptr=bf),
               dict(D, R=16, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, BLOCK_NS=128,
                    BLOCK_L=256, PRECISION=cfg.dot_precision, TC=TC, HAS_LIMIT=True, PB=1, ZB=1024, RT_RANGE=rt,
                    COPY=TC == ROUND, READ_COPY=TC == ROUND),
               enable_fp_fusion=False, **td.STEP_OPTS)
    out[f"TC{TC} rt {rt}"] = dict(fma=code.count("fma.rn.f32"), mma="wgmma" in code or "mma.sync" in code,
                   atom="atom.global.gpu.acq_rel.add" in code)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_step_kernel_has_no_contracted_fma(sm90_cache):
    """The one-launch decode step keeps the four launches' float operations: compiled without FMA
    contraction (the split dots' ``v - hi`` and the softplus must not fuse), its dots on tensor
    cores, and its completion counter an acquire-release atomic (the last reader empties the buffers)."""
    res = run_sm90_script(_STEP_FMA, sm90_cache)
    for tc, r in res.items():
        assert r == dict(fma=0, mma=True, atom=True), (tc, r)
