"""Exact-replay decode on the torch backend: one new token per sequence, only its row.

A decode step must give its token the bits the single pass gives the same row. By the invariant of
``chunk.py`` that row is a fixed function of (the chunk's fp32 boundary state, the chunk's inputs up
to the token, its position), and the prefill computes it in the row tile holding it
(``chunk.tile_outputs``, R = ``TorchKernelConfigs.scan_row_tile(L)`` rows) from the zero-padded
chunk. So a decode step

1. writes the token's x, raw dt and B into row ``pos % L`` of its slot's buffers, which then hold
   the chunk so far (rows past it are zero, the buffer invariant of ``SSDState``);
2. builds the chunk's operands as ``chunk.pack_chunks`` does (softplus'd dt, +0.0 past the token;
   the within-chunk cumsum a) and runs ``chunk.tile_outputs``' arithmetic for the token's row: the
   prefill's operations, in its order. With the contract's ``gemm_form`` "lanes" (the default) a
   GEMM row's bits depend on that row's operands alone, so the three GEMMs compute the token's row
   only, reading the buffers as they are, and the elementwise work runs in ``ops.native``'s loops
   (``_native_rows``); with "tiles", or without the native library, the whole tile holding the
   token goes through ``tile_outputs`` with the token's C in its row and zeros in the others, at the
   prefill's GEMM shapes. The S sequences of a step are batched in each call (a batch item's bits
   do not depend on how many items share the call: tests/test_ops_rows.py,
   tests/test_replay_decode_torch.py);
3. where the token completes its chunk (``pos % L == L - 1``), folds the chunk into the boundary
   state with the prefill's code (``chunk.chunk_states``, ``chunk.fold_state``) and empties the
   slot's buffers.

Everything that depends only on the step's positions and slots (the tiles, masks, scatter and
gather indices, which sequences complete) is worked out once per step on the host and shared by
all layers (``Step.derived``); a layer's call is then a fixed sequence of ops with no host syncs.
Where the step's slots, sorted, are one contiguous range, the sequences are taken in slot order
and the state and buffers are read through views of that range, not gathered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import native
from ..configs import TorchKernelConfigs
from ..linear import LANES, lanes
from .chunk import TileLayout, chunk_states, dt_softplus, fold_state, tile_layout, tile_outputs
from .state import SSDState, SSMParams, Step


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's layout for layers of H heads and G groups, on the device.

    S sequences; ``order`` [S] (None: identity): the packed row each plan entry takes, ascending by
    slot when the slots form one range (``first`` >= 0 is then the first slot and entry i is slot
    first + i), else the packed order. Per entry: ``slots`` [S], ``pos`` [S] the token's position in
    its chunk, ``row`` [S] its row in its tile, ``lay`` the tiles' ``TileLayout``, ``filled``
    [S, 1, L] bool (chunk rows up to the token) and ``filled_len`` [S] (their number).
    ``put_x``/``put_B``: index tuples writing the token's x [S, H, P] (and raw dt [S, H]) / B
    [S, G, N] rows into buffers of [slots, H | G, L, ...]; ``put_C`` places C [S, G, N] in the tile
    rows [S, G, R, N] (lay, filled and the put_ tuples are made on first use: the torch forms').
    ``done`` [n] (None if none): entries whose token completes its chunk, ``done_slots`` [n] their
    slots. L, R, H, G: chunk size, row tile, heads, groups.
    """

    S: int
    first: int
    order: torch.Tensor | None
    inverse: torch.Tensor | None
    slots: torch.Tensor
    pos: torch.Tensor
    row: torch.Tensor
    filled_len: torch.Tensor
    done: torch.Tensor | None
    done_slots: torch.Tensor | None
    L: int
    R: int
    H: int
    G: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The plan's slots of a slot-indexed tensor, in plan order: a view when they are one range."""
        return t.narrow(0, self.first, self.S) if self.first >= 0 else t.index_select(0, self.slots)

    # The torch forms' tables, made when first asked for (the native loops need none of them)
    @functools.cached_property
    def lay(self) -> TileLayout:
        return tile_layout(self.pos // self.R, self.L, self.R, live=self.row)

    @functools.cached_property
    def filled(self) -> torch.Tensor:
        return (torch.arange(self.L, device=self.pos.device)[None, :] <= self.pos[:, None])[:, None, :]

    @functools.cached_property
    def put_x(self) -> tuple[torch.Tensor, ...]:
        heads = torch.arange(self.H, device=self.pos.device)
        return self.slots[:, None], heads[None, :], self.pos[:, None]

    @functools.cached_property
    def put_B(self) -> tuple[torch.Tensor, ...]:
        groups = torch.arange(self.G, device=self.pos.device)
        return self.slots[:, None], groups[None, :], self.pos[:, None]

    @functools.cached_property
    def put_C(self) -> tuple[torch.Tensor, ...]:
        dev = self.pos.device
        return torch.arange(self.S, device=dev)[:, None], torch.arange(self.G, device=dev)[None, :], self.row[:, None]


def plan_decode(step: Step, L: int, R: int, H: int, G: int, device: torch.device) -> DecodePlan:
    """The ``DecodePlan`` of a step whose sequences each bring one token (host tables, one copy each)."""
    slots_h = step.slots.to(torch.int64)
    S = slots_h.numel()
    if step.num_tokens != S:
        raise ValueError("replay_decode takes one new token per sequence; use chunk.replay_chunk")
    sorted_slots, order = torch.sort(slots_h, stable=True)
    contiguous = S > 0 and int(sorted_slots[-1]) - int(sorted_slots[0]) == S - 1
    if contiguous:
        first = int(sorted_slots[0])
        identity = bool((order == torch.arange(S)).all())
        slots_h = sorted_slots
        perm = None if identity else order
    else:
        first, perm = -1, None
    start = step.start_pos.to(torch.int64)
    pos_h = (start if perm is None else start[perm]) % L
    done_h = torch.nonzero(pos_h == L - 1).flatten()

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    slots, pos = dev(slots_h), dev(pos_h)
    return DecodePlan(
        S=S, first=first, order=None if perm is None else dev(perm),
        inverse=None if perm is None else dev(torch.argsort(perm)), slots=slots, pos=pos, row=pos % R,
        filled_len=pos + 1, done=dev(done_h) if done_h.numel() else None,
        done_slots=dev(slots_h[done_h]) if done_h.numel() else None, L=L, R=R, H=H, G=G)


def _native_rows(p: DecodePlan, a: torch.Tensor, dtc: torch.Tensor, state: SSDState, xt: torch.Tensor,
                 Cr: torch.Tensor, D: torch.Tensor, R: int, dtype: torch.dtype) -> torch.Tensor:
    """``tile_outputs(p.lay, ...)[:, :, 0]`` for the lanes' GEMMs, which compute the live rows alone:
    the same bits, with the elementwise work in ``ops.native``'s loops and the GEMMs reading the
    state's buffers and boundary states (slot-indexed, in ``dtype``, the model's, and float32) in
    place at the plan's slots. The scores past each token are +0.0 and so are the buffer rows
    there, so the scores' GEMM stops at the token's row (``lane_gemm_kn``'s klen).
    a, dtc [S, H, L] float32; xt [S, H, P] and Cr [S, G, N] the tokens' x and C in float32.
    Returns y [S, H, P] in ``dtype``."""
    buf_x, buf_B, h = state.buf_x, state.buf_B, state.ssm_state
    S, (G, L, N), (H, P) = p.S, buf_B.shape[1:], (buf_x.shape[1], buf_x.shape[3])
    exact = dtype == torch.bfloat16  # bf16 C.B products are exact
    C4 = Cr.view(S, G, 1, N)
    CB = inter = None
    if N % LANES == 0:  # whole lanes: the GEMMs read the slots in place
        CB = native.lane_gemm(C4, buf_B, exact, index=p.slots)  # [S, G, 1, L]
        if native.slot_stride(h) is not None:  # each slot's [H, P, N] contiguous: viewed per group
            hg = h.as_strided((h.shape[0], G, (H // G) * P, N), (h.stride(0), (H // G) * P * N, N, 1))
            inter = native.lane_gemm(C4, hg, False, index=p.slots)  # [S, G, 1, Hg*P]
    if CB is None:
        CB = lanes(Cr.view(S * G, 1, N), p.take(buf_B).reshape(S * G, L, N), exact)
    if inter is None:
        inter = lanes(Cr.view(S * G, 1, N), p.take(h).reshape(S * G, (H // G) * P, N))
    scores, e_in = native.decode_scores(a, dtc, CB.view(S * G, 1, L), p.pos, G, R)  # [S*H, 1, L]
    intra = native.lane_gemm_kn(scores.view(S, H, 1, L), buf_x, False, index=p.slots, klen=p.filled_len)  # [S, H, 1, P]
    return native.decode_combine(inter.view(S * G, 1, (H // G) * P), intra.view(S * H, 1, P), e_in, D, xt, p.pos,
                                 G, R, dtype)


def replay_decode(
    state: SSDState,
    step: Step,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    params: SSMParams,
    *,
    rows: torch.Tensor | None = None,
    cfg: TorchKernelConfigs,
) -> torch.Tensor:
    """Advance every slot of ``step`` by its one new token (the replay forms' signature); returns
    y [S, H, P] in x's dtype with the bits of the single pass's rows, zero in rows not wanted.

    x [S, H, P], dt [S, H] raw, B/C [S, G, N] in the model dtype (the buffers'), one row per
    sequence in the step's order; rows [S] bool (default all). Updates ``state`` in place as
    ``chunk.replay_chunk`` does: the token's buffer rows, and for a token that completes its chunk
    the boundary state and emptied buffers. ValueError unless every sequence has one new token.
    """
    state.check_inputs(x, dt, B)
    S, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L = state.chunk_size
    R = cfg.scan_row_tile(L)
    if L % R:
        raise ValueError(f"chunk_size {L} is not a multiple of the row tile {R}")
    dev = x.device
    if S == 0:
        return x.new_zeros(0, H, P)
    p = step.derived(("torch-decode", L, R, H, G, dev), lambda: plan_decode(step, L, R, H, G, dev))
    if S != p.S:
        raise ValueError(f"{S} new rows for a decode step of {p.S} sequences")
    if p.order is not None:
        x, dt, B, C = x[p.order], dt[p.order], B[p.order], C[p.order]
    f32 = torch.float32

    # 1. the token's rows into the buffers, which then hold the chunk up to it
    # 2. the chunk's operands as pack_chunks builds them, then the prefill's tile arithmetic. With the
    # lanes and the native loops, only the token's rows: the GEMMs read the buffers as they are.
    put = None
    if cfg.gemm_form == "lanes":
        put = native.decode_put(state.buf_x, state.buf_dt, state.buf_B, x, dt, B, C, p.slots, p.pos, params.A,
                                params.dt_bias, params.dt_limit)
    native_rows = put is not None
    if native_rows:
        dtc, a, Cr, xt = put
    else:
        state.buf_x.index_put_(p.put_x, x)
        state.buf_dt.index_put_(p.put_x, dt)
        state.buf_B.index_put_(p.put_B, B)
        # softplus acts element by element: the bits pack_chunks gives the same rows in its [T, H] layout
        d = dt_softplus(p.take(state.buf_dt).transpose(1, 2), params.dt_bias, params.dt_limit).transpose(1, 2)
        dtc = torch.where(p.filled, d, torch.zeros((), device=dev)).contiguous()  # [S, H, L], +0.0 past the token
        a = torch.cumsum(dtc * params.A.to(f32)[None, :, None], dim=-1)  # [S, H, L]
    h0 = None  # [S, H, P, N] float32, the chunks' boundary states, where a copy is needed
    xc = Bc = None
    if native_rows:
        y = _native_rows(p, a, dtc, state, xt, Cr, params.D, R, x.dtype)
    else:
        h0 = p.take(state.ssm_state)
        xc = p.take(state.buf_x).to(f32).contiguous()  # [S, H, L, P]
        Bc = p.take(state.buf_B).to(f32).contiguous()  # [S, G, L, N]
        Ct = torch.zeros(S, G, R, N, device=dev)
        Ct.index_put_(p.put_C, C.to(f32))
        y = tile_outputs(p.lay, a, dtc, xc, Bc, h0, Ct, params.D, cfg.gemm_form)[:, :, 0]  # [S, H, P]: the live rows

    # 3. chunks the token completes: the prefill's chunk state and state pass, then empty buffers
    if p.done is not None:
        d_ = p.done
        if xc is None:  # the completed chunks' operands, as pack_chunks builds them
            x_done, B_done = (buf.index_select(0, p.done_slots).to(f32) for buf in (state.buf_x, state.buf_B))
        else:
            x_done, B_done = xc[d_], Bc[d_]
        cs, cd = chunk_states(a[d_], dtc[d_], x_done, B_done)
        h_done = state.ssm_state.index_select(0, p.done_slots) if h0 is None else h0[d_]
        state.ssm_state[p.done_slots] = fold_state(h_done, cd, cs)
        for buf in (state.buf_x, state.buf_dt, state.buf_B):
            buf.index_fill_(0, p.done_slots, 0)
    if p.inverse is not None:
        y = y[p.inverse]
    if rows is not None:
        y = torch.where(rows.to(dev)[:, None, None], y, torch.zeros((), device=dev))
    return y.to(x.dtype)


__all__ = ["DecodePlan", "plan_decode", "replay_decode"]
