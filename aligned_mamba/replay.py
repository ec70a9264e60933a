"""Exact replay: the state a sampler keeps per sequence and layer, and the one ``advance``.

Per sequence (a slot) and Mamba2 layer the sampler keeps

- the fp32 SSM state at the sequence's last chunk boundary (a multiple of ``chunk_size``),
- the inputs of the tokens since that boundary: x, raw dt and B (at most ``chunk_size`` rows;
  C is never needed again, as those tokens' outputs were already emitted),
- the conv window: the last ``K - 1`` conv inputs.

``ssd_advance`` runs the shared chunked scan from the boundary over (buffered partial chunk ++
new tokens), emits the new tokens' rows, moves the boundary to the last full chunk and keeps the
rest as the new buffer. Prefill is an advance from an empty slot, decode an advance by one token,
chunked prefill a sequence of advances, recompute after preemption an advance from an empty slot
over the whole history, and the trainer's forward one advance from empty: one code path.

Storage is slot-indexed (a paged layout an engine can own): slot i of every tensor belongs to one
sequence; the engine hands out slots and tracks each sequence's position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .ops.configs import PINNED
from .ops.conv1d import causal_conv1d
from .ops.ssd import scan_chunks_for
from .ops.ssd.chunk import pack_chunks


@dataclass
class LayerReplayState:
    """Slot-indexed replay storage of one Mamba2 layer.

    ssm_state [slots, H, P, N] float32: the state at each slot's last chunk boundary.
    buf_x [slots, H, L, P], buf_dt [slots, H, L] and buf_B [slots, G, L, N], all in the model
    dtype: the inputs since that boundary, rows 0 .. pos % L - 1 (rows past that are zero).
    buf_dt holds the RAW dt (the in_proj output, before dt_bias and softplus). Head-major, so a
    slot's buffer is its first chunk's input as the scan reads it. conv_window [slots, K-1,
    conv_dim] (model dtype).

    Raw dt keeps the resident state at the fp32 state plus L tokens of x, dt and B in the model
    dtype (plus the conv window): ``pack_chunks`` recomputes softplus(dt + dt_bias) for the
    buffered rows with the same elementwise function as for new rows (it acts element by element,
    so the bits are those a fresh computation gives).
    """

    ssm_state: torch.Tensor
    buf_x: torch.Tensor
    buf_dt: torch.Tensor
    buf_B: torch.Tensor
    conv_window: torch.Tensor

    @staticmethod
    def layout(
        *,
        heads: int,
        head_dim: int,
        groups: int,
        state_size: int,
        conv_kernel: int,
        conv_dim: int,
        chunk_size: int,
        dtype: torch.dtype,
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shape and dtype of each field (what one sequence holds), in field order.

        Engines that own the storage (vLLM's Mamba cache) declare these and build the state from
        slot-indexed views with ``LayerReplayState(**views)``.
        """
        return {
            "ssm_state": ((heads, head_dim, state_size), torch.float32),
            "buf_x": ((heads, chunk_size, head_dim), dtype),
            "buf_dt": ((heads, chunk_size), dtype),
            "buf_B": ((groups, chunk_size, state_size), dtype),
            "conv_window": ((conv_kernel - 1, conv_dim), dtype),
        }

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        *,
        heads: int,
        head_dim: int,
        groups: int,
        state_size: int,
        conv_kernel: int,
        conv_dim: int,
        chunk_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LayerReplayState:
        shapes = cls.layout(heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                            conv_kernel=conv_kernel, conv_dim=conv_dim, chunk_size=chunk_size, dtype=dtype)
        return cls(**{name: torch.zeros(num_slots, *shape, dtype=dt, device=device)
                      for name, (shape, dt) in shapes.items()})

    @property
    def chunk_size(self) -> int:
        return self.buf_x.shape[2]

    def reset(self, slots: torch.Tensor) -> None:
        """Empty the given slots (a new or recomputed sequence starts from zero state). One fill
        per field on the device, no host sync (``t[slots] = 0`` would copy the scalar and sync)."""
        for t in self.tensors():
            t.index_fill_(0, slots.to(t.device), 0)

    def bytes_per_slot(self) -> int:
        """Resident bytes one sequence holds in this layer."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields, in ``layout()`` order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


@dataclass
class LayerRunningState:
    """The baseline's per-layer state (exact replay off): the running fp32 state at the last
    token and the conv window, as engines keep it today. ssm_state [slots, H, P, N] float32."""

    ssm_state: torch.Tensor
    conv_window: torch.Tensor

    def reset(self, slots: torch.Tensor) -> None:
        for t in (self.ssm_state, self.conv_window):
            t.index_fill_(0, slots.to(t.device), 0)


@dataclass(frozen=True)
class Batch:
    """One advance: S sequences, each with n_i new tokens packed in order.

    slots [S] int64 (distinct), start_pos [S] int64 (tokens already consumed by each slot),
    cu_seqlens [S+1] int64 (new tokens' offsets in the packed rows), all on the CPU.

    A batch is one engine step, shared by every layer of the step, and must not change once built:
    what a backend derives from it (the Triton backend's chunk and tile plan, the decode's device
    copies of slots and positions) is computed by the first layer and reused by the others
    (``derived``), as an engine builds its attention metadata once per step.
    """

    slots: torch.Tensor
    start_pos: torch.Tensor
    cu_seqlens: torch.Tensor
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def make(cls, slots: list[int], start_pos: list[int], new_tokens: list[int]) -> Batch:
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {slots}")
        if any(n <= 0 for n in new_tokens) or any(p < 0 for p in start_pos):
            raise ValueError("every sequence in a batch needs >= 1 new token and a position >= 0")
        cu = [0]
        for n in new_tokens:
            cu.append(cu[-1] + n)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(slots=t(slots), start_pos=t(start_pos), cu_seqlens=t(cu))

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def derived(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per batch and key (see the class docstring)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]


def conv_advance(state: LayerReplayState | LayerRunningState, batch: Batch, xBC: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Conv1d + SiLU of the new rows from each slot's window; updates the windows. [T, Cd] -> [T, Cd]."""
    out, window = causal_conv1d(xBC, batch.cu_seqlens, state.conv_window[batch.slots], weight, bias)
    state.conv_window[batch.slots] = window
    return out


def ssd_advance(
    state: LayerReplayState,
    batch: Batch,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    rows: torch.Tensor | None = None,
    row_tile: int | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Advance every slot of ``batch`` by its new tokens; returns y [T, H, P] for the new rows.

    x [T, H, P], dt [T, H] raw, B/C [T, G, N] in the model dtype (x, dt and B must have the
    buffers' dtype, so buffering does not round them; ValueError otherwise); rows [T] bool
    (default all): the rows whose outputs are wanted (others are zero, except on the GPU decode
    path, which computes every row of its one-token batch). Updates ``state`` in place.

    Buffer rows at and past a slot's fill level are kept zero, so a slot's buffer is already
    its first chunk's zero-padded prefix (raw dt included: ``pack_chunks`` zeroes the softplus'd
    dt past the fill level).
    """
    for name, t, buf in (("x", x, state.buf_x), ("dt", dt, state.buf_dt), ("B", B, state.buf_B)):
        if t.dtype != buf.dtype:
            raise ValueError(f"{name} is {t.dtype} but the replay buffers are {buf.dtype}: buffering it "
                             "would round it, and a replayed row would not be the single pass's")
    L = state.chunk_size
    dev = x.device
    if row_tile is None:  # the backend's pinned row tile (a shorter chunk is one tile)
        row_tile = min(int(PINNED[backend]["row_tile"]), L)
    if backend == "triton" and x.is_cuda and bool((batch.lengths == 1).all()):
        # A decode-only batch on the GPU: the fused replay-decode kernel computes just the new
        # rows with the prefill kernel's arithmetic (bit-identical, checked on the H200 by
        # tests/test_triton_decode.py) and touches the boundary state only when a chunk completes.
        from .ops.ssd.plan import host_to_device
        from .ops.ssd.triton_decode import replay_decode_triton

        def decode_tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | bool]:
            done = torch.nonzero(batch.start_pos % L == L - 1).flatten()
            n = batch.slots.numel()
            tables = host_to_device(torch.cat([batch.slots, batch.start_pos, done]).numpy(), dev)  # one copy
            return tables[:n], tables[n:2 * n], tables[2 * n:] if done.numel() else False

        slots_d, pos_d, done_d = batch.derived(("decode", L, dev), decode_tables)
        return replay_decode_triton(state, slots_d, pos_d, x, dt, B, C, A=A, D=D, dt_bias=dt_bias,
                                    dt_limit=dt_limit, completes=done_d)
    if backend == "triton":
        # The chunk, tile and buffer layout comes from the batch's lengths on the host (no device
        # syncs), once per batch (every layer of a step shares it); pack, scan, state pass and
        # buffer rewrite are Triton kernels (triton_chunk).
        from .ops.ssd.plan import plan_advance, to_device
        from .ops.ssd.triton_chunk import advance_triton

        def planned() -> tuple:
            p = plan_advance(batch.lengths, batch.start_pos % L, L, row_tile, slots=batch.slots, rows=rows)
            return p, to_device(p, dev)

        # a rows mask is a device tensor of its own: planned per call, not kept
        plan, plan_d = planned() if rows is not None else batch.derived(("plan", L, row_tile, dev), planned)
        return advance_triton(state, plan, x, dt, B, C, A=A, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                              zero_unwanted=rows is not None, device_plan=plan_d)
    slots, cu = batch.slots.to(dev), batch.cu_seqlens.to(dev)
    lens = cu[1:] - cu[:-1]
    off = batch.start_pos.to(dev) % L  # rows buffered since the boundary
    prefix = (state.buf_x[slots], state.buf_dt[slots], state.buf_B[slots], off)
    ch = pack_chunks(x, dt, B, cu, L, dt_bias, dt_limit, prefix=prefix)
    scan = scan_chunks_for(backend)
    y, h, moved = scan(ch, C, A, D, state.ssm_state[slots], rows=rows, final="boundary", row_tile=row_tile)
    if bool(moved.any()):
        state.ssm_state[slots[moved]] = h[moved]
    # New buffer: the rows of each slot's last, partial chunk. A slot whose chunk completed is
    # emptied first (rows past the fill level stay zero); the others only gain rows.
    rem = (off + lens) % L
    crossed = off + lens >= L
    if bool(crossed.any()):
        for buf in (state.buf_x, state.buf_dt, state.buf_B):
            buf[slots[crossed]] = 0
    row_seq = torch.repeat_interleave(torch.arange(slots.numel(), device=dev), lens, output_size=x.shape[0])
    last_chunk = ch.row_chunk == (torch.cumsum((off + lens + L - 1) // L, 0) - 1)[row_seq]
    keep = last_chunk & (rem[row_seq] > 0)
    dst_slot, dst_pos = slots[row_seq[keep]], ch.row_pos[keep]
    state.buf_x[dst_slot, :, dst_pos] = x[keep]
    state.buf_dt[dst_slot, :, dst_pos] = dt[keep]  # raw: pack_chunks applies softplus on replay
    state.buf_B[dst_slot, :, dst_pos] = B[keep]
    return y.to(x.dtype)
