"""What every SSD scan form shares: SSMParams, the replay state SSDState (docs/design.md, "The one idea"), Step."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..step import Step


@dataclass(frozen=True)
class SSMParams:
    """One layer's SSM parameters: A [H] fp32 (-exp(A_log)), D [H] or [H, P] fp32, dt_bias [H] fp32,
    dt_limit (lo, hi) clamps dt after softplus ((0, inf): no clamp)."""

    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def has_limit(self) -> bool:
        return tuple(self.dt_limit) != (0.0, math.inf)


@dataclass
class SSDState:
    """Slot-indexed replay storage of one layer's scan: ssm_state [slots, H, P, N] fp32 at the last chunk
    boundary; buf_x [slots, H, L, P], buf_dt [slots, H, L] (raw: docs/design.md, "The one idea") and
    buf_B [slots, G, L, N] in the model dtype, rows since the boundary (zero past them), head-major as the
    scan reads a chunk; ssm_state_bf16 [slots, H, P, N] bf16 or None: ssm_state rounded to nearest-even, kept
    equal to it by every writer (``refresh_copy``), the Triton decode's read where its dots round the state
    anyway (``TritonKernelConfigs.bf16_state_copy``)."""

    ssm_state: torch.Tensor
    buf_x: torch.Tensor
    buf_dt: torch.Tensor
    buf_B: torch.Tensor
    ssm_state_bf16: torch.Tensor | None = None

    @staticmethod
    def layout(*, heads: int, head_dim: int, groups: int, state_size: int, chunk_size: int,
               dtype: torch.dtype, bf16_copy: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shape and dtype of each field, in field order (``ssm_state_bf16`` where ``bf16_copy``)."""
        shapes = {
            "ssm_state": ((heads, head_dim, state_size), torch.float32),
            "buf_x": ((heads, chunk_size, head_dim), dtype),
            "buf_dt": ((heads, chunk_size), dtype),
            "buf_B": ((groups, chunk_size, state_size), dtype),
        }
        if bf16_copy:
            shapes["ssm_state_bf16"] = ((heads, head_dim, state_size), torch.bfloat16)
        return shapes

    @classmethod
    def allocate(cls, num_slots: int, *, heads: int, head_dim: int, groups: int, state_size: int, chunk_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", bf16_copy: bool = False) -> SSDState:
        """Zeroed storage for ``num_slots`` sequences (a zero slot is an empty sequence)."""
        shapes = cls.layout(heads=heads, head_dim=head_dim, groups=groups, state_size=state_size,
                            chunk_size=chunk_size, dtype=dtype, bf16_copy=bf16_copy)
        return cls(**{name: torch.zeros(num_slots, *shape, dtype=dt, device=device)
                      for name, (shape, dt) in shapes.items()})

    def __post_init__(self) -> None:
        c = self.ssm_state_bf16
        if c is not None and (c.dtype != torch.bfloat16 or c.shape != self.ssm_state.shape):
            raise ValueError(f"ssm_state_bf16 must be bf16 {tuple(self.ssm_state.shape)} (the boundary state's "
                             f"shape), not {c.dtype} {tuple(c.shape)}")

    @property
    def chunk_size(self) -> int:
        return self.buf_x.shape[2]

    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    def reset(self, slots: torch.Tensor) -> None:
        """Empty the given slots with no host sync (``t[slots] = 0`` would copy the scalar and sync)."""
        for t in self.tensors():
            t.index_fill_(0, slots.to(t.device), 0)

    def refresh_copy(self, slots: torch.Tensor) -> None:
        """``ssm_state_bf16`` at ``slots`` [k] int64 (device) rounded again from ``ssm_state``; a writer of the
        boundary state calls it after writing (nothing without a copy)."""
        if self.ssm_state_bf16 is not None and slots.numel():
            slots = slots.to(self.ssm_state.device, torch.int64)
            self.ssm_state_bf16.index_copy_(0, slots, self.ssm_state.index_select(0, slots).to(torch.bfloat16))

    def named(self) -> dict[str, torch.Tensor]:
        """The fields that are present by name, in field order (the layer's ``StateSpec`` names)."""
        return {f.name: t for f in dataclasses.fields(self) if (t := getattr(self, f.name)) is not None}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields that are present, in field order (``SSDState(*tensors())`` rebuilds the state)."""
        return tuple(self.named().values())

    def check_inputs(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor) -> None:
        """ValueError unless x, raw dt and B have the buffers' dtype (buffering would round them)."""
        for name, t, buf in (("x", x, self.buf_x), ("dt", dt, self.buf_dt), ("B", B, self.buf_B)):
            if t.dtype != buf.dtype:
                raise ValueError(f"{name} is {t.dtype} but the replay buffers are {buf.dtype}: buffering it "
                                 "would round it, and a replayed row would not be the single pass's")


__all__ = ["SSDState", "SSMParams", "Step"]
