"""The triton backend's backward (the ops' ``triton.py`` Functions): the Triton forward, the torch form's gradient.

CPU group (the Triton interpreter, fp32, tiny shapes; conftest sets TRITON_INTERPRET=1 without a GPU):

- the SSD prefill as ``TritonBackend.ssd_advance`` runs it: gradients of x, dt, A, B, C, D, dt_bias and
  the initial boundary state against fp64 ``ssd_naive`` (n_groups 1 and 8, chunk 128 and 256), two
  backwards bit-identical; from buffered rows (an advance that does not start at a boundary): the
  gradients, and the forward's bits and state updates unchanged by autograd;
- that autograd cannot see through a bare Triton launch, and that a wrong backward is caught;
- the other kernels' Functions (linear, the norms, conv, log_softmax) run through the interpreter
  directly (on a CPU the backend runs their torch forms), against fp64 (each kernel's own backward
  against its torch form: tests/ops/norm/test_norm_backward.py, tests/ops/conv1d/test_conv1d_backward_walk.py,
  tests/ops/logprobs/test_logprobs_triton.py);
- a tiny fp32 model on the triton backend: logits with gradients on equal the no-grad logits and the
  sampler's decode rows, parameter gradients against the torch backend's and the fp64 reference, and
  ``PolicyTrainer`` steps on it.

GPU group (marked ``gpu``, skipped without CUDA): the same at a 1.3b-like layer shape, compiled.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fp64_reference import GRAD_RTOL, MODEL, reference_logits_fp64, rel_err  # noqa: E402
from kernel_cases import EPS, OP_RTOL  # noqa: E402
from torch_threads import single_thread_by_default  # noqa: E402, F401 (autouse fixture)

from aligned_mamba import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.ops.backend import TritonBackend  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.conv1d import triton as conv_tr  # noqa: E402
from aligned_mamba.ops.conv1d.triton import causal_conv1d_triton  # noqa: E402
from aligned_mamba.ops.linear import triton as linear_tr  # noqa: E402
from aligned_mamba.ops.linear.triton import linear_triton  # noqa: E402
from aligned_mamba.ops.logprobs import log_softmax  # noqa: E402
from aligned_mamba.ops.logprobs import triton as logprobs_tr  # noqa: E402
from aligned_mamba.ops.logprobs.triton import log_softmax_triton  # noqa: E402
from aligned_mamba.ops.norm import triton as norm_tr  # noqa: E402
from aligned_mamba.ops.norm.triton import (  # noqa: E402
    add_rms_norm_triton,
    embed_rms_norm_triton,
    gated_rms_norm_triton,
    rms_norm_triton,
)
from aligned_mamba.ops.ssd import SSDState, SSMParams, ssd_chunk, ssd_naive  # noqa: E402
from aligned_mamba.ops.ssd import triton_backward as ta  # noqa: E402
from aligned_mamba.ops.ssd.chunk import chunk_grid, dt_softplus_backward, pack_chunks  # noqa: E402
from aligned_mamba.ops.ssd.triton_chunk import replay_chunk_triton  # noqa: E402
from aligned_mamba.ops.step import Step  # noqa: E402
from aligned_mamba.train import PolicyTrainer  # noqa: E402

CFG = TritonKernelConfigs()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

SCAN_LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "h0")


@pytest.fixture(autouse=True)
def _keep_compiled_mode(monkeypatch):
    """As in tests/ops/ssd/test_triton_decode.py: another module sets TRITON_INTERPRET=1 when collected; the GPU
    tests compile."""
    if not INTERPRET:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _backend() -> TritonBackend:
    return TritonBackend(CFG, DEV)


# -- the SSD prefill -------------------------------------------------------------------------------------


def _scan_leaves(seed: int, lens: list[int], H: int, P: int, G: int, N: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T, S = sum(lens), len(lens)
    t = dict(x=torch.randn(T, H, P, generator=g), dt=torch.rand(T, H, generator=g) * 3 - 2,
             A=-torch.exp(torch.rand(H, generator=g) * 2.7), B=torch.randn(T, G, N, generator=g),
             C=torch.randn(T, G, N, generator=g), D=torch.randn(H, generator=g),
             dt_bias=torch.randn(H, generator=g) * 0.5, h0=torch.randn(S, H, P, N, generator=g) * 0.3)
    return {k: v.to(DEV) for k, v in t.items()}


def _advance(be: TritonBackend, leaves: dict[str, torch.Tensor], lens: list[int], chunk: int, G: int
             ) -> tuple[torch.Tensor, SSDState]:
    """One advance from boundary states leaves["h0"] (the trainer's forward, with a given initial state)."""
    S, (H, P, N) = len(lens), leaves["h0"].shape[1:]
    state = SSDState.allocate(S, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=chunk, dtype=torch.float32,
                              device=DEV)
    # a non-leaf copy, so its gradient reaches leaves["h0"] (the advance rewrites it in place)
    state.ssm_state = leaves["h0"] * 1.0
    p = SSMParams(leaves["A"], leaves["D"], leaves["dt_bias"])
    y = be.ssd_advance(state, Step.from_empty(lens), leaves["x"], leaves["dt"], leaves["B"], leaves["C"], p)
    return y, state


def _fp64_grads(leaves: dict[str, torch.Tensor], lens: list[int], wy: torch.Tensor) -> dict[str, torch.Tensor]:
    b = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    yr, _ = ssd_naive(b["x"], b["dt"], b["B"], b["C"], SSMParams(b["A"], b["D"], b["dt_bias"]), cu, b["h0"])
    (yr * wy.double()).sum().backward()
    return {k: v.grad for k, v in b.items()}


# fp32 against fp64, measured (relative norm): x, B, C, D, h0 1e-7 .. 2.3e-6; dt up to 5.4e-6; dt_bias
# up to 3.6e-5; A (one number per head, a sum over every row with cancellation) 9e-6 at chunk 128 and
# 2.0e-4 at chunk 256. These are the torch backend's own errors too (chunk.ssd_chunk's gradient at the
# same inputs measures the same, within a tenth of the tolerance of the backward's): GRAD_RTOL = 1e-4 (test_autograd's)
# for every leaf but A, 1e-3 for A; a wrong term gives O(1) (test_a_wrong_backward_is_caught).
SCAN_RTOL = {k: 1e-3 if k == "A" else GRAD_RTOL for k in SCAN_LEAVES}
# Interpreter cost: about 15 ms a program, so sequences are kept to two or three chunks (the C.B
# kernel alone runs chunks x groups x 16 programs at chunk 256); the forward-bits check runs at
# chunk 32 below and in the model test (each is a second forward).
@pytest.mark.interpreter
@pytest.mark.parametrize("chunk,G,lens", [(128, 1, [150, 40]), (256, 8, [270]), (128, 8, [129, 3])],
                         ids=["L128-G1", "L256-G8", "L128-G8"])
def test_ssd_prefill_gradients_match_fp64(chunk, G, lens):
    H, P, N = 8, 16, 16
    leaves = _scan_leaves(chunk + G, lens, H, P, G, N)
    a = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    y, _ = _advance(_backend(), a, lens, chunk, G)
    assert y.grad_fn is not None
    wy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    leaf_list = [a[k] for k in SCAN_LEAVES]
    got = torch.autograd.grad(y, leaf_list, wy, retain_graph=True)
    again = torch.autograd.grad(y, leaf_list, wy)
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    ref = _fp64_grads(leaves, lens, wy)
    errs = {k: rel_err(gk, ref[k]) for k, gk in zip(SCAN_LEAVES, got)}
    assert all(errs[k] < SCAN_RTOL[k] for k in SCAN_LEAVES), errs
    # as accurate as the torch backend's own gradient at the same inputs (autograd through its scan):
    # measured at most 2.0x its error against fp64 (dt_bias, a sum over every row with cancellation)
    t = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    yt, _ = ssd_chunk(t["x"], t["dt"], t["B"], t["C"], SSMParams(t["A"], t["D"], t["dt_bias"]), cu, t["h0"],
                      chunk_size=chunk, row_tile=CFG.scan_row_tile(chunk))
    tgot = torch.autograd.grad(yt, [t[k] for k in SCAN_LEAVES], wy)
    torch_errs = {k: rel_err(v.to(DEV), ref[k]) for k, v in zip(SCAN_LEAVES, tgot)}
    assert all(errs[k] < 3 * torch_errs[k] + 1e-7 for k in SCAN_LEAVES), (errs, torch_errs)


@pytest.mark.interpreter
def test_ssd_advance_from_buffered_rows_has_the_fp64_gradient():
    """An advance under autograd that starts inside a chunk (rows buffered by an earlier call): the
    backward replays the buffered rows and the boundary state as they were before the call."""
    chunk, G, H, P, N = 32, 2, 4, 16, 16
    first, second = 45, 30  # the second call starts 13 rows into a chunk and crosses a boundary
    leaves = _scan_leaves(5, [first + second], H, P, G, N)
    leaves["h0"] = torch.zeros_like(leaves["h0"])
    be = _backend()
    state = SSDState.allocate(1, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=chunk, dtype=torch.float32,
                              device=DEV)
    p = SSMParams(leaves["A"], leaves["D"], leaves["dt_bias"])
    with torch.no_grad():
        be.ssd_advance(state, Step.make([0], [0], [first]), *(leaves[k][:first] for k in ("x", "dt", "B", "C")), p)
    before = (state.ssm_state.clone(), state.buf_x.clone(), state.buf_dt.clone(), state.buf_B.clone())
    new = {k: leaves[k][first:].clone().requires_grad_() for k in ("x", "dt", "B", "C")}
    y = be.ssd_advance(state, Step.make([0], [first], [second]), new["x"], new["dt"], new["B"], new["C"], p)
    with torch.no_grad():  # the same call without autograd, from the same state: the same bits
        again = SSDState(*(t.clone() for t in before))
        y_plain = be.ssd_advance(again, Step.make([0], [first], [second]), *(leaves[k][first:] for k in new), p)
    assert torch.equal(y.detach(), y_plain), "grad mode changed the forward's bits"
    assert all(torch.equal(u, v) for u, v in zip(state.tensors(), again.tensors())), "grad mode changed the state"
    wy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
    (y * wy).sum().backward()
    # the reference: the whole sequence in fp64, only the second call's rows weighted
    w_full = torch.cat([torch.zeros(first, H, P, device=DEV), wy])
    ref = _fp64_grads(leaves, [first + second], w_full)
    errs = {k: rel_err(new[k].grad, ref[k][first:]) for k in new}
    assert all(e < GRAD_RTOL for e in errs.values()), errs


@pytest.mark.interpreter
def test_autograd_cannot_see_through_a_bare_triton_launch():
    """Why the Functions exist: a Triton launch writes fresh tensors by pointer, so without one the
    output has no grad_fn and every parameter upstream silently gets no gradient."""
    chunk, G, H, P, N, lens = 32, 1, 2, 16, 16, [20]
    a = {k: v.requires_grad_() for k, v in _scan_leaves(0, lens, H, P, G, N).items()}
    state = SSDState.allocate(1, heads=H, head_dim=P, groups=G, state_size=N, chunk_size=chunk, dtype=torch.float32,
                              device=DEV)
    y = replay_chunk_triton(state, Step.from_empty(lens), a["x"], a["dt"], a["B"], a["C"],
                            SSMParams(a["A"], a["D"], a["dt_bias"]), cfg=CFG)
    assert not y.requires_grad and y.grad_fn is None
    x, w = torch.randn(5, 16, device=DEV, requires_grad=True), torch.randn(8, 16, device=DEV, requires_grad=True)
    assert not linear_triton(x, w, None, CFG).requires_grad
    assert linear_tr.linear(x, w, None, cfg=CFG).requires_grad


@pytest.mark.interpreter
def test_a_wrong_backward_is_caught(monkeypatch):
    """The fp64 comparison has teeth: a backward that takes the scan's gradient at a slightly wrong
    point (dt_bias dropped from the recomputed chunk grid) fails it."""
    chunk, G, H, P, N, lens = 32, 2, 4, 16, 16, [40, 9]
    leaves = _scan_leaves(3, lens, H, P, G, N)
    real = ta.pack_chunks

    def dt_bias_dropped(x, dt, B, cu_seqlens, chunk_size, dt_bias, dt_limit, prefix=None, **kw):
        return real(x, dt, B, cu_seqlens, chunk_size, dt_bias * 0.0, dt_limit, prefix=prefix, **kw)

    monkeypatch.setattr(ta, "pack_chunks", dt_bias_dropped)
    a = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    y, _ = _advance(_backend(), a, lens, chunk, G)
    wy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    (y * wy).sum().backward()
    ref = _fp64_grads(leaves, lens, wy)
    assert rel_err(a["dt"].grad, ref["dt"]) > 100 * GRAD_RTOL


def _ssd_dense(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B, cu_seqlens, off, rows, chunk_size, dt_limit,
               row_tile):
    """An advance's y (``chunk.replay_chunk``'s arithmetic without the state writes) in ``chunk_dense``'s
    form, the function ``ta.ssd_backward`` takes the gradient of, under torch autograd."""
    from aligned_mamba.ops.ssd.chunk import pack_chunks
    from aligned_mamba.ops.ssd.chunk_dense import dense_outputs

    prefix = None if buf_x is None else (buf_x, buf_dt, buf_B, off)
    ch = pack_chunks(x, dt, B, cu_seqlens, chunk_size, dt_bias, dt_limit, prefix=prefix)
    y, _ = dense_outputs(ch, C, A, D, h0)
    if rows is not None:
        y = y * rows.to(y.device)[:, None, None]
    return y.to(x.dtype)


def _ssd_tile(x, dt, B, C, A, D, dt_bias, h0, buf_x, buf_dt, buf_B, cu_seqlens, off, rows, chunk_size, dt_limit,
              row_tile):
    """``_ssd_dense``'s signature over the torch backend's tile form (``chunk.replay_chunk``'s
    arithmetic without the state writes)."""
    from aligned_mamba.ops.ssd.chunk import pack_chunks, scan_chunks

    prefix = None if buf_x is None else (buf_x, buf_dt, buf_B, off)
    ch = pack_chunks(x, dt, B, cu_seqlens, chunk_size, dt_bias, dt_limit, prefix=prefix)
    y, _, _ = scan_chunks(ch, C, A, D, h0, rows=rows, final="boundary", row_tile=row_tile)
    return y.to(x.dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("off", [0, 5], ids=["from-empty", "buffered"])
def test_the_dense_form_is_the_tile_forms_function(off):
    """The scan's backward form (``chunk_dense``) computes the torch backend's tile form's y up to fp32
    rounding, with buffered rows, rows not wanted and several chunks per sequence, and so has its
    gradient; its final states are the fp64 recurrence's."""
    chunk, G, H, P, N, lens = 16, 2, 4, 8, 16, [37, 5, 16]
    lv = {k: v.cpu() for k, v in _scan_leaves(9, lens, H, P, G, N).items()}
    S, g = len(lens), torch.Generator().manual_seed(4)
    bufs = (None,) * 3
    offs = torch.full((S,), off, dtype=torch.int64)
    if off:
        bx, bB = torch.zeros(S, H, chunk, P), torch.zeros(S, G, chunk, N)
        bx[:, :, :off], bB[:, :, :off] = torch.randn(S, H, off, P, generator=g), torch.randn(S, G, off, N, generator=g)
        bufs = (bx, torch.randn(S, H, chunk, generator=g), bB)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    rows = torch.rand(sum(lens), generator=g) < 0.7
    leaves = {k: v.clone().requires_grad_() for k, v in lv.items()}
    args = ([leaves[k] for k in ("x", "dt", "B", "C", "A", "D", "dt_bias", "h0")], *bufs, cu, offs, rows, chunk,
            (0.0, math.inf), 16)
    wy = torch.randn(sum(lens), H, P, generator=g)
    outs = {}
    for name, form in (("tile", _ssd_tile), ("dense", _ssd_dense)):
        y = form(*args[0], *args[1:])
        outs[name] = (y.detach(), torch.autograd.grad((y * wy).sum(), args[0]))
    assert rel_err(outs["dense"][0], outs["tile"][0].double()) < 1e-6
    assert torch.equal(outs["dense"][0][~rows], torch.zeros_like(outs["dense"][0][~rows]))
    for k, u, v in zip(("x", "dt", "B", "C", "A", "D", "dt_bias", "h0"), outs["dense"][1], outs["tile"][1]):
        assert rel_err(u, v.double()) < SCAN_RTOL[k], k
    if not off:
        from aligned_mamba.ops.ssd.chunk_dense import ssd_chunk_dense

        prm = SSMParams(lv["A"], lv["D"], lv["dt_bias"])
        _, h = ssd_chunk_dense(lv["x"], lv["dt"], lv["B"], lv["C"], prm, cu, lv["h0"], chunk_size=chunk)
        _, h_ref = ssd_naive(lv["x"], lv["dt"], lv["B"], lv["C"], prm, cu, lv["h0"])
        assert rel_err(h, h_ref) < 1e-6


@pytest.mark.interpreter
@pytest.mark.parametrize("off,D_per_p,lens", [(0, False, [70, 5, 32]), (5, True, [70, 5, 32]), (0, False, [64, 32])],
                         ids=["from-empty", "buffered-D[H,P]", "whole-chunks"])
def test_triton_scan_backward_is_the_dense_forms_gradient(off, D_per_p, lens, monkeypatch):
    """``ta.ssd_backward`` (the Triton backward kernels) against torch autograd through ``_ssd_dense``
    at the same inputs: buffered rows, rows not wanted, several chunks per sequence, several row
    blocks per chunk (chunk 32, blocks 16), D per head or per channel. Sequences of whole chunks from
    empty take the packing's short cut (the grid as a view of the rows): the same bits as the general
    packing, reached here through all-zero buffers."""
    ARGS = ("x", "dt", "B", "C", "A", "D", "dt_bias", "h0")  # the positional order
    chunk, G, H, P, N = 32, 2, 4, 16, 16
    cfg = TritonKernelConfigs(bwd_block_s=16, bwd_block_t=16)
    lv = _scan_leaves(21, lens, H, P, G, N)
    if D_per_p:
        lv["D"] = _rand(H, P, seed=22)
    S, g = len(lens), torch.Generator().manual_seed(6)
    bufs = (None,) * 3
    offs = torch.full((S,), off, dtype=torch.int64, device=DEV)
    if off:
        bx, bB = torch.zeros(S, H, chunk, P), torch.zeros(S, G, chunk, N)
        bx[:, :, :off], bB[:, :, :off] = torch.randn(S, H, off, P, generator=g), torch.randn(S, G, off, N, generator=g)
        bufs = tuple(t.to(DEV) for t in (bx, torch.randn(S, H, chunk, generator=g), bB))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    rows = (torch.rand(sum(lens), generator=g) < 0.7).to(DEV)
    wy = torch.randn(sum(lens), H, P, generator=g).to(DEV)
    leaves = {k: v.clone().requires_grad_() for k, v in lv.items()}
    y = _ssd_dense(*(leaves[k] for k in ARGS), *bufs, cu, offs, rows, chunk, (0.0, math.inf), 16)
    want = torch.autograd.grad((y * wy).sum(), [leaves[k] for k in ARGS])
    grid = chunk_grid(cu.cpu(), offs.cpu(), chunk, DEV)
    cu = cu.cpu()  # as a step holds it
    packed = []
    monkeypatch.setattr(ta, "pack_chunks", lambda *a, **k: packed.append(1) or pack_chunks(*a, **k))
    got = ta.ssd_backward(*(lv[k] for k in ARGS), *bufs, wy, (True,) * 8, cu, offs, grid, rows, chunk,
                          (0.0, math.inf), cfg)
    again = ta.ssd_backward(*(lv[k] for k in ARGS), *bufs, wy, (True,) * 8, cu, offs, grid, rows, chunk,
                            (0.0, math.inf), cfg)
    assert len(packed) == (0 if not off and all(n % chunk == 0 for n in lens) else 2)
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    errs = {k: rel_err(u, v.double()) for k, u, v in zip(ARGS, got, want)}
    assert all(e < SCAN_RTOL[k] / 10 for k, e in errs.items()), errs
    if not off and all(n % chunk == 0 for n in lens):
        zero = (torch.zeros(S, H, chunk, P, device=DEV), torch.zeros(S, H, chunk, device=DEV),
                torch.zeros(S, G, chunk, N, device=DEV))
        general = ta.ssd_backward(*(lv[k] for k in ARGS), *zero, wy, (True,) * 8, cu, offs, grid, rows, chunk,
                                  (0.0, math.inf), cfg)
        assert all(torch.equal(u, v) for u, v in zip(got, general)), "the short cut changed the gradient's bits"



@pytest.mark.interpreter
@pytest.mark.parametrize("off,lens", [(0, [64, 32]), (5, [70, 5])], ids=["whole-chunks", "buffered"])
def test_scan_backward_softplus_rows_are_the_torch_forms(off, lens):
    """The last kernel's softplus backward to the raw dt rows (``chunk_scan_backward``'s dt_rows) against
    ``chunk.dt_softplus_backward`` of the same call's ddt, under a dt_limit that clamps some rows
    (packed rows after buffered ones too): the same zeros where the limit clamped, the rows' gradient
    and dt_bias's within fp32 rounding; and the gradient without the limit's mask differs."""
    chunk, G, H, P, N = 32, 1, 4, 16, 16
    cfg = TritonKernelConfigs(bwd_block_s=16, bwd_block_t=16)
    lv = _scan_leaves(31, lens, H, P, G, N)
    S, T, g = len(lens), sum(lens), torch.Generator().manual_seed(7)
    offs = torch.full((S,), off, dtype=torch.int64)
    prefix = None
    if off:
        prefix = (*(t.to(DEV) for t in (torch.randn(S, H, chunk, P, generator=g), torch.randn(S, H, chunk, generator=g),
                                        torch.randn(S, G, chunk, N, generator=g))), offs.to(DEV))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    grid = chunk_grid(cu, offs, chunk, DEV)
    NC, at = grid.num_chunks, (grid.row_chunk, slice(None), grid.row_pos)
    wy = torch.randn(T, H, P, generator=g).to(DEV)
    limit = (0.3, 1.2)  # softplus(dt + bias) spans about 0.05 .. 2: both ends clamp

    def run(dt_limit):
        ch = pack_chunks(lv["x"], lv["dt"], lv["B"], cu, chunk, lv["dt_bias"], dt_limit, prefix=prefix, grid=grid)
        Cc = torch.zeros(NC, G, chunk, N, device=DEV)
        Cc[at] = lv["C"]
        dyc = torch.zeros(NC, H, chunk, P, device=DEV)
        dyc[at] = wy
        graw, dbp = torch.empty(T, H, device=DEV), torch.empty(NC, H, device=DEV)
        out = ta.chunk_scan_backward(ch, Cc, lv["A"], lv["D"], lv["h0"], dyc, cfg, bf16_operands=False,
                                     first=grid.first, count=grid.count, grid=grid,
                                     dt_rows=(lv["dt"], lv["dt_bias"], dt_limit, graw, dbp))
        return out[1], graw, dbp

    ddtc, graw, dbp = run(limit)
    want = dt_softplus_backward(lv["dt"], lv["dt_bias"], limit, ddtc[at])
    clamped = graw == 0
    assert 0 < int(clamped.sum()) < clamped.numel()
    assert torch.equal(clamped, want == 0)
    assert rel_err(graw, want) < 1e-6, rel_err(graw, want)
    assert rel_err(dbp.sum(0), want.sum(0)) < 1e-6
    assert rel_err(run((0.0, math.inf))[1], want) > 1e-2


# -- the other kernels' Functions (through the interpreter on a CPU) --------------------------------------


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEV)


def _rms64(x: torch.Tensor, w: torch.Tensor | float, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _check_op(fn, kernel, ref64, inputs: dict[str, torch.Tensor], grad_keys: tuple[str, ...]) -> dict[str, float]:
    """fn(**leaves) under autograd: forward bits == kernel(**inputs) without; two backwards
    bit-identical; gradients against ref64 (float64 autograd). Returns the relative errors."""
    leaves = {k: v.clone().requires_grad_() if k in grad_keys else v for k, v in inputs.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    plain = kernel(**inputs)
    plain = plain if isinstance(plain, tuple) else (plain,)
    assert all(o.grad_fn is not None for o in outs)
    assert all(torch.equal(o.detach(), p) for o, p in zip(outs, plain)), "grad mode changed the forward's bits"
    ws = [_rand(*o.shape, seed=40 + i) for i, o in enumerate(outs)]
    wanted = [leaves[k] for k in grad_keys]
    got = torch.autograd.grad(outs, wanted, ws, retain_graph=True)
    again = torch.autograd.grad(outs, wanted, ws)
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    d = {k: v.double().requires_grad_() if k in grad_keys else v for k, v in inputs.items()}
    r = ref64(**d)
    r = r if isinstance(r, tuple) else (r,)
    ref = torch.autograd.grad(r, [d[k] for k in grad_keys], [w.double() for w in ws])
    return {k: rel_err(u, v) for k, u, v in zip(grad_keys, got, ref)}


F32 = torch.float32


def _op_cases() -> dict:
    M, d, V = 6, 48, 20
    ids = torch.tensor([3, 0, 19, 3, 7, 11], device=DEV)
    slots, cu = torch.tensor([2, 0], device=DEV), torch.tensor([0, 5, 8], device=DEV)
    Cd, K = 24, 4
    windows = _rand(3, K - 1, Cd, seed=9)

    def conv64(x, w, b):
        out = []
        for s in range(2):
            stream = torch.cat([windows[slots[s]].double(), x[cu[s]:cu[s + 1]]])
            T = int(cu[s + 1] - cu[s])
            acc = b + sum(w[:, k] * stream[k:k + T] for k in range(K))
            out.append(F.silu(acc))
        return torch.cat(out)

    return {
        "linear": (lambda x, w, b: linear_tr.linear(x, w, b, cfg=CFG), lambda x, w, b: linear_triton(x, w, b, CFG),
                   lambda x, w, b: x @ w.t() + b, dict(x=_rand(M, d, seed=1), w=_rand(40, d, seed=2, scale=0.2),
                                                       b=_rand(40, seed=3)), ("x", "w", "b")),
        "rms_norm": (lambda x, w: norm_tr.rms_norm(x, w, EPS, F32, CFG),
                     lambda x, w: rms_norm_triton(x, w, EPS, F32, CFG),
                     lambda x, w: _rms64(x, w, EPS), dict(x=_rand(M, d, seed=4), w=_rand(d, seed=5)), ("x", "w")),
        "embed_norm": (lambda ids, e, w: norm_tr.embed_norm(ids, e, w, EPS, F32, F32, CFG),
                       lambda ids, e, w: embed_rms_norm_triton(ids, e, w, EPS, F32, F32, CFG),
                       lambda ids, e, w: (_rms64(e[ids], w, EPS), e[ids]),
                       dict(ids=ids, e=_rand(V, d, seed=6), w=_rand(d, seed=7)), ("e", "w")),
        "add_norm": (lambda x, r, w: norm_tr.add_norm(x, r, w, EPS, F32, CFG),
                     lambda x, r, w: add_rms_norm_triton(x, r, w, EPS, F32, CFG),
                     lambda x, r, w: (_rms64(r + x, w, EPS), r + x),
                     dict(x=_rand(M, d, seed=8), r=_rand(M, d, seed=10), w=_rand(d, seed=11)), ("x", "r", "w")),
        "gated_rms_norm": (lambda y, z, w: norm_tr.gated_rms_norm(y, z, w, EPS, 4, CFG),
                           lambda y, z, w: gated_rms_norm_triton(y, z, w, EPS, 4, CFG),
                           lambda y, z, w: _rms64((y * F.silu(z)).view(M, 4, d // 4), 1.0, EPS).view(M, d) * w,
                           dict(y=_rand(M, d, seed=12), z=_rand(M, d, seed=13), w=_rand(d, seed=14)),
                           ("y", "z", "w")),
        "gated_norm_linear": (
            lambda y, z, nw, w, b: norm_tr.gated_norm_linear(y, z, nw, EPS, 4, w, b, CFG),
            lambda y, z, nw, w, b: linear_triton(gated_rms_norm_triton(y, z, nw, EPS, 4, CFG), w, b, CFG),
            lambda y, z, nw, w, b: (_rms64((y * F.silu(z)).view(M, 4, d // 4), 1.0, EPS).view(M, d) * nw) @ w.t() + b,
            dict(y=_rand(M, d, seed=12), z=_rand(M, d, seed=13), nw=_rand(d, seed=14),
                 w=_rand(40, d, seed=2, scale=0.2), b=_rand(40, seed=3)), ("y", "z", "nw", "w", "b")),
        # each call updates its own copy of the windows (the kernel writes them in place)
        "conv": (lambda x, w, b: (lambda wc: conv_tr._Conv.apply(x, w, b, wc[slots], cu, slots, wc, CFG))(
                     windows.clone()),
                 lambda x, w, b: causal_conv1d_triton(x, cu, slots, windows.clone(), w, b, CFG), conv64,
                 dict(x=_rand(8, Cd, seed=15), w=_rand(Cd, K, seed=16, scale=0.5), b=_rand(Cd, seed=17)),
                 ("x", "w", "b")),
        "log_softmax": (lambda z: logprobs_tr._LogSoftmax.apply(z, CFG), lambda z: log_softmax_triton(z, CFG),
                        lambda z: torch.log_softmax(z, -1), dict(z=_rand(M, 50, seed=18, scale=3.0)), ("z",)),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("name", sorted(_op_cases()))
def test_kernel_functions_forward_bits_and_gradients(name):
    fn, kernel, ref64, inputs, keys = _op_cases()[name]
    errs = _check_op(fn, kernel, ref64, inputs, keys)
    assert all(e < OP_RTOL for e in errs.values()), errs


@pytest.mark.interpreter
def test_in_proj_gradient_is_written_in_place_by_the_blocks_backwards(monkeypatch):
    """in_proj's output split as the mixer splits it (``split_columns(..., one_grad=True)``): the gated
    norm + out_proj's and the conv's backwards write their blocks of one gradient buffer, the dt block
    is copied in, and nothing is concatenated; the gradient has the bits of the plain split's (whose
    backward concatenates). The baseline, a buffer handed to a block's second consumer too (whose
    gradient autograd then sums with itself), differs, so the comparison can fail."""
    from aligned_mamba.ops import autograd as ag

    M, d, Cd, H, K = 6, 48, 24, 4, 4
    slots, cu = torch.tensor([1, 0], device=DEV), torch.tensor([0, 5, 6], device=DEV)
    wide = _rand(M, d + Cd + H, seed=71)
    y, nw, ow, ob = _rand(M, d, seed=72), _rand(d, seed=73), _rand(40, d, seed=74, scale=0.2), _rand(40, seed=75)
    cw, cb, windows = _rand(Cd, K, seed=76, scale=0.5), _rand(Cd, seed=77), _rand(2, K - 1, Cd, seed=78)
    ws = [_rand(M, 40, seed=79), _rand(M, Cd, seed=80), _rand(M, H, seed=81)]

    def grad(one: bool, twice: bool = False) -> torch.Tensor:
        t = wide.clone().requires_grad_()
        z, xc, dt = ag.split_columns(t, (d, Cd, H), one_grad=True) if one else t.split((d, Cd, H), dim=1)
        wc = windows.clone()
        conv = conv_tr._Conv.apply(xc, cw, cb, wc[slots], cu, slots, wc, CFG)
        outs = [norm_tr.gated_norm_linear(y, z, nw, EPS, 4, ow, ob, CFG), conv, dt * 2.0]
        if twice:  # the conv's input feeding a second conv
            outs[1] = outs[1] + conv_tr._Conv.apply(xc, cw, cb, wc[slots], cu, slots, wc, CFG)
        return torch.autograd.grad(outs, [t], ws)[0]

    want = grad(False)
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("concatenated"))
    assert torch.equal(grad(True), want)
    monkeypatch.setattr(torch, "cat", cat)
    assert torch.equal(grad(True, twice=True), grad(False, twice=True))
    monkeypatch.setattr(ag.GradBlock, "take", lambda self: self.grad.block(self.index))  # no once-only rule
    assert not torch.equal(grad(True, twice=True), grad(False, twice=True))


# -- a tiny model ----------------------------------------------------------------------------------------


def _model_loss(logits, targets):
    return -sum(log_softmax(lg).gather(-1, t[:, None]).sum() for lg, t in zip(logits, targets))


@pytest.mark.interpreter
def test_the_scan_writes_x_b_c_gradients_as_the_conv_outputs_columns(monkeypatch):
    """Sequences of whole chunks from empty: the scan's backward writes dx, dB and dC into one buffer laid
    out as the conv's output, and the split's backward passes that buffer on as it is (no concatenation);
    every gradient equals the plain split's (which concatenates) bit for bit."""
    from aligned_mamba.layers import mamba2 as mixer
    from aligned_mamba.ops import autograd

    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    g = torch.Generator().manual_seed(12)
    L = config.chunk_size
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (2 * L, L)]
    targets = [torch.randint(0, config.vocab_size, (len(s),), generator=g) for s in seqs]
    contract = Contract(chunk_size=L, backend="triton", model_dtype="float32")
    names = sorted(tensors)

    def grads():
        leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        loss = _model_loss(build_model(config, leaves, contract).forward(seqs), targets)
        return torch.autograd.grad(loss, [leaves[k] for k in names])

    whole = []
    spy = autograd.column_blocks
    d, GN = config.intermediate_size, config.n_groups * config.state_size

    def seen(parts):
        got = spy(parts)
        if [p.shape[1] for p in parts] == [d, GN, GN]:  # the conv output's split (not in_proj's)
            whole.append(got)
        return got

    monkeypatch.setattr(autograd, "column_blocks", seen)
    got = grads()
    assert whole and all(w is not None for w in whole), "the split's backward concatenated"
    monkeypatch.setattr(mixer, "split_columns", lambda t, sizes, one_grad=False: t.split(sizes, dim=1))
    plain = grads()
    assert all(torch.equal(u, v) for u, v in zip(got, plain))
    assert all(float(u.abs().max()) > 0 for u in got), "a parameter got no gradient"


@pytest.mark.interpreter
def test_split_columns_concatenates_what_is_not_one_buffer():
    """The split's backward takes a buffer only when the gradients are its adjacent column blocks in
    order; otherwise (separate tensors, blocks out of order, a missing one) it concatenates, zeros for
    a missing gradient."""
    from aligned_mamba.ops.autograd import split_columns

    t = torch.randn(5, 9, requires_grad=True)
    buf = torch.randn(5, 9)
    parts = split_columns(t, (4, 3, 2))
    assert [p.shape[1] for p in parts] == [4, 3, 2]
    g, = torch.autograd.grad(parts, t, buf.split((4, 3, 2), dim=1), retain_graph=True)
    assert g.data_ptr() == buf.data_ptr() and torch.equal(g, buf)
    sep = [b.clone() for b in buf.split((4, 3, 2), dim=1)]
    g, = torch.autograd.grad(parts, t, sep, retain_graph=True)
    assert g.data_ptr() != buf.data_ptr() and torch.equal(g, buf)
    swapped = torch.cat([buf[:, 5:], buf[:, :5]], 1)  # C's block first: not the layout
    g, = torch.autograd.grad(parts, t, (swapped[:, 2:6], swapped[:, 6:], swapped[:, :2]), retain_graph=True)
    assert torch.equal(g, torch.cat([swapped[:, 2:6], swapped[:, 6:], swapped[:, :2]], 1))
    g, = torch.autograd.grad(parts[:2], t, buf.split((4, 3, 2), dim=1)[:2])
    assert torch.equal(g, torch.cat([buf[:, :7], torch.zeros(5, 2)], 1))


@pytest.mark.interpreter
def test_tiny_model_on_triton_backend_trains_with_the_samplers_bits():
    """fp32 tiny Mamba2 (2 layers, chunk 16, 2 groups). With gradients on, the triton backend's logits
    equal its no-grad logits and the sampler's decode rows bit for bit (and differ from the torch
    backend's, so a forward that fell back to the torch form would be caught); parameter gradients
    match the fp64 reference and the torch backend's; two backwards are bit-identical."""
    config, tensors = make_tiny(0, dtype="float32", **MODEL)
    g = torch.Generator().manual_seed(11)
    lens = (40, 17, 5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lens]
    targets = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lens]
    contract = Contract(chunk_size=config.chunk_size, backend="triton", model_dtype="float32")

    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    logits = build_model(config, leaves, contract).forward(seqs)
    model = build_model(config, tensors, contract)
    with torch.no_grad():
        plain = model.forward(seqs)
        torch_logits = build_model(config, tensors, Contract(chunk_size=config.chunk_size, model_dtype="float32")
                                   ).forward(seqs)
        # the sampler: a prefill of 33 tokens (two chunks and a row), then token-by-token decode
        cache, s0 = model.new_cache(1, max_len=lens[0]), seqs[0]
        rows = [model.advance(cache, Step.make([0], [0], [33]), s0[:33])]
        rows += [model.advance(cache, Step.make([0], [t], [1]), s0[t:t + 1]) for t in range(33, lens[0])]
    assert all(torch.equal(a.detach(), b) for a, b in zip(logits, plain)), "grad mode changed the logits' bits"
    assert torch.equal(logits[0].detach(), torch.cat(rows)), "the trainer's logits are not the sampler's rows"
    assert not all(torch.equal(a, b) for a, b in zip(plain, torch_logits)), "backends agree: the check is vacuous"

    loss = _model_loss(logits, targets)
    names = sorted(tensors)
    got = torch.autograd.grad(loss, [leaves[k] for k in names], retain_graph=True)
    again = torch.autograd.grad(loss, [leaves[k] for k in names])
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    assert all(float(u.abs().max()) > 0 for u in got), "a parameter got no gradient"

    tl = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    tloss = _model_loss(build_model(config, tl, Contract(chunk_size=config.chunk_size, model_dtype="float32")
                                    ).forward(seqs), targets)
    tgot = torch.autograd.grad(tloss, [tl[k] for k in names])
    ref = {k: v.double().requires_grad_() for k, v in tensors.items()}
    rloss = -sum(torch.log_softmax(reference_logits_fp64(config, ref, s), -1).gather(-1, t[:, None]).sum()
                 for s, t in zip(seqs, targets))
    rgot = torch.autograd.grad(rloss, [ref[k] for k in names])
    vs_torch = {k: rel_err(u, v.double()) for k, u, v in zip(names, got, tgot)}
    vs_fp64 = {k: rel_err(u, v) for k, u, v in zip(names, got, rgot)}
    assert all(e < GRAD_RTOL for e in vs_torch.values()), vs_torch
    assert all(e < GRAD_RTOL for e in vs_fp64.values()), vs_fp64


@pytest.mark.interpreter
def test_policy_trainer_steps_on_the_triton_backend():
    """The refusal is gone: a REINFORCE step on the triton backend matches the torch backend's (same
    loss up to rounding, gradient norm within GRAD_RTOL)."""
    config, tensors = make_tiny(1, dtype="float32", **{**MODEL, "num_hidden_layers": 1})
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (24, 9)]
    stats = {}
    for backend in ("triton", "torch"):
        tr = PolicyTrainer(config, tensors, Contract(chunk_size=config.chunk_size, backend=backend,
                                                     model_dtype="float32"), lr=1e-3)
        stats[backend] = tr.step(seqs, [4, 3], [1.0, -0.5])
        assert stats[backend]["weights_version"] == 1
    assert math.isclose(stats["triton"]["loss"], stats["torch"]["loss"], rel_tol=1e-5)
    assert math.isclose(stats["triton"]["grad_norm"], stats["torch"]["grad_norm"], rel_tol=GRAD_RTOL)


# -- on a GPU: a 1.3b-like layer, compiled ------------------------------------------------------------------


@gpu
@gpu_only
@pytest.mark.parametrize("chunk,G", [(256, 1), (128, 8)])
def test_gpu_ssd_prefill_gradients_at_a_1_3b_layer_shape(chunk, G):
    """mamba2-1.3b's scan shape (64 heads of 64, state 128) in fp32 on 2 sequences (one crossing
    chunks): gradients against fp64 within GRAD_RTOL, forward bits unchanged by grad mode, two
    backwards bit-identical."""
    H, P, N, lens = 64, 64, 128, [600, 77]
    leaves = _scan_leaves(7, lens, H, P, G, N)
    a = {k: v.clone().requires_grad_() for k, v in leaves.items()}
    be = _backend()
    y, _ = _advance(be, a, lens, chunk, G)
    with torch.no_grad():
        y_plain, _ = _advance(be, leaves, lens, chunk, G)
    assert torch.equal(y.detach(), y_plain)
    wy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    leaf_list = [a[k] for k in SCAN_LEAVES]
    got = torch.autograd.grad(y, leaf_list, wy, retain_graph=True)
    again = torch.autograd.grad(y, leaf_list, wy)
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    ref = _fp64_grads(leaves, lens, wy)
    errs = {k: rel_err(gk, ref[k]) for k, gk in zip(SCAN_LEAVES, got)}
    assert all(errs[k] < SCAN_RTOL[k] for k in SCAN_LEAVES), errs


@gpu
@gpu_only
@pytest.mark.parametrize("mode,rtol", [("split2", 1e-4), ("round", 2e-2)])
def test_gpu_bf16_scan_backward_dots_against_fp32(mode, rtol):
    """The backward kernels' tensor-core dots (a bf16 model: x, B, C, dy hold bf16 values) against their
    fp32 FMA dots at the same inputs, mamba2-1.3b's scan shape: "split2" (fp32 operands in two bf16
    terms) close to fp32, "round" (one term, as mamba_ssm) at bf16 precision; and deterministic."""
    from aligned_mamba.ops.ssd.chunk import pack_chunks
    from aligned_mamba.ops.ssd.triton_backward import chunk_scan_backward

    H, P, G, N, L, lens = 64, 64, 1, 128, 256, [600, 77]
    lv = _scan_leaves(8, lens, H, P, G, N)
    bf = {k: lv[k].to(torch.bfloat16).float() for k in ("x", "B", "C")}  # bf16 values, held in fp32
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    ch = pack_chunks(bf["x"], lv["dt"], bf["B"], cu, L, lv["dt_bias"], (0.0, math.inf))
    NC = ch.x.shape[0]
    Cc = torch.zeros(NC, G, L, N, device=DEV)
    Cc[ch.row_chunk, :, ch.row_pos] = bf["C"]
    dyc = torch.zeros(NC, H, L, P, device=DEV)
    dyc[ch.row_chunk, :, ch.row_pos] = torch.randn(sum(lens), H, P, device=DEV).to(torch.bfloat16).float()
    args = (ch, Cc, lv["A"], lv["D"], lv["h0"], dyc)
    grid = chunk_grid(cu.cpu(), None, L, DEV)
    at = dict(first=grid.first, count=grid.count)
    want = chunk_scan_backward(*args, CFG, bf16_operands=False, **at)
    cfg = TritonKernelConfigs(bwd_bf16_dots=mode)
    got = chunk_scan_backward(*args, cfg, bf16_operands=True, **at)
    assert all(torch.equal(u, v) for u, v in zip(got, chunk_scan_backward(*args, cfg, bf16_operands=True, **at)))
    errs = {k: rel_err(u, v.double()) for k, u, v in zip(("dx", "ddt", "dB", "dC", "dA", "dD", "dh0"), got, want)}
    assert all(e < rtol for e in errs.values()), errs


def _layer_1_3b(seed: int, lens: tuple[int, ...]):
    """One mamba2-1.3b-shaped layer's config and bf16 tensors (d_model 2048, 64 heads of 64, state 128,
    1 group, chunk 256), token sequences of ``lens`` and their targets on the GPU, drawn from ``seed``."""
    shape = dict(hidden_size=2048, num_heads=64, head_dim=64, state_size=128, n_groups=1, num_hidden_layers=1,
                 vocab_size=1024, chunk_size=256)
    config, tensors = make_tiny(0, dtype="bfloat16", **shape)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lens]
    targets = [torch.randint(0, config.vocab_size, (n,), generator=g).to(DEV) for n in lens]
    return config, tensors, seqs, targets


@gpu
@gpu_only
def test_gpu_1_3b_layer_model_trains_with_the_samplers_bits():
    """One mamba2-1.3b-shaped layer (d_model 2048, 64 heads of 64, state 128, 1 group, chunk 256) in
    bf16 on the compiled triton backend: logits with gradients on equal the no-grad logits bit for bit,
    two backwards are bit-identical, every parameter gets a gradient, and the gradients are the torch
    backend's (on the same GPU) up to bf16 rounding of the forwards."""
    config, tensors, seqs, targets = _layer_1_3b(3, (700, 300))
    names = sorted(tensors)

    def grads(backend: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        contract = Contract(chunk_size=256, backend=backend, model_dtype="bfloat16")
        leaves = {k: v.to(DEV).float().requires_grad_() for k, v in tensors.items()}  # fp32 masters, cast inside
        served = {k: v.to(torch.bfloat16) if tensors[k].dtype == torch.bfloat16 else v for k, v in leaves.items()}
        logits = build_model(config, served, contract, DEV).forward(seqs)
        loss = _model_loss(logits, targets)
        ws = [leaves[k] for k in names]
        return logits, torch.autograd.grad(loss, ws, retain_graph=True), torch.autograd.grad(loss, ws)

    logits, got, again = grads("triton")
    with torch.no_grad():
        plain = build_model(config, {k: v.to(DEV) for k, v in tensors.items()},
                            Contract(chunk_size=256, backend="triton", model_dtype="bfloat16"), DEV).forward(seqs)
    assert all(torch.equal(a.detach(), b) for a, b in zip(logits, plain)), "grad mode changed the logits' bits"
    assert all(torch.equal(u, v) for u, v in zip(got, again)), "two backwards gave different bits"
    assert all(float(u.abs().max()) > 0 for u in got), "a parameter got no gradient"
    _, tgot, _ = grads("torch")
    errs = {k: rel_err(u, v.double()) for k, u, v in zip(names, got, tgot)}
    # bf16 forwards that differ in rounding (Triton vs torch kernels): a few 1e-3 expected; a wrong
    # term gives O(1)
    assert all(e < 3e-2 for e in errs.values()), errs


@gpu
@gpu_only
def test_gpu_1_3b_layer_backward_recomputes_rather_than_holds(monkeypatch):
    """One mamba2-1.3b-shaped layer in bf16, 2 x 2048 tokens: with ``Mamba2Mixer.recompute`` the forward
    holds at least 0.9 x (conv_dim + intermediate) x T bf16 values fewer for the backward (the conv's and
    the gated norm's outputs) than without it (the baseline), and the gradients have the same bits."""
    from aligned_mamba.layers.mamba2 import Mamba2Mixer

    lens = (2048, 2048)
    config, tensors, seqs, targets = _layer_1_3b(4, lens)
    contract = Contract(chunk_size=256, backend="triton", model_dtype="bfloat16")
    leaves = {k: v.to(DEV).requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    names = sorted(leaves)

    def run() -> tuple[int, list[torch.Tensor]]:
        model = build_model(config, leaves, contract, DEV)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = _model_loss(model.forward(seqs), targets)
        held = torch.cuda.memory_allocated() - before
        return held, list(torch.autograd.grad(loss, [leaves[k] for k in names]))

    run()  # compiles
    held, got = run()
    monkeypatch.setattr(Mamba2Mixer, "recompute", False)
    held_base, want = run()
    T, d = sum(lens), 64 * 64
    assert held_base - held >= 0.9 * (d + 2 * 128 + d) * T * 2, (held_base, held)
    assert all(torch.equal(u, v) for u, v in zip(got, want))
