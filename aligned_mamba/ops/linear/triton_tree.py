"""The row-parallel GEMM's fixed tree on tensor cores (the triton form of ``linear.sliced``).

The contract (``row_parallel_slices`` S) cuts K into S contiguous equal slices; each slice's GEMM is
summed from zero in fp32, and the S partials are joined by adjacent pairs ((p0 + p1) + (p2 + p3)) + ...
At TP k a rank holds S / k consecutive slices, a subtree. Here one launch computes a rank's subtree:
each program walks its output tile's slices in order, each slice a K loop of ``BLOCK_K`` steps from
zero (the K loop of ``triton.py``), and at each slice's end folds the slice's sum into a stack of
completed left subtrees, one per tree level (the carry of a binary counter: slice j's sum climbs the
levels while j's low bits are ones). After the last slice the tile holds the subtree's sum; at TP 1
(the whole tree) the bias is added in fp32 and the sum rounded once, at TP > 1 it is stored in fp32
for the all-gather and the tree's top levels (``sliced.row_parallel_linear``).

The adds are IEEE fp32 adds of the same values in the same tree whoever computes them, and a row's
slice sums do not depend on the tile (the tensor-core property ``triton.py`` relies on), so TP 1 and
TP k give the same bits on the GPU. S = 1 is not this kernel: it is ``triton.py``'s GEMM, unchanged.

The slice loop and its K loop are fused by the compiler into one software pipeline
(``linear_tree_flatten``), so the loads do not stop at slice boundaries. The stack costs registers:
a tile of BM x BN over T threads keeps log2(S/k) + 1 accumulators of BM * BN / T fp32 each, so the
plan halves the tile (N first) until they fit in ``linear_tree_acc_regs`` registers per thread, or
(``linear_tree_global_stack``) keeps the tile and puts the levels in a per-program fp32 scratch in
global memory; the K block is ``triton.py``'s in every regime.

The split-slices grid (``linear_tree_split_grid_max_m``, opt-in) gives each (tile, slice) its own
program, for small M where one program per tile leaves the GPU idle: program (t, j) sums slice j of
tile t from zero by the same K loop (the same fp32 partial), stores it to an fp32 scratch and counts
itself in on the tile's counter; the last of the tile's programs to arrive, whichever slice it
summed, reads the ``local`` partials back and joins them by the same fold in slice order. Same bits.
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
    """Slice j's sum ``acc`` joins the tree: at level l it is a right child (and is added to s_l, its
    left sibling) while bit l of j is one, and is kept in s_l as a left child at the first zero bit.
    Returns the new stack; after the last slice (every bit one) s0 holds the subtree's sum. ``acc`` is
    only read here (the loop carries the dot's own result, so the tensor-core dots stay asynchronous)."""
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
    """``_fold`` with the stack in global memory: level l of this program's fp32 scratch at ``st`` +
    l LEVEL_STRIDE (``st``: the [BM, BN] pointers of level 0). Returns the node slice j's sum
    completes (the subtree's sum after the last slice); only the levels it climbs are read and only
    the one it stops at is written."""
    t = acc
    reach = j >= 0
    # the layouts of the stores and loads are the compiler's: a barrier makes every thread's earlier
    # stores visible to the whole program whichever thread reads them back
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
                     PRECISION: tl.constexpr, FLATTEN: tl.constexpr, GLOBAL_STACK: tl.constexpr):
    """Through TMA descriptors (x [M, K] blocks [BM, BK], w [N, K] blocks [BN, BK], y [M, N] blocks
    [BM, BN / EPI_SPLIT]), K = LOCAL * STEPS * BLOCK_K; one tile per program or (PERSISTENT) tiles
    p, p + NUM_PROGS, ... One step of the outer loop is one slice of one tile: its K loop from zero,
    the fold, and after a tile's last slice the epilogue. FLATTEN: the compiler makes the two loops
    one software pipeline, so the loads run on across slices and tiles and the dots stay asynchronous
    (the fold and the store wait for them); otherwise each slice's loop refills the pipeline.
    GLOBAL_STACK: the stack's levels in this program's scratch (st_ptr: [programs, LEVELS, BM, BN]
    fp32, L2-resident), so the registers hold one accumulator tile, as today's GEMM (the launcher does
    not flatten this form); else in registers."""
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
        st = (st_ptr + pid.to(tl.int64) * (LEVELS * BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
              + tl.arange(0, BLOCK_N)[None, :])
    # a slice is STEPS whole K blocks (the launcher checks); every stack level is written before it is
    # read within a tile, so the stack needs no reset between tiles
    for u in tl.range(0, units, flatten=FLATTEN):
        j = u % LOCAL
        tile = pid
        if PERSISTENT:
            tile += (u // LOCAL) * NUM_PROGS
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(STEPS):
            a = x_desc.load([om, (j * STEPS + kk) * BLOCK_K])
            b = w_desc.load([on, (j * STEPS + kk) * BLOCK_K])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if GLOBAL_STACK:
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
def _slice_sum(x_ptr, w_ptr, rm, rn, j, M, N, C, STEPS, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Slice j's sum for rows rm [BM] and columns rn [BN] from zero, fp32 [BM, BN]: K columns
    [j C, (j + 1) C) in STEPS masked blocks of BLOCK_K, each a ``tl.dot`` onto the sum (the pointer
    kernels' one K loop)."""
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
    """The same tree through masked pointer loads, one tile per program: slice j is K columns
    [j C, (j + 1) C) in STEPS = cdiv(C, BLOCK_K) blocks, its last block zero past the slice's end."""
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
                       PRECISION: tl.constexpr, JOIN_N: tl.constexpr):
    """The tree on a (tiles, LOCAL) grid: program (t, q) sums slice j = (q + t) mod LOCAL of tile t,
    as ``_tree_ptr_kernel``'s K loop does (slice j: K columns [j C, (j + 1) C) in STEPS masked blocks),
    into part_ptr [tiles, LOCAL, BM, BN] fp32 at [t, j], then adds one to the tile's int32 counter
    (cnt_ptr [tiles], zero at the launch). The program that counts LOCAL - 1 folds the tile's
    partials in slice order (``_fold``), JOIN_N columns at a time (the fold is elementwise: the stack
    costs (LEVELS + 1) BM x JOIN_N tiles, not BM x BN ones), adds the bias, rounds, stores y [M, N],
    and sets the counter back to zero for the next launch. Every partial is read back from the
    scratch, the finisher's own too, so the sum does not depend on which slice finished last."""
    tile = tl.program_id(0)
    # the tile's slices start from a different one per tile: programs run in grid order in the
    # interpreter, so every slice is some tile's last arrival there and the tests see every finisher
    j = (tl.program_id(1) + tile) % LOCAL
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _slice_sum(x_ptr, w_ptr, rm, rn, j, M, N, C, STEPS, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                     PRECISION)
    part = part_ptr + tile.to(tl.int64) * (LOCAL * BLOCK_M * BLOCK_N)
    tl.store(part + j * (BLOCK_M * BLOCK_N) + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
             acc)
    # release: every thread's partial stored (the barrier, CTA scope) before the counter's add
    # publishes them at GPU scope; acquire: the finisher's reads below come after it saw every add
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    if arrived == LOCAL - 1:
        # the add is one thread's: the barrier orders the other threads' reads after its acquire
        tl.debug_barrier()
        for c in tl.static_range(BLOCK_N // JOIN_N):
            cols = c * JOIN_N + tl.arange(0, JOIN_N)
            at = part + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
            s0 = tl.zeros((BLOCK_M, JOIN_N), dtype=tl.float32)
            s1 = s0
            s2 = s0
            s3 = s0
            for i in tl.range(0, LOCAL):
                # .cg: from L2, where the other programs' stores are; read once, not kept in L1
                p = tl.load(at + i * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
                s0, s1, s2, s3 = _fold(p, s0, s1, s2, s3, i, LEVELS, LOCAL)
            on = pid_n * BLOCK_N + c * JOIN_N
            out = _bias_round(s0, b_ptr, on, N, HAS_BIAS, JOIN_N, y_ptr.dtype.element_ty)
            rc = on + tl.arange(0, JOIN_N)
            tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rc[None, :], out,
                     mask=(rm[:, None] < M) & (rc[None, :] < N))
        # every program of this tile has added: nothing reads the counter again in this launch
        tl.store(cnt_ptr + tile, 0)


def tree_plan(M: int, weight: torch.Tensor, local: int, cfg: TritonKernelConfigs, *, sms: int) -> LinearPlan:
    """``triton.plan``'s tile for M rows and this weight [N, K], halved (N first, down to 32 x 64;
    stages raised to keep the shared memory) until the stack of ``local`` slices (log2(local) + 1 fp32
    accumulators per tile) fits in ``cfg.linear_tree_acc_regs`` registers per thread, or (where
    ``global_stack``) the regime's tile with the stack's levels in global memory."""
    p = plan(M, weight, cfg, sms=sms)
    return p if global_stack(p, local, cfg) else _shrink(p, local.bit_length(), cfg.linear_tree_acc_regs)


def global_stack(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> bool:
    """Whether the TMA kernel keeps the stack in global memory at this tile: with
    ``linear_tree_global_stack`` on, where the registers' stack (log2(local) + 1 tiles) would halve
    the tile more than once to fit ``linear_tree_acc_regs`` (on the H200 one halving cost less than
    the scratch's traffic, two halvings more: benchmarks/results/h200_tree_gemm.json)."""
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


def fallback_plan(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> LinearPlan:
    """The pointer kernel's tile where a TMA plan cannot take the operands (a slice that is not whole
    K blocks, unaligned rows): its masked loads hold more registers, so the stack gets half the budget."""
    return _shrink(p, local.bit_length(), cfg.linear_tree_acc_regs // 2)


def split_grid(M: int, local: int, cfg: TritonKernelConfigs) -> bool:
    """Whether M rows take the split-slices grid: ``linear_tree_split_grid_max_m`` on (not 0), M at
    most that, and more than one slice (one slice is today's GEMM)."""
    return local > 1 and 0 < M <= cfg.linear_tree_split_grid_max_m


def join_block_n(p: LinearPlan, local: int, cfg: TritonKernelConfigs) -> int:
    """The columns the split grid's finisher folds at a time: the tile's N block halved (down to 16)
    until the fold's log2(local) + 1 fp32 tiles of BM x that fit ``linear_tree_acc_regs`` registers
    per thread, the budget of the registers' stack."""
    jn = p.block_n
    while local.bit_length() * p.block_m * jn > cfg.linear_tree_acc_regs * 32 * p.num_warps and jn > 16:
        jn //= 2
    return jn


#: per (device, stream): the split grid's int32 tile counters, each buffer larger than the last
_COUNTERS: dict[tuple[torch.device, int | None], list[torch.Tensor]] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 [tiles] zeros on ``device`` for a split-grid launch on the current stream.

    Cached rather than a ``torch.zeros`` per call (a memset launch beside a decode GEMM of ~10 us):
    every launch leaves its counters at zero (the finisher resets them), so the buffer is zero for the
    next launch on the same stream, eager or a CUDA-graph replay. One buffer per stream, as two
    streams' launches may run at once. A buffer is never freed (a larger one is added beside it): a
    captured graph keeps its pointer. Under graph capture without a large enough buffer, a fresh
    ``torch.zeros`` is captured with the launch (its memset replays too) and not cached."""
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
    """ValueError (one line) unless ``local`` (slices one rank sums: S / TP) is a power of two this
    kernel's stack holds."""
    if not (isinstance(local, int) and 1 <= local <= MAX_LOCAL_SLICES and local & (local - 1) == 0):
        raise ValueError(f"row_parallel_slices / tensor-parallel size = {local} refused on the triton backend: "
                         f"its tree GEMM sums a power of two from 1 to {MAX_LOCAL_SLICES} slices per rank")


def linear_tree_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, local: int,
                       out_dtype: torch.dtype, cfg: TritonKernelConfigs, *,
                       tiles: LinearPlan | None = None, split: bool | None = None) -> torch.Tensor:
    """One rank's subtree of the row-parallel GEMM: x [M, K] @ weight [N, K]^T cut into ``local``
    contiguous K slices of K / local columns, each summed from zero in fp32, joined by adjacent pairs
    (+ bias [N] in fp32), rounded once to ``out_dtype`` (x's dtype: the whole tree at TP 1; float32:
    a subtree for the all-gather). x, weight: the model dtype (bf16 or fp32); x's rows may be
    strided. Returns a new contiguous [M, N] tensor on x's device; one launch, no host sync.
    ``tiles`` overrides ``tree_plan`` (the split grid: ``plan``), ``split`` the configs' choice of
    the split-slices grid (``split_grid``; both for benchmarks and tests only)."""
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
        # one accumulator per program, as today's GEMM: the regime's tile, not the stack's
        p = tiles or plan(M, weight, cfg, sms=sms)
        num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        part = torch.empty(num_tiles * local * p.block_m * p.block_n, dtype=torch.float32, device=x.device)
        _tree_split_kernel[(num_tiles, local)](
            x, weight, y, b, part, tile_counters(x.device, num_tiles), M, N, C, triton.cdiv(C, p.block_k),
            x.stride(0), weight.stride(0), N, HAS_BIAS=has_bias, LOCAL=local, LEVELS=local.bit_length() - 1,
            BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
            JOIN_N=join_block_n(p, local, cfg), num_warps=p.num_warps, num_stages=p.num_stages)
        return y
    p = tiles or tree_plan(M, weight, local, cfg, sms=sms)
    common = dict(HAS_BIAS=has_bias, LOCAL=local, LEVELS=local.bit_length() - 1, BLOCK_M=p.block_m,
                  BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m, PRECISION=p.precision,
                  FLATTEN=cfg.linear_tree_flatten, num_warps=p.num_warps, num_stages=p.num_stages)
    num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
    if p.tma and C % p.block_k == 0 and _tma_ok(x, weight, y):
        progs = min(num_tiles, sms * p.programs_per_sm) if p.persistent else num_tiles
        levels = local.bit_length() - 1
        stack = global_stack(p, local, cfg)
        # each program's stack levels: [programs, levels, BM, BN] fp32
        st = torch.empty(progs * levels * p.block_m * p.block_n if stack else 1, dtype=torch.float32,
                         device=x.device)
        xd = TensorDescriptor(x, [M, K], [x.stride(0), 1], [p.block_m, p.block_k])
        wd = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [p.block_n, p.block_k])
        yd = TensorDescriptor(y, [M, N], [N, 1], [p.block_m, p.block_n // p.epi_split])
        # the global stack's fold branches, which the compiler's loop fusion does not take: nested loops
        _tree_tma_kernel[(progs,)](xd, wd, yd, b, st, M, N, C // p.block_k, progs, EPI_SPLIT=p.epi_split,
                                   PERSISTENT=p.persistent, GLOBAL_STACK=stack,
                                   **dict(common, FLATTEN=common["FLATTEN"] and not stack))
    else:
        if p.tma and tiles is None:
            p = fallback_plan(p, local, cfg)
            common.update(BLOCK_M=p.block_m, BLOCK_N=p.block_n, num_stages=p.num_stages)
            num_tiles = triton.cdiv(M, p.block_m) * triton.cdiv(N, p.block_n)
        _tree_ptr_kernel[(num_tiles,)](x, weight, y, b, M, N, C, triton.cdiv(C, p.block_k), x.stride(0),
                                       weight.stride(0), N, **common)
    return y


# -- autograd: forward = the kernel; backward = the plain GEMM's gradients (cuBLAS on a GPU) ---------------


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
        # the slices' tree sums x w^T: its gradients are the plain GEMM's (dx = g w, dw = g^T x)
        gx = g.to(x.dtype)
        return (gx @ w if nx else None, (gx.t() @ x).to(w.dtype) if nw else None,
                g.to(torch.float32).sum(0).to(ctx.bias_dtype) if nb else None, None, None, None)


def linear_tree(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, local: int, out_dtype: torch.dtype, *,
                cfg: TritonKernelConfigs) -> torch.Tensor:
    """The triton backend's ``Ops.linear_tree``: ``linear_tree_triton`` with a cuBLAS backward where a
    gradient is recorded."""
    if grad_needed(x, w, b):
        return _LinearTree.apply(x, w, b, local, out_dtype, cfg)
    return linear_tree_triton(x, w, b, local, out_dtype, cfg)


def linear_partial(x: torch.Tensor, w: torch.Tensor, *, cfg: TritonKernelConfigs) -> torch.Tensor:
    """``Ops.linear_partial``: x [M, k] @ w [N, k]^T -> [M, N] float32 (one slice's sum, not rounded)."""
    return linear_tree(x, w, None, 1, torch.float32, cfg=cfg)


__all__ = ["MAX_LOCAL_SLICES", "check_local", "fallback_plan", "global_stack", "join_block_n", "linear_partial",
           "linear_tree", "linear_tree_triton", "split_grid", "tile_counters", "tree_plan"]
