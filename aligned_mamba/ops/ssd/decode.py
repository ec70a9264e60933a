"""Exact-replay decode on the torch backend: one new token per sequence, only its row, with the bits
the single pass gives that row (why: docs/design.md, "The one idea"). A decode step
1. writes the token's x, raw dt and B into row ``pos % L`` of its slot's buffers (the chunk so far);
2. builds the chunk's operands as ``chunk.pack_chunks`` does and runs ``chunk.tile_outputs`` on the
   whole row tile holding the token (its C in its row, zeros in the others: the prefill's GEMM shapes);
3. where the token completes its chunk, folds the chunk into the boundary state with the prefill's
   code and empties the slot's buffers.
The step's tables are made once on the host and shared by all layers (``StepPlan.ssd_decode``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..configs import TorchKernelConfigs
from .chunk import TileLayout, chunk_states, dt_softplus, fold_state, replay_chunk, tile_layout, tile_outputs
from .state import SSDState, SSMParams, Step


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's layout on the device, for L chunk size, R row tile, H heads, G groups.
    ``order``/``inverse`` [S] (None: identity): packed row of each entry, ascending by slot when the slots
    are one range (``first`` >= 0, entry i is slot first + i; else -1). [S] per entry: ``slots``, ``pos``
    (row in its chunk), ``row`` (in its tile), ``filled_len``; ``done``/``done_slots`` [n] (None if none):
    entries completing their chunk. The torch forms' tables (lay, filled [S, 1, L], the put_ index tuples
    into buffers [slots, H | G, L, ...] and tile rows [S, G, R, N]) are made on first use."""

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


def prepare(state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            cfg: TorchKernelConfigs) -> tuple[DecodePlan, tuple[torch.Tensor, ...]] | None:
    """The step's ``DecodePlan`` (once per step) and the inputs in its order; None for an empty step.
    ValueError where the inputs do not fit."""
    state.check_inputs(x, dt, B)
    S, H, P = x.shape
    G = B.shape[1]
    L = state.chunk_size
    R = cfg.scan_row_tile(L)
    if L % R:
        raise ValueError(f"chunk_size {L} is not a multiple of the row tile {R}")
    dev = x.device
    if S == 0:
        return None
    plan = step.plans[dev]
    p = plan.once(plan.ssd_decode, (L, R, H, G), lambda: plan_decode(step, L, R, H, G, dev))
    if S != p.S:
        raise ValueError(f"{S} new rows for a decode step of {p.S} sequences")
    if p.order is not None:
        x, dt, B, C = x[p.order], dt[p.order], B[p.order], C[p.order]
    return p, (x, dt, B, C)


def tile_rows(p: DecodePlan, state: SSDState, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              params: SSMParams, gemm_form: str) -> tuple[torch.Tensor, ...]:
    """Steps 1 and 2 in torch ops, inputs in plan order -> y [S, H, P] fp32 and the operands step 3 reuses:
    dtc and a [S, H, L], xc [S, H, L, P], Bc [S, G, L, N], h0 [S, H, P, N]."""
    dev, f32 = x.device, torch.float32
    S, G, N = x.shape[0], B.shape[1], B.shape[2]
    state.buf_x.index_put_(p.put_x, x)
    state.buf_dt.index_put_(p.put_x, dt)
    state.buf_B.index_put_(p.put_B, B)
    # softplus acts element by element: the bits pack_chunks gives the same rows in its [T, H] layout
    d = dt_softplus(p.take(state.buf_dt).transpose(1, 2), params.dt_bias, params.dt_limit).transpose(1, 2)
    dtc = torch.where(p.filled, d, torch.zeros((), device=dev)).contiguous()  # [S, H, L], +0.0 past the token
    a = torch.cumsum(dtc * params.A.to(f32)[None, :, None], dim=-1)  # [S, H, L]
    h0 = p.take(state.ssm_state)  # [S, H, P, N] float32, the chunks' boundary states
    xc = p.take(state.buf_x).to(f32).contiguous()  # [S, H, L, P]
    Bc = p.take(state.buf_B).to(f32).contiguous()  # [S, G, L, N]
    Ct = torch.zeros(S, G, p.R, N, device=dev)
    Ct.index_put_(p.put_C, C.to(f32))
    y = tile_outputs(p.lay, a, dtc, xc, Bc, h0, Ct, params.D, gemm_form)[:, :, 0]  # [S, H, P]: the live rows
    return y, dtc, a, xc, Bc, h0


def finish(p: DecodePlan, state: SSDState, y: torch.Tensor, a: torch.Tensor, dtc: torch.Tensor,
           xc: torch.Tensor | None, Bc: torch.Tensor | None, h0: torch.Tensor | None, rows: torch.Tensor | None,
           dtype: torch.dtype) -> torch.Tensor:
    """Step 3, and y [S, H, P] back in the step's order in ``dtype``, zero in rows not wanted.
    xc, Bc, h0: step 2's operands where it made them (None: read from the state)."""
    dev, f32 = y.device, torch.float32
    if p.done is not None:
        d_ = p.done
        if xc is None or Bc is None:  # the completed chunks' operands, as pack_chunks builds them
            x_done, B_done = (buf.index_select(0, p.done_slots).to(f32) for buf in (state.buf_x, state.buf_B))
        else:
            x_done, B_done = xc[d_], Bc[d_]
        cs, cd = chunk_states(a[d_], dtc[d_], x_done, B_done)
        h_done = state.ssm_state.index_select(0, p.done_slots) if h0 is None else h0[d_]
        state.ssm_state[p.done_slots] = fold_state(h_done, cd, cs)
        state.refresh_copy(p.done_slots)
        for buf in (state.buf_x, state.buf_dt, state.buf_B):
            buf.index_fill_(0, p.done_slots, 0)
    if p.inverse is not None:
        y = y[p.inverse]
    if rows is not None:
        y = torch.where(rows.to(dev)[:, None, None], y, torch.zeros((), device=dev))
    return y.to(dtype)


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
    """Advance every slot of ``step`` by its one new token, updating ``state`` as ``chunk.replay_chunk``
    does: x [S, H, P], dt [S, H] raw, B/C [S, G, N] in the buffers' dtype, step order; rows [S] bool or None
    -> y [S, H, P] in x's dtype, the single pass's bits, zero in rows not wanted."""
    prep = prepare(state, step, x, dt, B, C, cfg)
    if prep is None:
        return x.new_zeros(0, *x.shape[1:])
    p, (x, dt, B, C) = prep
    y, dtc, a, xc, Bc, h0 = tile_rows(p, state, x, dt, B, C, params, cfg.gemm_form)
    return finish(p, state, y, a, dtc, xc, Bc, h0, rows, x.dtype)


def replay(state: SSDState, step: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           params: SSMParams, rows: torch.Tensor | None = None, *, cfg: TorchKernelConfigs) -> torch.Tensor:
    """The torch backend's advance (the backend's ``ssd_advance``): ``replay_decode`` for a step of one
    token per sequence, ``chunk.replay_chunk`` otherwise. y [T, H, P] in x's dtype; updates ``state``."""
    form = replay_decode if step.decode_only else replay_chunk
    return form(state, step, x, dt, B, C, params, rows=rows, cfg=cfg)


__all__ = ["DecodePlan", "finish", "plan_decode", "prepare", "replay", "replay_decode", "tile_rows"]
