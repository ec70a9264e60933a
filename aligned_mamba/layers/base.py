"""What a layer kind provides: its per-slot state (a spec an engine can allocate) and one advance.

A layer kind is one module in this package: its config, its weights read from a state dict under
a prefix, the state it keeps per sequence slot, and ``advance(state, batch, hidden, rows)``, the
one forward that prefill, chunked prefill, decode, recompute and the trainer's pass all run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..replay import Batch


@dataclass(frozen=True)
class StateSpec:
    """The tensors one sequence slot holds in a layer: name -> (per-slot shape, dtype), in order.

    An engine allocates ``[num_slots, *shape]`` of each (``allocate``), or hands out slot-indexed
    views of memory it owns (vLLM's Mamba cache); ``Layer.state(tensors)`` wraps either.
    """

    fields: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    def allocate(self, num_slots: int, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Zeroed ``[num_slots, *shape]`` tensors, one per field (a zero state is an empty sequence)."""
        return {name: torch.zeros(num_slots, *shape, dtype=dt, device=device) for name, shape, dt in self.fields}

    def bytes_per_slot(self) -> int:
        """Resident bytes one sequence holds."""
        return sum(math.prod(shape) * dt.itemsize for _, shape, dt in self.fields)


class Layer(Protocol):
    """A layer kind. ``state_spec()`` is None for layers that keep nothing per sequence."""

    kind: str

    def state_spec(self) -> StateSpec | None: ...

    def state(self, tensors: Mapping[str, torch.Tensor]) -> Any: ...

    def advance(self, state: Any, batch: Batch, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor: ...


def take(tensors: Mapping[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    """``tensors[prefix + name]``; KeyError naming the full name when absent."""
    key = prefix + name
    if key not in tensors:
        raise KeyError(f"missing weight {key!r}")
    return tensors[key]


def take_optional(tensors: Mapping[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor | None:
    return tensors.get(prefix + name)
