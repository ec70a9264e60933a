"""Exact replay: the batch of one engine step, and the one advance of a Mamba2 layer's scan.

Per sequence (a slot) and Mamba2 layer the sampler keeps the fp32 SSM state at the sequence's
last chunk boundary and the inputs since that boundary (``ops.ssd.state.SSDState``), plus the conv
window (``layers.mamba2``). ``ssd_advance`` runs the shared chunked scan from the boundary over
(buffered partial chunk ++ new tokens), emits the new tokens' rows, moves the boundary to the last
full chunk and keeps the rest as the new buffer. Prefill is an advance from an empty slot, decode
an advance by one token, chunked prefill a sequence of advances, recompute after preemption an
advance from an empty slot over the whole history, and the trainer's forward one advance from
empty: one code path, whatever the backend (``ops.backend`` picks the form).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .ops.backend import Backend
from .ops.ssd.state import SSDState, SSMParams


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

    @classmethod
    def from_empty(cls, lengths: list[int]) -> Batch:
        """The trainer's forward: sequences of ``lengths`` in slots 0 .. S-1, each from position 0."""
        return cls.make(list(range(len(lengths))), [0] * len(lengths), lengths)

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


def ssd_advance(backend: Backend, state: SSDState, batch: Batch, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Advance every slot of ``batch`` by its new tokens; returns y [T, H, P] for the new rows.

    x [T, H, P], dt [T, H] raw, B/C [T, G, N] in the model dtype (x, dt and B must have the
    buffers' dtype, so buffering does not round them; ValueError otherwise); rows [T] bool
    (default all): the rows whose outputs are wanted (others are zero, except on the GPU decode
    path, which computes every row of its one-token batch). Updates ``state`` in place.
    """
    return backend.ssd_advance(state, batch, x, dt, B, C, params, rows)


__all__ = ["Batch", "SSDState", "SSMParams", "ssd_advance"]
