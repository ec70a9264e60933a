"""Kernel configurations: one typed, frozen set per backend, part of the contract.

No autotuning: every launch reads its contract's configs, so the fingerprint covers exactly what runs;
a value the kernels do not implement is refused with one line. Why: docs/design.md, "How the bits are kept".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("torch", "triton")
#: the most row-parallel slices a rank sums in one tree GEMM (one register tile per tree level)
TRITON_MAX_SLICES = 16


def _pow2(name: str, v: Any, lo: int, hi: int) -> None:
    if type(v) is not int or v < lo or v > hi or v & (v - 1):
        raise ValueError(f"{name} {v!r} refused: expected a power of two from {lo} to {hi}")


def _among(name: str, v: Any, allowed: tuple) -> None:
    if v not in allowed or type(v) is not type(allowed[0]):
        raise ValueError(f"{name} {v!r} refused: the kernels implement {', '.join(map(repr, allowed))}")


@dataclass(frozen=True)
class TorchKernelConfigs:
    """The torch backend (CPU). A row's operations never depend on how many rows share a call.

    row_tile: output rows per tile of the chunked scan (a shorter chunk is one tile); it fixes the decay arithmetic.
    gemm_form: the GEMMs of the linear layers and the scan: "lanes" (each output one fixed chain) or "tiles"
      (rows padded to whole tiles of ``linear_row_tile`` or ``row_tile``, one batched BLAS GEMM per tile shape).
    linear_row_tile: rows per tile of the linear layers' "tiles" form.
    """

    row_tile: int = 16
    gemm_form: str = "lanes"
    linear_row_tile: int = 16

    def __post_init__(self) -> None:
        _pow2("row_tile", self.row_tile, 16, 1024)
        _among("gemm_form", self.gemm_form, ("lanes", "tiles"))
        _pow2("linear_row_tile", self.linear_row_tile, 1, 1024)

    def scan_row_tile(self, chunk_size: int) -> int:
        """The scan's row tile for ``chunk_size``: ``row_tile``, or the whole chunk if shorter."""
        return min(self.row_tile, chunk_size)

    def bf16_state_copy(self, dtype: torch.dtype) -> bool:
        """Whether a replay state keeps a bf16 copy of its boundary state (``SSDState.ssm_state_bf16``): never
        here (the torch forms read the fp32 state)."""
        return False


@dataclass(frozen=True)
class TritonKernelConfigs:
    """The triton backend (GPU): tile shapes and dot precision of every kernel.

    SSD scan (ssd/triton_chunk.py, triton_decode.py):
      row_tile: output rows per prefill program (unused columns add exact zeros: not in a row's bits).
      block_p, block_n, block_k: the scan dots' P, N and K blocks; pass_block_p: the state pass's (parallelism).
      num_warps: the scan kernels'; tile_num_warps: the prefill row-tile kernel's.
      dot_precision: fp32 models' dots, "ieee" (TF32 keeps a 10-bit mantissa: other bits, far from fp32).
      bf16_dots: bf16 models' dots, "round" (an fp32 operand rounded once, as mamba_ssm) or "split2" (two bf16
        terms: the bf16 floor, twice the dot work).
    Linear layers (linear/triton.py; bf16 on tensor cores, fp32 in IEEE fp32; no tile changes a row's bits):
      linear_block_k: the K block of every bf16 regime (one ascending K loop, whatever M).
      linear_decode_max_m, linear_mid_max_m: bf16 calls up to these M take the decode, the mid tile; more the large.
      linear_decode_*, linear_mid_*: those tiles (_block_m, _block_n, _warps, _stages) and launches (_tma: TMA
        descriptors, else pointer loads; _persistent: a grid of _programs_per_sm programs per SM over the tiles).
      linear_decode_narrow_warps, linear_decode_narrow_stages: a decode tile 16 columns wide (out_proj's, as _fill
        narrows it) runs on these: one warp-level MMA column pair per warp, more of the K loop in flight.
      linear_mid_persistent_min_tiles_per_sm: the mid grid is persistent only from this many tiles per SM.
      linear_mid_large_min_tiles_per_sm: mid calls of M >= linear_block_m take the large tile from this many (0: never).
      linear_block_m ... linear_programs_per_sm: the large tile; linear_epi_split: its store in 1 or 2 halves.
      linear_group_m: row tiles per group of the grouped order (x rows shared through L2).
      linear_fill_programs: a regime's N tile is halved (to 16 at least, stages raised) while the grid has fewer tiles.
      linear_fp32_block_m/_block_n/_block_k/_warps/_stages: fp32 models' one tile (TMA if linear_tma).
      linear_tree_*: the tree GEMM (linear/triton_tree.py; the same bits whatever they are, times in
        benchmarks/results/h200_tree_gemm.json). _acc_regs: its tile is halved until log2(slices per rank) + 1 fp32
        accumulator tiles fit in this many registers per thread; _global_stack: where that would quarter a TMA tile,
        the stack lives in fp32 global scratch instead (_global_stack_level0: its level 0 in registers beside the
        accumulator, the tile halved once, levels 1 up in the scratch); _flatten: one software pipeline over the
        slices and their K loops, not one per slice; _split_grid_max_m: calls up to this M (0: none) run a
        program per (tile, slice).
    Norms (norm/triton.py): norm_block_per_warp: a row's (group's) block / this = its warps (1 to 16); one program
      and one reduction per row. norm_bwd_rows: rows per backward program (one weight-gradient partial each);
      norm_bwd_block_per_warp: the gated norm backward's, as above (it takes the forward's rstd: the same bits).
    Conv1d (conv1d/triton.py): conv_walk: the forward walks conv_walk_block_t x conv_walk_block_c blocks,
      conv_walk_warps (widths up to 4); else the tile kernel's conv_block_t x conv_block_c (the same bits);
      conv_block_c is also the window and decode kernels' channel block. conv_bwd_block_t, conv_bwd_block_c,
      conv_bwd_warps: the backward walk (last row to first; one weight-gradient partial per program, summed in order).
    SiLU of the conv's forward and the gated norm's (conv1d/triton.py, norm/triton.py): silu "device" takes the
      GPU's exp and division (``ex2.approx``, ``div.full``: a few instructions, bits of this GPU architecture,
      prefill and decode alike); "ieee" builds them of IEEE operations (``elementwise.silu``: the torch backend's
      bits, about fifty instructions an element).
    Log-softmax (logprobs/triton.py): logprobs_block_v: a row's vocabulary block (its order); logprobs_num_warps;
      logprobs_split_max_m: calls of up to this many rows run a program per row and vocabulary slice, then a join
      (0: a program per row); the same bits either way.
    Scan backward (ssd/triton_backward.py; gradients only): bwd_block_s, bwd_block_t: its row blocks; bwd_warps;
      bwd_bf16_dots: its dots, as bf16_dots (the gradients' precision; "round", mamba_ssm's, by default).
    Attention (attention/triton.py):
      attn_block_n: keys per block, blocks at absolute positions from 0 (a part of every row's bits).
      attn_block_m, attn_warps, attn_stages: the prefill tile (tokens x padded query heads of one KV head), launch.
      attn_decode_block_m, attn_decode_warps, attn_decode_stages: the decode step's (not in a row's bits).
      attn_split_n: keys per split (0: none; a multiple of attn_block_n), a part of the GPU's bits: docs/design.md.
      attn_bwd_kv_block_n, attn_bwd_kv_block_m: keys per dk/dv program, query rows per step of its loop;
      attn_bwd_q_block_m, attn_bwd_q_block_n: the dq program's; attn_bwd_warps, attn_bwd_stages: both launches'.
    MLP (elementwise/triton.py): relu2_block, elements per program of the squared ReLU.
    MoE experts (moe/triton.py; no tile changes a row's bits):
      moe_block_m, moe_block_n, moe_warps, moe_stages: the grouped GEMM's tile (an expert's rows x columns), launch;
        moe_block_k: its K block (equal to linear_block_k: the triton linear's bits). fp32 models take at most
        64 x 128, 4 warps and 3 stages of it (shared memory).
      moe_decode_max_rows: calls of up to this many (token, expert) rows take moe_decode_block_m/_block_n/_warps/
        _stages. moe_wgrad_block_n/_block_k/_block_t, moe_wgrad_warps: the weight gradients' tile and token block.
      moe_router_block_t/_block_n/_warps: the fp32 router GEMM's tile (K block linear_fp32_block_k); calls of
        moe_router_large_rows rows or more (0: none) take moe_router_large_block_t/_block_n/_warps.
      moe_route_block_t, moe_route_warps: the routing kernel's row block; moe_combine_block_d: the combine's columns.
      moe_dispatch_max_rows: up to this many rows the routing kernel builds the dispatch tables; more, torch ops.
    """

    row_tile: int = 64
    block_p: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    tile_num_warps: int = 4
    pass_block_p: int = 64
    dot_precision: str = "ieee"
    bf16_dots: str = "round"
    linear_block_k: int = 64
    linear_decode_max_m: int = 16
    linear_decode_block_m: int = 16
    linear_decode_block_n: int = 64
    linear_decode_warps: int = 4
    linear_decode_stages: int = 6
    linear_decode_tma: bool = False
    linear_decode_persistent: bool = False
    linear_decode_programs_per_sm: int = 1
    linear_decode_narrow_warps: int = 2
    linear_decode_narrow_stages: int = 12
    linear_mid_max_m: int = 256
    linear_mid_block_m: int = 64
    linear_mid_block_n: int = 128
    linear_mid_warps: int = 4
    linear_mid_stages: int = 4
    linear_mid_tma: bool = True
    linear_mid_persistent: bool = True
    linear_mid_programs_per_sm: int = 2
    linear_mid_persistent_min_tiles_per_sm: int = 2
    linear_mid_large_min_tiles_per_sm: int = 2
    linear_block_m: int = 128
    linear_block_n: int = 256
    linear_warps: int = 8
    linear_stages: int = 3
    linear_tma: bool = True
    linear_persistent: bool = True
    linear_programs_per_sm: int = 1
    linear_epi_split: int = 2
    linear_group_m: int = 8
    linear_fill_programs: int = 132
    linear_fp32_block_m: int = 64
    linear_fp32_block_n: int = 64
    linear_fp32_block_k: int = 32
    linear_fp32_warps: int = 8
    linear_fp32_stages: int = 3
    linear_tree_acc_regs: int = 128
    linear_tree_flatten: bool = True
    linear_tree_global_stack: bool = True
    linear_tree_global_stack_level0: bool = False
    linear_tree_split_grid_max_m: int = 16
    norm_block_per_warp: int = 512
    norm_bwd_rows: int = 16
    norm_bwd_block_per_warp: int = 256
    conv_block_t: int = 8
    conv_block_c: int = 256
    conv_walk: bool = True
    silu: str = "device"
    conv_walk_block_t: int = 16
    conv_walk_block_c: int = 128
    conv_walk_warps: int = 1
    conv_bwd_block_t: int = 64
    conv_bwd_block_c: int = 128
    conv_bwd_warps: int = 1
    logprobs_block_v: int = 8192
    logprobs_num_warps: int = 16
    logprobs_split_max_m: int = 64
    bwd_block_s: int = 64
    bwd_block_t: int = 64
    bwd_warps: int = 4
    bwd_bf16_dots: str = "round"
    attn_block_n: int = 64
    attn_block_m: int = 128
    attn_warps: int = 8
    attn_stages: int = 3
    attn_decode_block_m: int = 16
    attn_decode_warps: int = 4
    attn_decode_stages: int = 4
    attn_split_n: int = 1024
    attn_bwd_kv_block_n: int = 64
    attn_bwd_kv_block_m: int = 64
    attn_bwd_q_block_m: int = 64
    attn_bwd_q_block_n: int = 64
    attn_bwd_warps: int = 4
    attn_bwd_stages: int = 2
    relu2_block: int = 2048
    moe_block_m: int = 128
    moe_block_n: int = 256
    moe_block_k: int = 64
    moe_warps: int = 8
    moe_stages: int = 3
    moe_wgrad_block_n: int = 128
    moe_wgrad_block_k: int = 128
    moe_wgrad_block_t: int = 64
    moe_wgrad_warps: int = 8
    moe_combine_block_d: int = 1024
    moe_decode_max_rows: int = 512
    moe_dispatch_max_rows: int = 2048
    moe_decode_block_m: int = 16
    moe_decode_block_n: int = 64
    moe_decode_warps: int = 4
    moe_decode_stages: int = 4
    moe_router_block_t: int = 16
    moe_router_block_n: int = 16
    moe_router_warps: int = 4
    moe_router_large_rows: int = 512
    moe_router_large_block_t: int = 64
    moe_router_large_block_n: int = 64
    moe_router_large_warps: int = 8
    moe_route_block_t: int = 16
    moe_route_warps: int = 4

    def __post_init__(self) -> None:
        _pow2("row_tile", self.row_tile, 16, 1024)
        for name in ("block_p", "block_n", "block_k", "pass_block_p"):
            _pow2(name, getattr(self, name), 16, 256)
        if self.pass_block_p > self.block_p:
            raise ValueError(f"pass_block_p {self.pass_block_p} refused: above block_p {self.block_p} (the state "
                             "pass splits the scan's P blocks)")
        for name in ("num_warps", "tile_num_warps"):
            _among(name, getattr(self, name), (2, 4, 8))
        _among("dot_precision", self.dot_precision, ("ieee",))
        _among("bf16_dots", self.bf16_dots, ("split2", "round"))
        _pow2("linear_block_k", self.linear_block_k, 16, 128)
        _pow2("linear_fp32_block_k", self.linear_fp32_block_k, 16, 128)
        for name in ("decode", "mid", "", "fp32"):
            pre = f"linear_{name}_" if name else "linear_"
            _pow2(pre + "block_m", getattr(self, pre + "block_m"), 16, 256)
            _pow2(pre + "block_n", getattr(self, pre + "block_n"), 16, 256)
            # decode and mid tiles may take fewer warps (warp-level MMA on a 16-row tile); the large tile needs 4 or 8
            _among(pre + "warps", getattr(self, pre + "warps"), (1, 2, 4, 8) if name in ("decode", "mid") else (4, 8))
            _among(pre + "stages", getattr(self, pre + "stages"), tuple(range(1, 17)))
            if name != "fp32":
                _among(pre + "tma", getattr(self, pre + "tma"), (True, False))
                _among(pre + "persistent", getattr(self, pre + "persistent"), (True, False))
                _among(pre + "programs_per_sm", getattr(self, pre + "programs_per_sm"), (1, 2, 3, 4))
                # a value no launch reads is refused: the pointer kernel is one tile per program
                if getattr(self, pre + "persistent") and not getattr(self, pre + "tma"):
                    raise ValueError(f"{pre}persistent refused without {pre}tma: the pointer kernel is not persistent")
                if getattr(self, pre + "programs_per_sm") != 1 and not getattr(self, pre + "persistent"):
                    raise ValueError(f"{pre}programs_per_sm {getattr(self, pre + 'programs_per_sm')} refused without "
                                     f"{pre}persistent: a grid of one program per tile")
        _among("linear_decode_narrow_warps", self.linear_decode_narrow_warps, (1, 2, 4, 8))
        _among("linear_decode_narrow_stages", self.linear_decode_narrow_stages, tuple(range(1, 17)))
        for name in ("linear_decode_max_m", "linear_mid_max_m", "linear_fill_programs",
                     "linear_mid_persistent_min_tiles_per_sm", "linear_mid_large_min_tiles_per_sm"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} {v!r} refused: expected an int >= 0")
        if self.linear_mid_max_m < self.linear_decode_max_m:
            raise ValueError(f"linear_mid_max_m {self.linear_mid_max_m} refused: below linear_decode_max_m "
                             f"{self.linear_decode_max_m}")
        _pow2("linear_group_m", self.linear_group_m, 1, 64)
        _among("linear_tree_acc_regs", self.linear_tree_acc_regs, (64, 96, 128, 160, 192))
        _among("linear_tree_flatten", self.linear_tree_flatten, (True, False))
        _among("linear_tree_global_stack", self.linear_tree_global_stack, (True, False))
        _among("linear_tree_global_stack_level0", self.linear_tree_global_stack_level0, (True, False))
        _among("linear_tree_split_grid_max_m", self.linear_tree_split_grid_max_m, (0, 16, 64, 256))
        _among("linear_epi_split", self.linear_epi_split, (1, 2))
        if self.linear_epi_split != 1 and not self.linear_tma:
            raise ValueError("linear_epi_split 2 refused without linear_tma: the pointer kernel stores whole tiles")
        _pow2("norm_block_per_warp", self.norm_block_per_warp, 32, 8192)
        _pow2("norm_bwd_rows", self.norm_bwd_rows, 1, 256)
        _pow2("norm_bwd_block_per_warp", self.norm_bwd_block_per_warp, 32, 8192)
        _pow2("conv_block_t", self.conv_block_t, 1, 256)
        _pow2("conv_block_c", self.conv_block_c, 16, 1024)
        _pow2("conv_walk_block_t", self.conv_walk_block_t, 1, 1024)
        _pow2("conv_walk_block_c", self.conv_walk_block_c, 16, 1024)
        _among("conv_walk", self.conv_walk, (True, False))
        _among("silu", self.silu, ("ieee", "device"))
        _among("conv_walk_warps", self.conv_walk_warps, (1, 2, 4, 8))
        _pow2("conv_bwd_block_t", self.conv_bwd_block_t, 1, 256)
        _pow2("conv_bwd_block_c", self.conv_bwd_block_c, 16, 1024)
        _among("conv_bwd_warps", self.conv_bwd_warps, (1, 2, 4, 8))
        _pow2("logprobs_block_v", self.logprobs_block_v, 128, 16384)
        _among("logprobs_num_warps", self.logprobs_num_warps, (1, 2, 4, 8, 16))
        _among("logprobs_split_max_m", self.logprobs_split_max_m, (0, 16, 64, 256, 1024, 4096))
        _pow2("bwd_block_s", self.bwd_block_s, 16, 256)
        _pow2("bwd_block_t", self.bwd_block_t, 16, 256)
        _among("bwd_warps", self.bwd_warps, (2, 4, 8, 16))
        _among("bwd_bf16_dots", self.bwd_bf16_dots, ("split2", "round"))
        _pow2("attn_block_n", self.attn_block_n, 16, 256)
        _pow2("attn_block_m", self.attn_block_m, 16, 256)
        _pow2("attn_decode_block_m", self.attn_decode_block_m, 16, 256)
        if (not isinstance(self.attn_split_n, int) or isinstance(self.attn_split_n, bool) or self.attn_split_n < 0
                or self.attn_split_n % self.attn_block_n):
            raise ValueError(f"attn_split_n {self.attn_split_n!r} refused: 0 (no split) or a positive multiple of "
                             f"attn_block_n {self.attn_block_n} expected")
        for name in ("attn_warps", "attn_decode_warps"):
            _among(name, getattr(self, name), (1, 2, 4, 8))
        for name in ("attn_stages", "attn_decode_stages", "attn_bwd_stages"):
            _among(name, getattr(self, name), (1, 2, 3, 4, 5))
        for name in ("attn_bwd_kv_block_n", "attn_bwd_kv_block_m", "attn_bwd_q_block_m", "attn_bwd_q_block_n"):
            _pow2(name, getattr(self, name), 16, 256)
        _among("attn_bwd_warps", self.attn_bwd_warps, (1, 2, 4, 8))
        if self.attn_bwd_kv_block_m < 64 and self.attn_bwd_stages > 1:
            # a hardware trap: dK off by up to 13% of its largest element, changing run to run
            raise ValueError(f"attn_bwd_kv_block_m {self.attn_bwd_kv_block_m} with attn_bwd_stages "
                             f"{self.attn_bwd_stages} refused: pipelined dK/dV steps of fewer than 64 query rows "
                             "gave wrong dK on the H200 (use 64 rows or 1 stage)")
        _pow2("relu2_block", self.relu2_block, 128, 16384)
        for name in ("moe_block_m", "moe_block_n", "moe_block_k", "moe_wgrad_block_n", "moe_wgrad_block_k",
                     "moe_wgrad_block_t"):
            _pow2(name, getattr(self, name), 16, 256)
        for name in ("moe_decode_block_m", "moe_decode_block_n", "moe_router_block_t", "moe_router_block_n",
                     "moe_route_block_t", "moe_router_large_block_t", "moe_router_large_block_n"):
            _pow2(name, getattr(self, name), 16, 256)
        for name in ("moe_warps", "moe_wgrad_warps", "moe_decode_warps"):
            _among(name, getattr(self, name), (4, 8))
        for name in ("moe_router_warps", "moe_route_warps", "moe_router_large_warps"):
            _among(name, getattr(self, name), (1, 2, 4, 8))
        for name in ("moe_stages", "moe_decode_stages"):
            _among(name, getattr(self, name), (1, 2, 3, 4, 5, 6))
        if self.moe_router_large_rows < 0:
            raise ValueError(f"moe_router_large_rows {self.moe_router_large_rows} refused: 0 (never) or more")
        if not 0 <= self.moe_decode_max_rows <= 4096:
            raise ValueError(f"moe_decode_max_rows {self.moe_decode_max_rows} refused: 0 to 4096 (one program "
                             "routes and dispatches them all)")
        if not 0 <= self.moe_dispatch_max_rows <= 16384:
            raise ValueError(f"moe_dispatch_max_rows {self.moe_dispatch_max_rows} refused: 0 to 16384 (one "
                             "program writes all their tables)")
        _pow2("moe_combine_block_d", self.moe_combine_block_d, 128, 8192)

    def scan_row_tile(self, chunk_size: int) -> int:
        """The prefill's row tile for ``chunk_size``: ``row_tile``, or the whole chunk if shorter."""
        return min(self.row_tile, chunk_size)

    def bf16_state_copy(self, dtype: torch.dtype) -> bool:
        """Whether a replay state keeps a bf16 copy of its boundary state (``SSDState.ssm_state_bf16``): where the
        decode's dots round that state to bf16 anyway (``bf16_dots`` "round" on a bf16 model), so reading the copy
        gives the same bits from half the bytes (the copy: half the fp32 state's memory again)."""
        return dtype == torch.bfloat16 and self.bf16_dots == "round"

    @property
    def device_silu(self) -> bool:
        """The SiLU launches' constexpr: True where ``silu`` is "device" (``triton_math.silu_of``)."""
        return self.silu == "device"


KernelConfigs = TorchKernelConfigs | TritonKernelConfigs
CONFIG_TYPES: dict[str, type] = {"torch": TorchKernelConfigs, "triton": TritonKernelConfigs}


def kernel_configs(backend: str, values: Mapping[str, Any] | KernelConfigs | None = None) -> KernelConfigs:
    """The configs of ``backend``: the pinned defaults with ``values`` (field names, or a configs object)
    in their place. ValueError (one line) for an unknown backend or field, or a value no kernel implements."""
    if backend not in CONFIG_TYPES:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    cls = CONFIG_TYPES[backend]
    if values is None:
        return cls()
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping) or not all(isinstance(k, str) for k in values):
        raise ValueError(f"kernel configs {values!r} refused: expected a mapping of {backend} config names")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"kernel configs {', '.join(unknown)} refused: the {backend} backend's are {', '.join(names)}")
    return cls(**values)


def pinned_configs(backend: str) -> dict[str, Any]:
    """The pinned kernel configs of ``backend`` as a plain dict."""
    return dataclasses.asdict(kernel_configs(backend))
