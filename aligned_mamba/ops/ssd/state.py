"""What every form of the SSD scan shares: the layer's parameters, the replay state, the step
(``ops.step.Step``, imported here for the forms).

Per sequence (a slot) and Mamba2 layer, exact replay keeps

- the fp32 SSM state at the sequence's last chunk boundary (a multiple of ``chunk_size``),
- the inputs of the tokens since that boundary: x, raw dt and B (at most ``chunk_size`` rows;
  C is never needed again, as those tokens' outputs were already emitted).

An advance runs the chunked scan from the boundary over (buffered partial chunk ++ new tokens),
emits the new tokens' rows, moves the boundary to the last full chunk and keeps the rest as the
new buffer. Storage is slot-indexed (a paged layout an engine can own): slot i of every tensor
belongs to one sequence; the engine hands out slots and tracks each sequence's position.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..step import Step


@dataclass(frozen=True)
class SSMParams:
    """One layer's SSM parameters as every form takes them.

    A [H] float32 (negative: -exp(A_log)), D [H] or [H, P] float32, dt_bias [H] float32,
    dt_limit (lo, hi): dt is clamped to it after softplus; (0, inf) means no clamp.
    """

    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def has_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)


@dataclass
class SSDState:
    """Slot-indexed replay storage of one layer's scan.

    ssm_state [slots, H, P, N] float32: the state at each slot's last chunk boundary.
    buf_x [slots, H, L, P], buf_dt [slots, H, L] and buf_B [slots, G, L, N], all in the model
    dtype: the inputs since that boundary, rows 0 .. pos % L - 1 (rows past that are zero).
    buf_dt holds the RAW dt (the in_proj output, before dt_bias and softplus). Head-major, so a
    slot's buffer is its first chunk's input as the scan reads it.

    Raw dt keeps the resident state at the fp32 state plus L tokens of x, dt and B in the model
    dtype: the forms recompute softplus(dt + dt_bias) for the buffered rows with the same
    elementwise function as for new rows (it acts element by element, so the bits are those a
    fresh computation gives).
    """

    ssm_state: torch.Tensor
    buf_x: torch.Tensor
    buf_dt: torch.Tensor
    buf_B: torch.Tensor

    @staticmethod
    def layout(*, heads: int, head_dim: int, groups: int, state_size: int, chunk_size: int,
               dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shape and dtype of each field (what one sequence holds), in field order."""
        return {
            "ssm_state": ((heads, head_dim, state_size), torch.float32),
            "buf_x": ((heads, chunk_size, head_dim), dtype),
            "buf_dt": ((heads, chunk_size), dtype),
            "buf_B": ((groups, chunk_size, state_size), dtype),
        }

    @classmethod
    def allocate(cls, num_slots: int, *, heads: int, head_dim: int, groups: int, state_size: int, chunk_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> SSDState:
        """Zeroed storage for ``num_slots`` sequences (a zero slot is an empty sequence)."""
        shapes = cls.layout(heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                            chunk_size=chunk_size, dtype=dtype)
        return cls(**{name: torch.zeros(num_slots, *shape, dtype=dt, device=device)
                      for name, (shape, dt) in shapes.items()})

    @property
    def chunk_size(self) -> int:
        return self.buf_x.shape[2]

    def bytes_per_slot(self) -> int:
        """Resident bytes one sequence holds."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    def reset(self, slots: torch.Tensor) -> None:
        """Empty the given slots (a new or recomputed sequence starts from zero state). One fill
        per field on the device, no host sync (``t[slots] = 0`` would copy the scalar and sync)."""
        for t in self.tensors():
            t.index_fill_(0, slots.to(t.device), 0)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields, in ``layout()`` order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def check_inputs(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor) -> None:
        """ValueError unless x, raw dt and B have the buffers' dtype: buffering would round them,
        and a replayed row would not be the single pass's."""
        for name, t, buf in (("x", x, self.buf_x), ("dt", dt, self.buf_dt), ("B", B, self.buf_B)):
            if t.dtype != buf.dtype:
                raise ValueError(f"{name} is {t.dtype} but the replay buffers are {buf.dtype}: buffering it "
                                 "would round it, and a replayed row would not be the single pass's")


__all__ = ["SSDState", "SSMParams", "Step"]
