"""The row-parallel GEMM's fixed tree on tensor cores (the triton form of ``linear.sliced``).

One launch computes a rank's subtree: a program walks its tile's ``local`` K slices in order, each a
K loop from zero (``triton.py``'s), and folds each slice's fp32 sum into a stack of left subtrees, one
per level (``_fold``); then bias and one rounding (TP 1) or an fp32 store for the all-gather. The adds
are the same IEEE adds in the same tree whoever computes them, so TP 1 and TP k give the same bits.
The stack lives in registers (the tile shrunk to fit), in global scratch (``linear_tree_global_stack``;
with ``_level0``, level 0 in registers and the tile halved once), or, on the split-slices grid, a
program per (tile, slice) whose last arrival folds. Why: docs/design.md, "How the bits are kept"
(Tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..autograd import grad_needed
from ..configs import TRITON_MAX_SLICES, TritonKernelConfigs
from .triton import LinearPlan, _bias_round, _num_sms, _tile_coords, _tma_ok, plan

#: the most slices one rank sums in one launch (the stack's levels are named registers)
MAX_LOCAL_SLICES = TRITON_MAX_SLICES


@triton.jit
def _fold(acc, s0, s1, s2, s3, j, LEVELS: tl.constexpr, LOCAL: tl.constexpr):
    """Slice j's sum joins the tree as a binary counter's carry: added to s_l while bit l of j is one,
    kept in s_l at the first zero bit; after the last slice s0 holds the subtree's sum. ``acc`` is only
    read (the dots stay asynchronous)."""
    t = acc
    reach = j >= 0  # whether the node built so far climbs to this level
    if LEVELS > 0:
        right = (j & 1) == 1
        s0n = tl.where(reach & ~right, t, s0)
        t = tl.where(reach & right, s0 + t, t)
        reach = reach & right
        s0 = s0n
    if LEVELS > 1:
        right = ((j >> 1) & 1) == 1
        s1n = tl.where(reach & ~right, t, s1)
        t = tl.where(reach & right, s1 + t, t)
        reach = reach & right
        s1 = s1n
    if LEVELS > 2:
        right = ((j >> 2) & 1) == 1
        s2n = tl.where(reach & ~right, t, s2)
        t = tl.where(reach & right, s2 + t, t)
        reach = reach & right
        s2 = s2n
    if LEVELS > 3:
        right = ((j >> 3) & 1) == 1
        s3n = tl.where(reach & ~right, t, s3)
        t = tl.where(reach & right, s3 + t, t)
        s3 = s3n
    s0 = tl.where(j == LOCAL - 1, t, s0)
    return s0, s1, s2, s3


@triton.jit
def _fold_global(acc, st, j, LEVELS: tl.constexpr, LEVEL_STRIDE: tl.constexpr):
    """``_fold`` with level l at ``st`` + l LEVEL_STRIDE in global scratch; returns the node slice j
    completes (the subtree's sum after the last slice)."""
    t = acc
    reach = j >= 0
    # another thread may read back what this one stored: the barrier makes the stores visible
    tl.debug_barrier()
    for lv in tl.static_range(LEVELS):
        right = ((j >> lv) & 1) == 1
        if reach:
            if right:
                t = tl.load(st + lv * LEVEL_STRIDE) + t
            else:
                tl.store(st + lv * LEVEL_STRIDE, t)
        reach = reach & right
    return t


@triton.jit(do_not_specialize=["M"])
def _tree_tma_kernel(x_desc, w_desc, y_desc, b_ptr, st_ptr, M, N, STEPS, NUM_PROGS, HAS_BIAS: tl.constexpr,
                     LOCAL: tl.constexpr, LEVELS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EPI_SPLIT: tl.constexpr, PERSISTENT: tl.constexpr,
                     PRECISION: tl.constexpr, FLATTEN: tl.constexpr, GLOBAL_STACK: tl.constexpr,
                     LEVEL0_REGS: tl.constexpr = False):
    """Through TMA descriptors, K = LOCAL * STEPS * BLOCK_K; one tile per program or (PERSISTENT) tiles
    p, p + NUM_PROGS, ... An outer step is one slice of one tile: its K loop, the fold, the epilogue
    after the last slice. FLATTEN: one software pipeline across slices and tiles. GLOBAL_STACK: the
    levels in st_ptr [programs, LEVELS, BM, BN] fp32 (LEVEL0_REGS: level 0 in registers, levels 1 up
    in st_ptr [programs, LEVELS - 1, BM, BN]), else in registers."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    if PERSISTENT:
        units = tl.cdiv(num_pid_m * num_pid_n - pid, NUM_PROGS) * LOCAL
    else:
        units = LOCAL
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    if GLOBAL_STACK:
        st = (st_ptr + pid.to(tl.int64) * ((LEVELS - LEVEL0_REGS) * BLOCK_M * BLOCK_N)
              + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    # every level is written before it is read within a tile: no reset between tiles
    for u in tl.range(0, units, flatten=FLATTEN):
        j = u % LOCAL
        tile = pid
        if PERSISTENT:
            tile += (u // LOCAL) * NUM_PROGS
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = _slice_sum_tma(x_desc, w_desc, om, on, j, STEPS, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if GLOBAL_STACK and LEVEL0_REGS:
            # level 0 as _fold's: a left slice kept, a right one added to it; the pair climbs on in st
            right = (j & 1) == 1
            node = tl.where(right, s0 + acc, acc)
            s0 = tl.where(right, s0, acc)
            if right:
                node = _fold_global(node, st, j >> 1, LEVELS - 1, BLOCK_M * BLOCK_N)
        elif GLOBAL_STACK:
            node = _fold_global(acc, st, j, LEVELS, BLOCK_M * BLOCK_N)
        else:
            s0, s1, s2, s3 = _fold(acc, s0, s1, s2, s3, j, LEVELS, LOCAL)
            node = s0
        if j == LOCAL - 1:
            c = _bias_round(node, b_ptr, on, N, HAS_BIAS, BLOCK_N, y_desc.dtype)
            if EPI_SPLIT == 2:
                c0, c1 = c.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1).split()
                y_desc.store([om, on], c0)
                y_desc.store([om, on + BLOCK_N // 2], c1)
            else:
                y_desc.store([om, on], c)


@triton.jit
def _slice_sum_tma(x_desc, w_desc, om, on, j, STEPS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Slice j's fp32 sum [BM, BN] from zero for the tile at rows om, columns on: K blocks j STEPS .. (j + 1)
    STEPS - 1 through TMA descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(STEPS):
        a = x_desc.load([om, (j * STEPS + kk) * BLOCK_K])
        b = w_desc.load([on, (j * STEPS + kk) * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _slice_sum(x_ptr, w_ptr, rm, rn, j, M, N, C, STEPS, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Slice j's fp32 sum [BM, BN] from zero: K columns [j C, (j + 1) C) in STEPS masked blocks."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(STEPS):
        ck = kk * BLOCK_K + tl.arange(0, BLOCK_K)  # columns inside slice j
        rk = j * C + ck
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (ck[None, :] < C), other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None],
                    mask=(rn[None, :] < N) & (ck[:, None] < C), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _tree_ptr_kernel(x_ptr, w_ptr, y_ptr, b_ptr, M, N, C, STEPS, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, LOCAL: tl.constexpr, LEVELS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                     FLATTEN: tl.constexpr):
    """The same tree through masked pointer loads, one tile per program (slices of C columns)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1 = s0
    s2 = s0
    s3 = s0
    for j in tl.range(0, LOCAL, flatten=FLATTEN):
        acc = _slice_sum(x_ptr, w_ptr, rm, rn, j, M, N, C, STEPS, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                         PRECISION)
        s0, s1, s2, s3 = _fold(acc, s0, s1, s2, s3, j, LEVELS, LOCAL)
    c = _bias_round(s0, b_ptr, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], c, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _tree_split_kernel(x_ptr, w_ptr, y_ptr, b_ptr, part_ptr, cnt_ptr, M, N, C, STEPS, stride_xm, stride_wn,
                       stride_ym, HAS_BIAS: tl.constexpr, LOCAL: tl.constexpr, LEVELS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PRECISION: tl.constexpr, JOIN_N: tl.constexpr, TMA: tl.constexpr):
    """The tree on a grid of tiles x LOCAL programs, a tile's slices adjacent in launch order (so its
    partials are joined while they sit in L2): program t LOCAL + q stores slice (q + t) mod LOCAL's sum into part_ptr
    [tiles, LOCAL, BM, BN] fp32 and counts itself in on cnt_ptr[t]; the last arrival folds the tile's
    partials in slice order, JOIN_N columns at a time, stores y and resets the counter. Every partial is
    read back from the scratch, so the sum does not depend on which program came last. TMA: x_ptr and
    w_ptr are descriptors (C a multiple of BLOCK_K), else masked pointer loads."""
    tile = tl.program_id(0) // LOCAL
    # rotated per tile so that, in the interpreter's grid order, the tests see every slice finish
    j = (tl.program_id(0) + tile) % LOCAL
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if TMA:
        acc = _slice_sum_tma(x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, j, STEPS, BLOCK_M, BLOCK_N, BLOCK_K,
                             PRECISION)
    else:
        acc = _slice_sum(x_ptr, w_ptr, rm, rn, j, M, N, C, STEPS, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                         PRECISION)
    part = part_ptr + tile.to(tl.int64) * (LOCAL * BLOCK_M * BLOCK_N)
    tl.store(part + j * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
             acc)
    # release/acquire: all threads' partials stored before the add; the finisher reads after every add
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if arrived == LOCAL - 1:
        # the add is one thread's: the barrier orders the others' reads after its acquire
        tl.debug_barrier()
        for c in tl.static_range(BLOCK_N // JOIN_N):
            cols = c * JOIN_N + tl.arange(0, JOIN_N)
            at = part + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
            s0 = tl.zeros((BLOCK_M, JOIN_N), dtype=tl.float32)
            s1 = s0
            s2 = s0
            s3 = s0
            for i in tl.range(0, LOCAL):
                # .cg: from L2, where the other programs' stores are
                p = tl.load(at + i * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
                s0, s1, s2, s3 = _fold(p, s0, s1, s2, s3, i, LEVELS, LOCAL)
            on = pid_n * BLOCK_N + c * JOIN_N
            out = _bias_round(s0, b_ptr, on, N, HAS_BIAS, JOIN_N, y_ptr.dtype.element_ty)
            rc = on + tl.arange(0, JOIN_N)
            tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rc[None, :], out,
                     mask=(rm[:, None] < M) & (rc[None, :] < N))
        tl.store(cnt_ptr + tile, 0)


def tree_plan(M: int, weight: torch.Tensor, local: int, cfg: TritonKernelConfigs, *, sms: int) -> LinearPlan:
    """``triton.plan``'s tile, halved until the register stack (log2(local) + 1 fp32 tiles) fits
    ``linear_tree_acc_regs`` per thread; where ``global_stack``, unhalved (or, with
    ``linear_tree_global_stack_level0``, halved until two tiles fit)."""
    p = plan(M, weight, cfg, sms=sms)
    if not global_stack(p, local, cfg):
        return _shrink(p, local.bit_length(), cfg.linear_tree_acc_regs)
    return _shrink(p, 2, cfg.linear_tree_acc_regs) if cfg.linear_tree_global_stack_level0 else p


def global_stack(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> bool:
    """Whether the TMA kernel keeps the stack in global memory: ``linear_tree_global_stack`` on and the
    register stack would halve the tile more than once (benchmarks/results/h200_tree_gemm.json)."""
    if not (cfg.linear_tree_global_stack and p.tma and local > 1):
        return False
    r = _shrink(p, local.bit_length(), cfg.linear_tree_acc_regs)
    return 4 * r.block_m * r.block_n <= p.block_m * p.block_n


@functools.lru_cache(maxsize=1024)
def _shrink(p: LinearPlan, accs: int, regs: int) -> LinearPlan:
    bm, bn, stages = p.block_m, p.block_n, p.num_stages
    threads = 32 * p.num_warps
    while accs * bm * bn > regs * threads and (bn > 32 or bm > 64):
        if bn > 32 and bn >= bm // 2:
            stages = min(8, stages * (bm + bn) // (bm + bn // 2))
            bn //= 2
        else:
            stages = min(8, stages * (bm + bn) // (bm // 2 + bn))
            bm //= 2
    if (bm, bn) == (p.block_m, p.block_n):
        return p
    return dataclasses.replace(p, block_m=bm, block_n=bn, num_stages=stages,
                               epi_split=p.epi_split if bn >= 32 else 1)


def stack_form(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> tuple[bool, bool]:
    """(GLOBAL_STACK, LEVEL0_REGS) for the TMA kernel at ``p`` (``tree_plan``'s tile): the whole stack in
    global memory at the regime's tile; level 0 in registers where ``linear_tree_global_stack_level0``
    halved the tile for two accumulators but the register stack would not fit it; else registers."""
    budget = cfg.linear_tree_acc_regs * 32 * p.num_warps
    tile = p.block_m * p.block_n
    if (cfg.linear_tree_global_stack and cfg.linear_tree_global_stack_level0 and p.tma and local > 2
            and 2 * tile <= budget < local.bit_length() * tile):
        return True, True
    return global_stack(p, local, cfg), False


def fallback_plan(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> LinearPlan:
    """The pointer kernel's tile where TMA cannot take the operands: half the register budget (its
    masked loads hold more)."""
    return _shrink(p, local.bit_length(), cfg.linear_tree_acc_regs // 2)


def split_grid(M: int, local: int, cfg: TritonKernelConfigs) -> bool:
    """Whether M rows take the split-slices grid (``linear_tree_split_grid_max_m``, more than one slice)."""
    return local > 1 and 0 < M <= cfg.linear_tree_split_grid_max_m


def join_block_n(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> int:
    """The columns the split grid's finisher folds at a time: N block halved until its stack fits
    ``linear_tree_acc_regs``."""
    jn = p.block_n
    while local.bit_length() * p.block_m * jn > cfg.linear_tree_acc_regs * 32 * p.num_warps and jn > 16:
        jn //= 2
    return jn


#: per (device, stream): the split grid's int32 tile counters, each buffer larger than the last
_COUNTERS: dict[tuple[torch.device, int | None], list[torch.Tensor]] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 [tiles] zeros for a split-grid launch on the current stream, cached (no memset launch):
    each launch leaves its counters at zero. One buffer per stream; never freed, since a captured
    graph keeps its pointer; under capture without one large enough, a fresh ``torch.zeros``."""
    cuda = device.type == "cuda"
    key = (device, torch.cuda.current_stream(device).cuda_stream if cuda else None)
    bufs = _COUNTERS.setdefault(key, [])
    if bufs and bufs[-1].numel() >= tiles:
        return bufs[-1][:tiles]
    if cuda and torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(tiles, 2 * bufs[-1].numel() if bufs else 1024), dtype=torch.int32, device=device))
    return bufs[-1][:tiles]


def check_local(local: int) -> None:
    """ValueError unless ``local`` (S / TP) is a power of two the stack holds."""
    if not (isinstance(local, int) and 1 <= local <= MAX_LOCAL_SLICES and local & (local - 1) == 0):
        raise ValueError(f"row_parallel_slices / tensor-parallel size = {local} refused on the triton backend: "
                         f"its tree GEMM sums a power of two from 1 to {MAX_LOCAL_SLICES} slices per rank")


def linear_tree_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, local: int,
                       out_dtype: torch.dtype, cfg: TritonKernelConfigs, *,
                       tiles: LinearPlan | None = None, split: bool | None = None,
                       stack: tuple[bool, bool] | None = None) -> torch.Tensor:
    """One rank's subtree: x [M, K] @ weight [N, K]^T in ``local`` K slices, each fp32 from zero,
    joined by adjacent pairs (+ bias [N] in fp32), rounded once to ``out_dtype`` (x's dtype, or fp32
    for the all-gather) -> new [M, N]; x, weight bf16 or fp32; one launch, no host sync. ``tiles``,
    ``split``, ``stack``: override the plan, ``split_grid`` and ``stack_form`` (benchmarks, tests)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_tree_triton: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"linear_tree_triton: x {x.dtype} and weight {weight.dtype} must both be bfloat16 or float32")
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"linear_tree_triton: out_dtype {out_dtype} must be x's dtype or float32")
    check_local(local)
    M, K = x.shape
    N = weight.shape[0]
    if K % local:
        raise ValueError(f"linear_tree_triton: K {K} is not a multiple of {local} slices")
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.to(torch.float32).expand(M, N))
    C = K // local
    sms = _num_sms(x.device)
    has_bias = bias is not None
    b = bias.contiguous() if has_bias else y
    use_split = split_grid(M, local, cfg) if split is None else split and local > 1
    if use_split:
        # one accumulator per program: the regime's tile, not the stack's
        p = tiles or plan(M, weight, cfg, sms=sms)
        num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        part = torch.empty(num_tiles * local * p.block_m * p.block_n, dtype=torch.float32, device=x.device)
        tma = p.tma and C % p.block_k == 0 and _tma_ok(x, weight)
        xa = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k]) if tma else x
        wa = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [p.block_n, p.block_k]) if tma else weight
        _tree_split_kernel[(num_tiles * local,)](
            xa, wa, y, b, part, tile_counters(x.device, num_tiles), M, N, C, triton.cdiv(C, p.block_k),
            x.stride(0), weight.stride(0), N, HAS_BIAS=has_bias, LOCAL=local, LEVELS=local.bit_length() - 1,
            BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
            JOIN_N=join_block_n(p, local, cfg), TMA=tma, num_warps=p.num_warps, num_stages=p.num_stages)
        return y
    p = tiles or tree_plan(M, weight, local, cfg, sms=sms)
    common = dict(HAS_BIAS=has_bias, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m,
                  BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
                  FLATTEN=cfg.linear_tree_flatten, num_warps=p.num_warps, num_stages=p.num_stages)
    num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
    if p.tma and C % p.block_k == 0 and _tma_ok(x, weight, y):
        progs = min(num_tiles, sms * p.programs_per_sm) if p.persistent else num_tiles
        glob, level0 = stack or stack_form(p, local, cfg)
        levels = local.bit_length() - 1 - level0
        st = torch.empty(progs * levels * p.block_m * p.block_n if glob else 1, dtype=torch.float32,
                         device=x.device)
        xd = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k])
        wd = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [p.block_n, p.block_k])
        yd = TensorDescriptor(y, [M, N], [N, 1], [p.block_m, p.block_n // p.epi_split])
        # not flattened with the global stack: its fold branches, which the compiler's loop fusion refuses
        _tree_tma_kernel[(progs,)](xd, wd, yd, b, st, M, N, C // p.block_k, progs, EPI_SPLIT=p.epi_split,
                                   PERSISTENT=p.persistent, GLOBAL_STACK=glob, LEVEL0_REGS=level0,
                                   **dict(common, FLATTEN=common["FLATTEN"] and not glob))
    else:
        if p.tma and tiles is None:
            p = fallback_plan(p, local, cfg)
            common.update(BLOCK_M=p.block_m, BLOCK_N=p.block_n, num_stages=p.num_stages)
            num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        _tree_ptr_kernel[(num_tiles,)](x, weight, y, b, M, N, C, triton.cdiv(C, p.block_k), x.stride(0),
                                       weight.stride(0), N, **common)
    return y


# -- autograd: the kernel's forward; the plain GEMM's gradients (cuBLAS) ----------------------------------


class _LinearTree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, local: int, out_dtype: torch.dtype,
                cfg: TritonKernelConfigs) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.bias_dtype = None if b is None else b.dtype
        return linear_tree_triton(x, w, b, local, out_dtype, cfg)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        gx = g.to(x.dtype)
        return (gx @ w if nx else None, (gx.t() @ x).to(w.dtype) if nw else None,
                g.to(torch.float32).sum(0).to(ctx.bias_dtype) if nb else None, None, None, None)


def linear_tree(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, local: int, out_dtype: torch.dtype, *,
                cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's ``Ops.linear_tree``: ``linear_tree_triton``, a cuBLAS backward under autograd."""
    if grad_needed(x, w, b):
        return _LinearTree.apply(x, w, b, local, out_dtype, cfg)
    return linear_tree_triton(x, w, b, local, out_dtype, cfg)


def linear_partial(x: torch.Tensor, w: torch.Tensor, *, cfg: TritonKernelConfigs) -> torch.Tensor:
    """``Ops.linear_partial``: x [M, k] @ w [N, k]^T -> [M, N] float32 (one slice's sum, not rounded)."""
    return linear_tree(x, w, None, 1, torch.float32, cfg=cfg)


__all__ = ["MAX_LOCAL_SLICES", "check_local", "fallback_plan", "global_stack", "join_block_n", "linear_partial",
           "linear_tree", "linear_tree_triton", "split_grid", "tile_counters", "tree_plan"]
