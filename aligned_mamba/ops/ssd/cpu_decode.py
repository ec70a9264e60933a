"""The CPU form of the decode step: ``decode.py``'s arithmetic for the tokens' rows alone, in ``native_cpu.c``'s
loops (with ``gemm_form`` "lanes" a GEMM row's bits depend on its own operands only); elsewhere ``decode.py``.
"""

from __future__ import annotations

import torch

from ..configs import TorchKernelConfigs
from ..linear import LANES, lanes
from ..linear.cpu import lane_gemm, lane_gemm_kn
from ..native import DTYPES, library, ok, row_stride, slot_stride
from . import decode
from .chunk import replay_chunk
from .decode import DecodePlan
from .state import SSDState, SSMParams, Step


def decode_put(buf_x: torch.Tensor, buf_dt: torch.Tensor, buf_B: torch.Tensor, x: torch.Tensor, dt: torch.Tensor,
               B: torch.Tensor, C: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, A: torch.Tensor,
               dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> tuple[torch.Tensor, ...] | None:
    """Steps 1 and 2 of ``decode.py`` up to the GEMMs, for ``slots``/``pos`` [S] (all inputs one dtype) -> fp32
    dtc [S, H, L] (+0.0 past the token), a = torch.cumsum(dtc * A, -1) (its bits), the tokens' C [S, G, N] and
    x [S, H, P]; None, with nothing written, where the loops do not apply."""
    ts = (buf_x, buf_dt, buf_B, x, dt, B, C)
    if not ok(*ts) or len({t.dtype for t in ts}) != 1 or (lib := library()) is None:
        return None
    strides = [slot_stride(b) for b in (buf_x, buf_dt, buf_B)]
    S = slots.numel()
    rows = [t.reshape(S, -1) for t in (x, dt, B, C)]  # views where the rows are contiguous
    lds = [row_stride(t) for t in rows]
    if None in strides or None in lds:
        return None
    _, H, L, P = buf_x.shape
    G, N = buf_B.shape[1], buf_B.shape[3]
    slots, pos = slots.to(torch.int64).contiguous(), pos.to(torch.int64).contiguous()
    bias, Af = dt_bias.to(torch.float32).contiguous(), A.to(torch.float32).contiguous()
    dtc, a, Cr, xt = torch.empty(S, H, L), torch.empty(S, H, L), torch.empty(S, G, N), torch.empty(S, H, P)
    lo, hi = (float(v) for v in dt_limit)
    limit = (lo, hi) != (0.0, float("inf"))
    xr, dtr, Br, Cn = rows
    lib.am_decode_put(buf_x.data_ptr(), buf_dt.data_ptr(), buf_B.data_ptr(), xr.data_ptr(), lds[0], dtr.data_ptr(),
                      lds[1], Br.data_ptr(), lds[2], Cn.data_ptr(), lds[3], DTYPES[x.dtype], *strides,
                      slots.data_ptr(), pos.data_ptr(), S, H, G, L, P, N, bias.data_ptr(), Af.data_ptr(), int(limit),
                      lo if limit else 0.0, hi if limit else 0.0, dtc.data_ptr(), a.data_ptr(), Cr.data_ptr(),
                      xt.data_ptr())
    return dtc, a, Cr, xt


def decode_scores(a: torch.Tensor, dtc: torch.Tensor, CB: torch.Tensor, pos: torch.Tensor, G: int,
                  R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk.tile_outputs``' elementwise work for each tile's live row: a, dtc [S, H, L] fp32, CB [S * G, Q, L]
    (Q = R whole tiles, or 1: the live rows) -> the intra GEMM's left operand [S * H, Q, L] (zero but the live
    rows), e_in [S, H] the boundary state's decay. The library must be loaded."""
    lib = library()
    S, H, L = a.shape
    a, dtc, CB = a.contiguous(), dtc.contiguous(), CB.contiguous()
    pos = pos.to(torch.int64).contiguous()
    Q = CB.shape[1]
    tiles, e_in = torch.empty(S * H, Q, L), torch.empty(S, H)
    lib.am_decode_scores(a.data_ptr(), dtc.data_ptr(), CB.data_ptr(), pos.data_ptr(), S, H, G, L, R, Q,
                         tiles.data_ptr(), e_in.data_ptr())
    return tiles, e_in


def decode_combine(inter: torch.Tensor, intra: torch.Tensor, e_in: torch.Tensor, D: torch.Tensor, xt: torch.Tensor,
                   pos: torch.Tensor, G: int, R: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [S, H, P] = (C.h_in * e_in + intra) + D x_t rounded once to ``dtype``, from inter [S * G, Q, Hg * P],
    intra [S * H, Q, P], e_in [S, H], D [H] or [H, P], xt [S, H, P] fp32."""
    lib = library()
    S, H, P = xt.shape
    inter, intra, xt = inter.contiguous(), intra.contiguous(), xt.contiguous()
    Df = D.to(torch.float32).contiguous()
    pos = pos.to(torch.int64).contiguous()
    y = torch.empty(S, H, P, dtype=dtype)
    lib.am_decode_combine(inter.data_ptr(), intra.data_ptr(), e_in.data_ptr(), Df.data_ptr(), int(Df.dim() == 2),
                          xt.data_ptr(), pos.data_ptr(), S, H, G, P, R, inter.shape[1], y.data_ptr(), DTYPES[dtype])
    return y


def loop_rows(p: DecodePlan, a: torch.Tensor, dtc: torch.Tensor, state: SSDState, xt: torch.Tensor,
                 Cr: torch.Tensor, D: torch.Tensor, R: int, dtype: torch.dtype) -> torch.Tensor:
    """``tile_outputs(p.lay, ...)[:, :, 0]``'s bits with the lanes' GEMMs on the live rows alone, reading the
    state in place; the scores' GEMM stops at the token's row (scores and buffer rows past it are +0.0).
    a, dtc [S, H, L], xt [S, H, P], Cr [S, G, N] fp32 -> y [S, H, P] in ``dtype``."""
    buf_x, buf_B, h = state.buf_x, state.buf_B, state.ssm_state
    S, (G, L, N), (H, P) = p.S, buf_B.shape[1:], (buf_x.shape[1], buf_x.shape[3])
    exact = dtype == torch.bfloat16  # bf16 C.B products are exact
    C4 = Cr.view(S, G, 1, N)
    CB = inter = None
    if N % LANES == 0:  # whole lanes: the GEMMs read the slots in place
        CB = lane_gemm(C4, buf_B, exact, index=p.slots)  # [S, G, 1, L]
        if slot_stride(h) is not None:  # each slot's [H, P, N] contiguous: viewed per group
            hg = h.as_strided((h.shape[0], G, (H // G) * P, N), (h.stride(0), (H // G) * P * N, N, 1))
            inter = lane_gemm(C4, hg, False, index=p.slots)  # [S, G, 1, Hg*P]
    if CB is None:
        CB = lanes(Cr.view(S * G, 1, N), p.take(buf_B).reshape(S * G, L, N), exact)
    if inter is None:
        inter = lanes(Cr.view(S * G, 1, N), p.take(h).reshape(S * G, (H // G) * P, N))
    scores, e_in = decode_scores(a, dtc, CB.view(S * G, 1, L), p.pos, G, R)  # [S*H, 1, L]
    intra = lane_gemm_kn(scores.view(S, H, 1, L), buf_x, False, index=p.slots, klen=p.filled_len)  # [S, H, 1, P]
    return decode_combine(inter.view(S * G, 1, (H // G) * P), intra.view(S * H, 1, P), e_in, D, xt, p.pos,
                                 G, R, dtype)


def replay_decode(state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  params: SSMParams, *, rows: torch.Tensor | None = None, cfg: TorchKernelConfigs) -> torch.Tensor:
    """``decode.replay_decode`` (the replay forms' signature), the tokens' rows in the loops."""
    prep = decode.prepare(state, step, x, dt, B, C, cfg)
    if prep is None:
        return x.new_zeros(0, *x.shape[1:])
    p, (x, dt, B, C) = prep
    put = None
    if cfg.gemm_form == "lanes":
        put = decode_put(state.buf_x, state.buf_dt, state.buf_B, x, dt, B, C, p.slots, p.pos, params.A,
                         params.dt_bias, params.dt_limit)
    if put is None:
        y, dtc, a, xc, Bc, h0 = decode.tile_rows(p, state, x, dt, B, C, params, cfg.gemm_form)
        return decode.finish(p, state, y, a, dtc, xc, Bc, h0, rows, x.dtype)
    dtc, a, Cr, xt = put
    y = loop_rows(p, a, dtc, state, xt, Cr, params.D, p.R, x.dtype)
    return decode.finish(p, state, y, a, dtc, None, None, None, rows, x.dtype)


def replay(state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           params: SSMParams, rows: torch.Tensor | None = None, *, cfg: TorchKernelConfigs) -> torch.Tensor:
    """``decode.replay`` with this form's decode step."""
    form = replay_decode if step.decode_only else replay_chunk
    return form(state, step, x, dt, B, C, params, rows=rows, cfg=cfg)
