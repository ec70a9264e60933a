"""What a layer kind provides: its per-slot state (a ``StateSpec``) and ``advance(state, batch,
hidden, rows)``, the one forward every schedule runs (docs/design.md, "The one idea"); a state
that grows with the sequence gives its length as ``MAX_LEN``, which the allocator supplies."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..ops.step import Step

MAX_LEN = -1
"""A per-slot shape entry standing for the maximum sequence length, resolved when the state is
allocated (a layer's state that holds one row per token, e.g. attention's keys and values)."""


@dataclass(frozen=True)
class StateSpec:
    """The tensors one sequence slot holds in a layer: name -> (per-slot shape, dtype), in order;
    ``allocate`` makes ``[num_slots, *shape]`` of each, or an engine hands out views of its memory."""

    fields: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @property
    def per_length(self) -> bool:
        """Whether a field grows with the sequence (a ``MAX_LEN`` entry)."""
        return any(MAX_LEN in shape for _, shape, _ in self.fields)

    def shapes(self, max_len: int | None = None) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
        """The fields with ``MAX_LEN`` replaced by ``max_len`` (ValueError if one needs it and it is None)."""
        if self.per_length and (max_len is None or max_len < 1):
            raise ValueError(f"this state holds one row per token: it needs a maximum sequence length >= 1, "
                             f"got {max_len!r}")
        return tuple((name, tuple(max_len if d == MAX_LEN else d for d in shape), dt)
                     for name, shape, dt in self.fields)

    def allocate(self, num_slots: int, device: torch.device | str,
                 max_len: int | None = None) -> dict[str, torch.Tensor]:
        """Zeroed ``[num_slots, *shape]`` tensors, one per field (a zero state is an empty sequence)."""
        return {name: torch.zeros(num_slots, *shape, dtype=dt, device=device)
                for name, shape, dt in self.shapes(max_len)}

    def bytes_per_slot(self, max_len: int | None = None) -> int:
        """Resident bytes one sequence holds (at ``max_len`` tokens, for a ``per_length`` spec)."""
        return sum(math.prod(shape) * dt.itemsize for _, shape, dt in self.shapes(max_len))


class Layer(Protocol):
    """A layer kind. ``state_spec()`` is None for layers that keep nothing per sequence."""

    kind: str

    def state_spec(self) -> StateSpec | None: ...

    def state(self, tensors: Mapping[str, torch.Tensor]) -> Any: ...

    def advance(self, state: Any, batch: Step, hidden: torch.Tensor, rows: torch.Tensor | None = None,
                capture: list | None = None) -> torch.Tensor: ...


class Stateless:
    """The state half of ``Layer`` for a kind that keeps nothing per sequence (MLP, MoE)."""

    def state_spec(self) -> StateSpec | None:
        return None

    def state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        return None


def take(tensors: Mapping[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    """``tensors[prefix + name]``; KeyError naming the full name when absent."""
    key = prefix + name
    if key not in tensors:
        raise KeyError(f"missing weight {key!r}")
    return tensors[key]


def take_optional(tensors: Mapping[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor | None:
    return tensors.get(prefix + name)
