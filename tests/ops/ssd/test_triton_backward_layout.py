"""The scan backward's launch layout (``ops/ssd/triton_backward.py``): what may change with it and what may not.

CPU (the Triton interpreter, fp32, tiny shapes): programs that loop over several heads of a group
(``BWD_HEADS_PER_PROGRAM``, ``BWD_ROWS_HEADS_PER_PROGRAM``) give every per-head gradient (dx, ddt, dA,
dD, dh0) bit for bit, and dB and dC (now summed over the program's heads in the kernel) within fp32
rounding of the per-head sums, deterministically; other chunk-state blocks (``STATE_OPTS``) likewise.
The two-axis grid against the flat default (``BWD_FLAT_GRID``) moves no bit (also on the GPU).

GPU (compiled, bf16 tensor-core dots): sequences of whole chunks read x and dy and write dx where
they lie (strided views of the packed rows, dx rounded to bf16 in the kernel; x also as a column
slice of a wider tensor, as the layer passes it, with the bits of a contiguous x); that gives the bits
the general packing (fp32 chunk grids, dx rounded by torch) gives, but for dD's summation order
(within fp32 rounding), and two backwards are equal.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.ssd import triton_backward as ta  # noqa: E402
from aligned_mamba.ops.ssd.chunk import chunk_grid  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
DEV = torch.device("cuda" if CUDA else "cpu")
ARGS = ("x", "dt", "B", "C", "A", "D", "dt_bias", "h0")
PER_HEAD = ("x", "dt", "A", "D", "dt_bias", "h0")


@pytest.fixture(autouse=True)
def _keep_compiled_mode(monkeypatch):
    """Another module sets TRITON_INTERPRET=1 when collected; the GPU test compiles."""
    if not INTERPRET:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _leaves(seed: int, lens: list[int], H: int, P: int, G: int, N: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)
    t = dict(x=torch.randn(T, H, P, generator=g).to(dtype), dt=(torch.rand(T, H, generator=g) * 3 - 2).to(dtype),
             B=torch.randn(T, G, N, generator=g).to(dtype), C=torch.randn(T, G, N, generator=g).to(dtype),
             A=-torch.exp(torch.rand(H, generator=g) * 2.7), D=torch.randn(H, generator=g),
             dt_bias=torch.randn(H, generator=g) * 0.5, h0=torch.randn(S, H, P, N, generator=g) * 0.3)
    return {k: v.to(DEV) for k, v in t.items()}


def _backward(lv: dict, gy: torch.Tensor, lens: list[int], chunk: int, cfg: TritonKernelConfigs, bufs=(None,) * 3):
    S = len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    off = torch.zeros(S, dtype=torch.int64)
    grid = chunk_grid(cu, off, chunk, DEV)
    return ta.ssd_backward(*(lv[k] for k in ARGS), *bufs, gy, (True,) * 8, cu, off.to(DEV), grid, None, chunk,
                           (0.0, math.inf), cfg)


def _rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u.double() - v.double()).norm() / v.double().norm())


@pytest.mark.interpreter
@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 form; the GPU test below covers the compiled one")
def test_heads_per_program_and_state_blocks_keep_the_gradient(monkeypatch):
    H, P, G, N, chunk, lens = 4, 16, 1, 16, 32, [64, 32]
    cfg = TritonKernelConfigs(bwd_block_s=16, bwd_block_t=16)
    lv = _leaves(3, lens, H, P, G, N, torch.float32)
    gy = torch.randn(sum(lens), H, P, generator=torch.Generator().manual_seed(4)).to(DEV)
    monkeypatch.setattr(ta, "BWD_HEADS_PER_PROGRAM", 1)  # per-head partials, summed by torch
    monkeypatch.setattr(ta, "BWD_ROWS_HEADS_PER_PROGRAM", 1)
    base = dict(zip(ARGS, _backward(lv, gy, lens, chunk, cfg)))
    pinned = dict(ta.STATE_OPTS)
    for hpp, rpp, state in ((2, 4, {"BLOCK_K": 16, "BLOCK_P": 16, "BLOCK_N": 16}), (4, 2, dict(ta.STATE_OPTS)),
                            (3, 3, pinned)):
        monkeypatch.setattr(ta, "BWD_HEADS_PER_PROGRAM", hpp)
        monkeypatch.setattr(ta, "BWD_ROWS_HEADS_PER_PROGRAM", rpp)
        monkeypatch.setattr(ta, "STATE_OPTS", state)
        got = dict(zip(ARGS, _backward(lv, gy, lens, chunk, cfg)))
        again = dict(zip(ARGS, _backward(lv, gy, lens, chunk, cfg)))
        assert all(torch.equal(got[k], again[k]) for k in ARGS), "two backwards gave different bits"
        if state == pinned:  # the same chunk states: per-head gradients are the same operations
            assert all(torch.equal(got[k], base[k]) for k in PER_HEAD), hpp
        errs = {k: _rel(got[k], base[k]) for k in ARGS}
        assert all(e < 1e-5 for e in errs.values()), (hpp, errs)
    # what the checks would see if the kernels summed a head twice or left one out
    monkeypatch.setattr(ta, "BWD_HEADS_PER_PROGRAM", 1)
    monkeypatch.setattr(ta, "BWD_ROWS_HEADS_PER_PROGRAM", 1)
    half = dict(lv, x=lv["x"].clone())
    half["x"][:, 1] = 0
    assert _rel(dict(zip(ARGS, _backward(half, gy, lens, chunk, cfg)))["B"], base["B"]) > 1e-2


@pytest.mark.parametrize("cap, group, heads", [(128, 80, 80), (128, 64, 64), (128, 256, 128), (64, 80, 40),
                                              (16, 80, 16), (7, 24, 6), (1, 5, 1)])
def test_heads_per_program_is_the_largest_divisor_up_to_the_cap(cap, group, heads):
    assert ta.heads_per_program(cap, group) == heads


def _launch_keeps_every_bit(monkeypatch, lv, gy, lens, chunk, cfg, **knobs):
    """The backward under launch ``knobs`` (``triton_backward``'s module attributes) against the defaults: every
    gradient bit for bit, where summing the state rows' heads in other partials (the check's baseline) moves dB.
    fp32 leaves only: rounded to bf16, a partial sum's last bits rarely show in dB."""
    base = _backward(lv, gy, lens, chunk, cfg)
    for name, value in knobs.items():
        monkeypatch.setattr(ta, name, value)
    got = _backward(lv, gy, lens, chunk, cfg)
    differ = [k for k, u, v in zip(ARGS, got, base) if not torch.equal(u, v)]
    assert not differ, (knobs, differ)
    if lv["x"].dtype == torch.float32:
        monkeypatch.setattr(ta, "BWD_ROWS_HEADS_PER_PROGRAM", 2)  # pairs of heads, the pairs summed by torch
        other = _backward(lv, gy, lens, chunk, cfg)
        assert not torch.equal(other[ARGS.index("B")], base[ARGS.index("B")]), "the baseline does not differ"


@pytest.mark.interpreter
@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 form; the GPU test below covers the compiled one")
def test_the_two_axis_grid_keeps_every_bit(monkeypatch):
    H, P, G, N, chunk, lens = 4, 16, 1, 16, 64, [128, 64]
    cfg = TritonKernelConfigs(bwd_block_s=16, bwd_block_t=32)
    lv = _leaves(8, lens, H, P, G, N, torch.float32)
    gy = torch.randn(sum(lens), H, P, generator=torch.Generator().manual_seed(9)).to(DEV)
    _launch_keeps_every_bit(monkeypatch, lv, gy, lens, chunk, cfg, BWD_FLAT_GRID=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_the_two_axis_grid_keeps_every_bit(monkeypatch, dtype):
    """mamba2-2.7b's scan shape (80 heads, one program a group): the two-axis grid against the flat default; bf16
    (tensor-core dots) and fp32 leaves."""
    H, P, G, N, chunk, lens = 80, 64, 1, 128, 256, [512, 256]
    lv = _leaves(10, lens, H, P, G, N, dtype)
    gy = torch.randn(sum(lens), H, P, generator=torch.Generator().manual_seed(11)).to(DEV, dtype)
    _launch_keeps_every_bit(monkeypatch, lv, gy, lens, chunk, TritonKernelConfigs(), BWD_FLAT_GRID=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bf16_rows_in_place_give_the_packed_grids_bits():
    """mamba2-1.3b's scan shape in bf16, whole chunks: x, dy and dx in place (the short cut) against
    the general packing (all-zero buffers force it), bit for bit but for dD (see below), and two
    backwards equal."""
    H, P, G, N, chunk, lens = 64, 64, 1, 128, 256, [512, 256]
    cfg = TritonKernelConfigs()
    lv = _leaves(5, lens, H, P, G, N, torch.bfloat16)
    gy = torch.randn(sum(lens), H, P, generator=torch.Generator().manual_seed(6)).to(DEV, torch.bfloat16)
    got = _backward(lv, gy, lens, chunk, cfg)
    assert all(torch.equal(u, v) for u, v in zip(got, _backward(lv, gy, lens, chunk, cfg)))
    # x as the layer passes it: a column slice of the conv's output (row stride H P + 2 G N), read in place
    wide = torch.zeros(sum(lens), H * P + 2 * G * N, device=DEV, dtype=torch.bfloat16)
    wide[:, :H * P] = lv["x"].reshape(sum(lens), H * P)
    sliced = dict(lv, x=wide[:, :H * P].view(sum(lens), H, P))
    assert not sliced["x"].is_contiguous()
    assert all(torch.equal(u, v) for u, v in zip(got, _backward(sliced, gy, lens, chunk, cfg)))
    S = len(lens)
    zero = (torch.zeros(S, H, chunk, P, device=DEV, dtype=torch.bfloat16),
            torch.zeros(S, H, chunk, device=DEV, dtype=torch.bfloat16),
            torch.zeros(S, G, chunk, N, device=DEV, dtype=torch.bfloat16))
    general = _backward(lv, gy, lens, chunk, cfg, zero)
    # dD is a tl.sum over the rows of dy * x as loaded: its order follows the register layout Triton
    # picks for the tile, which depends on the element width (bf16 rows in place, fp32 grids), so its
    # last bits may differ between the two paths (measured on the H200: they do); exact products, so
    # only the order. Every other gradient goes through the same dots and sums.
    differ = [k for k, u, v in zip(ARGS, got, general) if not torch.equal(u, v) and k != "D"]
    assert not differ, differ
    assert _rel(got[ARGS.index("D")], general[ARGS.index("D")]) < 1e-6
    assert got[0].dtype == torch.bfloat16 and float(got[0].float().abs().max()) > 0
