"""A digest of the PTX every SSD Triton kernel, the linear GEMM and the conv1d kernels compile to for sm_90.

    python3 benchmarks/ptx_digest.py [--out digest.json] [--ptx-dir DIR] [--only linear/]

No GPU needed (the triton wheel's compiler and ptxas). Run it at two commits and compare: equal
digests mean a change left the compiled kernels as they were (a refactor that cannot move a
bit), which a GPU run would otherwise have to show. The PTX is taken without its debug line
information (``.loc``/``.file`` lines, labels, comments and the debug sections), which moves
with every edit of the source file. Shapes are the 128-head, 8-group mixer of the H200 bench
(head dim 64, state 128, chunk 256); each kernel is compiled for fp32 models (fp32 FMA dots) and
bf16 models (tensor-core dots, programmatic dependent launch where the launcher uses it). The
linear GEMM (``ops/linear/triton.py``) is compiled in every plan of the pinned configs at the model
widths, TMA and pointer forms, bf16 and fp32 (``linear/...`` entries). The conv1d kernels
(``ops/conv1d/triton.py``, ``conv/...`` entries) at their launches, fp32 and bf16 rows, width 4, with
and without bias; each backward form's entry names its launch (rows x channels, warps).
Constexprs a kernel no longer has are dropped, and the pinned values of ones it used to have
are passed to older sources (``LEGACY``), so that the same script can read past commits.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as ct  # noqa: E402
from aligned_mamba.ops.linear import triton as lt  # noqa: E402
from aligned_mamba.ops.ssd import triton_chunk as tc  # noqa: E402
from aligned_mamba.ops.ssd import triton_decode as td  # noqa: E402
from aligned_mamba.ops.ssd.triton_dot import DOT_MODES, tensor_core_dots  # noqa: E402

CFG = TritonKernelConfigs()
D = dict(H=128, G=8, L=256, P=64, N=128)
BF, I64 = "*bf16", "*i64"
# pinned values of constexprs that older sources had (the while K loop; one column block per prep program)
LEGACY = dict(K_LOOP=0, KB_PER=1)
TC_BF16 = tensor_core_dots(torch.bfloat16, CFG.bf16_dots)  # bf16 models' dots, as the launches take them
DEVICE_SILU = getattr(CFG, "silu", "ieee") == "device"  # the conv's SiLU (configs before it had only "ieee")


def normalized_ptx(ptx: str) -> str:
    ptx = ptx.split(".section\t.debug")[0]
    return "\n".join(ln for ln in ptx.splitlines() if not ln.strip().startswith((".loc", ".file", "$L__", "//")))


def compile_ptx(fn, types: dict, consts: dict, fuse: bool, opts: dict) -> str:
    params = inspect.signature(fn.fn).parameters
    consts = {k: v for k, v in {**LEGACY, **consts}.items() if k in params}
    sig = {n: ("constexpr" if n in consts else types.get(n, "*fp32")) for n in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": CFG.num_warps, "enable_fp_fusion": fuse, **opts})
    return normalized_ptx(k.asm["ptx"])


def configs():
    """(name, kernel, pointer types, constexprs, fp fusion, compile options) per pinned launch."""
    BK, BP, BN, prec = CFG.block_k, CFG.block_p, CFG.block_n, CFG.dot_precision
    rows = dict(part_ptr=I64, row0_ptr=I64, length_ptr=I64, pre_ptr=I64, chunk_ptr=I64)
    for TC in (0, TC_BF16):  # fp32 models; bf16 models (the pinned bf16_dots)
        fuse, model = not TC, ("bf16" if TC else "fp32")
        m = dict(x_ptr=BF, xp_ptr=BF, B_ptr=BF, Bp_ptr=BF) if TC else {}
        h_in = dict(h_in_ptr=BF) if TC == DOT_MODES["round"] else {}  # "round" stores the boundary states as bf16
        copy = TC == DOT_MODES["round"]  # and a model's decode state keeps their bf16 copy, which the tile reads
        yield f"cumsum/{model}", tc._cumsum_kernel, {}, dict(H=D["H"], L=D["L"], BLOCK_L=D["L"]), fuse, {}
        yield (f"chunk_state/{model}", tc._chunk_state_kernel, dict(**m, **rows, sx="i32", sb="i32"),
               dict(D, BLOCK_K=BK, BLOCK_P=BP, BLOCK_NS=td.state_block_n(D["N"]), PRECISION=prec, TC=TC), fuse, {})
        yield (f"state_pass/{model}", tc._state_pass_kernel,
               dict(need_ptr=I64, slot_ptr=I64, first_ptr=I64, count_ptr=I64, **h_in),
               dict(H=D["H"], L=D["L"], P=D["P"], N=D["N"], BLOCK_P=min(CFG.pass_block_p, BP), BLOCK_N=BN,
                    WRITE_IN=True, RT_RANGE=True), fuse, {})
        yield (f"cb/{model}", tc._cb_kernel, dict(B_ptr=BF, Bp_ptr=BF, C_ptr=BF, sb="i32", sc="i32", **rows),
               dict(G=D["G"], L=D["L"], N=D["N"], R=CFG.row_tile, BLOCK_K=BK, BLOCK_N=BN, PRECISION=prec, TC=TC),
               fuse, {})
        yield (f"row_tiles/{model}", tc._tile_output_kernel,
               dict(**m, C_ptr=BF, y_ptr=BF, h_row_ptr=I64, tile_chunk_ptr=I64, tile_pos_ptr=I64, tile_rows_ptr=I64,
                    sD_h="i32", sD_p="i32", sx="i32", sc="i32", **rows, **h_in),
               dict(D, R=CFG.row_tile, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN, PRECISION=prec, TC=TC), fuse,
               tc.TILE_OPTS if TC else {})
        pdl = bool(TC)
        yield (f"decode_prep/{model}", td._prep_kernel,
               dict(x_ptr=BF, dt_ptr=BF, B_ptr=BF, C_ptr=BF, buf_x_ptr=BF, buf_dt_ptr=BF, buf_B_ptr=BF, slots_ptr=I64,
                    pos_ptr=I64, lo="fp32", hi="fp32", sx_q="i32", sdt_q="i32", sB_q="i32", sC_q="i32"),
               dict(D, BLOCK_HG=triton.next_power_of_2(D["H"] // D["G"]), BLOCK_PF=D["P"], BLOCK_NF=D["N"], KB=BK,
                    HAS_LIMIT=False, WITH_CB=True, TC=TC, R=td.DECODE_ROW_TILE, BLOCK_N=BN, PDL=pdl), False, {})
        if TC:
            yield (f"decode_tile/{model}", td._tile_kernel,
                   dict(buf_x_ptr=BF, buf_B_ptr=BF, C_ptr=BF, y_ptr=BF, slots_ptr=I64, pos_ptr=I64, sD_h="i32",
                        sD_p="i32", sC_q="i32", **(dict(state_ptr=BF) if copy else {})),
                   dict(D, R=td.DECODE_ROW_TILE, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN, BLOCK_L=D["L"], PRECISION=prec,
                        TC=TC, PDL=pdl, RT_RANGE=td.TILE_RT_RANGE), fuse, td.TILE_OPTS)
            if hasattr(td, "_step_kernel"):  # the one-launch step (bf16 models)
                yield (f"decode_step/{model}", td._step_kernel,
                       dict(x_ptr=BF, dt_ptr=BF, B_ptr=BF, C_ptr=BF, buf_x_ptr=BF, buf_dt_ptr=BF, buf_B_ptr=BF,
                            y_ptr=BF, slots_ptr=I64, pos_ptr=I64, cnt_ptr="*i32", lo="fp32", hi="fp32", sD_h="i32",
                            sD_p="i32", sx_q="i32", sdt_q="i32", sB_q="i32", sC_q="i32", copy_ptr=BF),
                       dict(D, R=td.DECODE_ROW_TILE, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=BN,
                            BLOCK_NS=td.state_block_n(D["N"]), BLOCK_L=D["L"], PRECISION=prec, TC=TC,
                            HAS_LIMIT=False, PB=triton.cdiv(D["P"], BP), ZB=1024, RT_RANGE=td.STEP_RT_RANGE,
                            COPY=copy, READ_COPY=copy),
                       False, td.STEP_OPTS)
        else:
            yield (f"decode_row/{model}", td._row_kernel,
                   dict(buf_x_ptr=BF, C_ptr=BF, y_ptr=BF, slots_ptr=I64, pos_ptr=I64, sD_h="i32", sD_p="i32",
                        sC_q="i32"),
                   dict(D, HPP=2, RB_P=64, BLOCK_L=D["L"], SB=16), True, {})
        yield (f"decode_update/{model}", td._update_kernel,
               dict(buf_x_ptr=BF, buf_B_ptr=BF, slots_ptr=I64, pos_ptr=I64, seq_ptr=I64, n="i32", copy_ptr=BF),
               dict(D, BLOCK_K=BK, BLOCK_P=BP, BLOCK_N=td.state_block_n(D["N"]), PRECISION=prec, TC=TC, LISTED=pdl,
                    QB=td.COMPLETION_BLOCK, PDL=pdl, COPY=copy), fuse, {})
    if hasattr(tc, "_dt_kernel"):  # the softplus'd dt in a kernel of its own, all heads a program
        yield ("dt", tc._dt_kernel,
               dict(dt_ptr=BF, buf_dt_ptr=BF, chunk_slot_ptr=I64, pre_ptr=I64, length_ptr=I64, row0_ptr=I64,
                    lo="fp32", hi="fp32", sdt="i32"),
               dict(H=D["H"], L=D["L"], ROWS=tc.PACK_ROWS, BLOCK_H=triton.next_power_of_2(D["H"]), HAS_LIMIT=False),
               False, {})
        yield ("pack", tc._pack_kernel,
               dict(x_ptr=BF, B_ptr=BF, buf_x_ptr=BF, buf_B_ptr=BF, xc_ptr=BF, Bc_ptr=BF, chunk_slot_ptr=I64,
                    pre_ptr=I64, length_ptr=I64, row0_ptr=I64, part_ptr=I64, sx="i32", sb="i32"),
               dict(D, ROWS=tc.PACK_ROWS, BLOCK_PF=D["P"], BLOCK_NF=D["N"]), True, {})
    else:
        yield ("pack", tc._pack_kernel,
               dict(x_ptr=BF, dt_ptr=BF, B_ptr=BF, buf_x_ptr=BF, buf_dt_ptr=BF, buf_B_ptr=BF, xc_ptr=BF, Bc_ptr=BF,
                    chunk_slot_ptr=I64, pre_ptr=I64, length_ptr=I64, row0_ptr=I64, part_ptr=I64, lo="fp32",
                    hi="fp32", sx="i32"),
               dict(D, ROWS=tc.PACK_ROWS, BLOCK_PF=D["P"], BLOCK_NF=D["N"], HAS_LIMIT=False), False, {})
    yield ("buffer", tc._buffer_kernel,
           dict(x_ptr=BF, dt_ptr=BF, B_ptr=BF, buf_x_ptr=BF, buf_dt_ptr=BF, buf_B_ptr=BF, slot_ptr=I64, keep_lo_ptr=I64,
                keep_hi_ptr=I64, keep_row0_ptr=I64, clear_hi_ptr=I64, sx="i32", sdt="i32", sb="i32"),
           dict(D, ROWS=tc.PACK_ROWS, BLOCK_PF=D["P"], BLOCK_NF=D["N"]), True, {})
    yield ("decode_zero", td._zero_kernel,
           dict(buf_x_ptr=BF, buf_dt_ptr=BF, buf_B_ptr=BF, slots_ptr=I64, pos_ptr=I64, seq_ptr=I64, n="i32"),
           dict(D, BLOCK_L=D["L"], ZB=1024, LISTED=True, QB=td.COMPLETION_BLOCK, PDL=True), True, {})


def linear_configs():
    """(name, kernel, types, constexprs, fp fusion, options) of every pinned linear GEMM plan at the model
    widths (the plans of decode, mid and prefill row counts), as ``linear_triton`` launches them."""
    import torch

    plans = {}
    for N in (768, 2048, 2560, 3352, 4096, 8512, 10576, 18560, 50280, 256000):
        for M in (1, CFG.linear_decode_max_m, 64, CFG.linear_block_m, CFG.linear_mid_max_m, 8192):
            for dt, tdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                plans[(dt, lt.plan(M, torch.empty(N, 8, dtype=tdt), CFG, sms=132))] = None
    for dt, p in plans:
        tag = f"linear/{dt}/{p.block_m}x{p.block_n}x{p.block_k}/w{p.num_warps}s{p.num_stages}g{p.group_m}"
        c = dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
                 HAS_BIAS=True)
        opts = dict(num_warps=p.num_warps, num_stages=p.num_stages)
        if p.tma:
            yield (f"{tag}/tma/p{int(p.persistent)}e{p.epi_split}", lt._linear_tma_kernel,
                   dict(x_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_k}]>",
                        w_desc=f"tensordesc<{dt}[{p.block_n}, {p.block_k}]>",
                        y_desc=f"tensordesc<{dt}[{p.block_m}, {p.block_n // p.epi_split}]>", b_ptr="*" + dt,
                        M="i32", N="i32", K="i32", NUM_PROGS="i32"),
                   dict(c, EPI_SPLIT=p.epi_split, PERSISTENT=p.persistent), True, opts)
        yield (f"{tag}/ptr", lt._linear_ptr_kernel,
               dict(x_ptr="*" + dt, w_ptr="*" + dt, y_ptr="*" + dt, b_ptr="*" + dt, M="i32", N="i32", K="i32",
                    stride_xm="i32", stride_wn="i32", stride_ym="i32"), c, True, opts)


def conv_launches() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The conv backward's two forms' launches (rows, channels, warps): (tile kernel, walk). Sources
    before the walk was the default launched the tile kernel from the configs, the walk from
    ``WALK_LAUNCH``."""
    pinned = (CFG.conv_bwd_block_t, CFG.conv_bwd_block_c, CFG.conv_bwd_warps)
    if hasattr(ct, "WALK_LAUNCH"):
        return pinned, tuple(ct.WALK_LAUNCH)
    return tuple(ct.TILE_LAUNCH), pinned


def conv_configs():
    """(name, kernel, types, constexprs, fp fusion, options) of the conv1d kernels as their launchers
    launch them: the forward, its window update and decode step (configs' blocks, 4 warps, no fp
    contraction in the outputs' kernels), the backward's tile kernel and walk and the walk's block sums."""
    tile, walk = conv_launches()

    def entry(name, fn, ptrs, consts, fuse, warps):  # the launchers' int arguments (sizes, strides): i32
        types = {n: ptrs.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in inspect.signature(fn.fn).parameters}
        return name, fn, types, consts, fuse, dict(num_warps=warps)

    for dt in ("fp32", "bf16"):
        p = "*" + dt
        fwd = dict(x_ptr=p, cu_ptr=I64, slots_ptr=I64, win_ptr=p, w_ptr=p, b_ptr=p, out_ptr=p)
        bwd = dict(x_ptr=p, cu_ptr=I64, win_ptr=p, w_ptr=p, b_ptr=p, g_ptr=p, dx_ptr=p)
        yield entry(f"conv/window/{dt}", ct._window_kernel, fwd, dict(K=4, BLOCK_Q=4, BLOCK_C=CFG.conv_block_c),
                    True, 4)
        for bias in (False, True):
            tag = f"{dt}/bias{int(bias)}"
            yield entry(f"conv/forward/{tag}", ct._conv_kernel, fwd,
                        dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=DEVICE_SILU, BLOCK_T=CFG.conv_block_t,
                             BLOCK_C=CFG.conv_block_c),
                        False, 4)
            yield entry(f"conv/forward_walk/{tag}", ct._conv_walk_kernel, fwd,
                        dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=DEVICE_SILU, ROWS=CFG.conv_walk_block_t,
                             BLOCK_C=CFG.conv_walk_block_c, AHEAD=ct.WALK_AHEAD),
                        False, CFG.conv_walk_warps)
            yield entry(f"conv/step/{tag}", ct._conv_step_kernel, fwd,
                        dict(K=4, HAS_BIAS=bias, SILU=True, DEVICE_SILU=DEVICE_SILU, BLOCK_Q=4,
                             BLOCK_C=CFG.conv_block_c), False, 4)
            yield entry(f"conv/backward_tile/{tile[0]}x{tile[1]}w{tile[2]}/{tag}", ct._conv_bwd_kernel, bwd,
                        dict(K=4, HAS_BIAS=bias, BLOCK_T=tile[0], BLOCK_C=tile[1]), True, tile[2])
            yield entry(f"conv/backward_walk/{walk[0]}x{walk[1]}w{walk[2]}/{tag}", ct._conv_bwd_walk_kernel, bwd,
                        dict(K=4, HAS_BIAS=bias, ROWS=walk[0], BLOCK_C=walk[1], AHEAD=ct.WALK_AHEAD), True, walk[2])
            yield entry(f"conv/backward_partials/{tag}", ct._partials_kernel, dict(dwo_ptr=p, dbo_ptr=p),
                        dict(K=4, HAS_BIAS=bias, BLOCK_B=16, BLOCK_C=128), True, 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the digests as JSON")
    ap.add_argument("--ptx-dir", help="also write each kernel's normalized PTX here")
    ap.add_argument("--only", default="", help="the kernels whose names start with this (linear/, say)")
    args = ap.parse_args()
    digests = {}
    for name, fn, types, consts, fuse, opts in (*configs(), *linear_configs(), *conv_configs()):
        if not name.startswith(args.only):
            continue
        ptx = compile_ptx(fn, types, consts, fuse, opts)
        digests[name] = hashlib.sha256(ptx.encode()).hexdigest()[:16]
        print(f"{digests[name]}  {name}", flush=True)
        if args.ptx_dir:
            Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
            (Path(args.ptx_dir) / f"{name.replace('/', '_')}.ptx").write_text(ptx)
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "target": "sm_90", "digests": digests},
                                             indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
