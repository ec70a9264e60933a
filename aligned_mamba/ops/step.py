"""One engine step (``Step``) and its tables per device (``StepPlan``): built once a step, read by every layer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from .attention.blocked import CacheTables
    from .attention.triton import StepTables
    from .ssd.chunk import ChunkGrid
    from .ssd.decode import DecodePlan
    from .ssd.plan import AdvancePlan

K = TypeVar("K")
V = TypeVar("V")


@dataclass(eq=False)
class StepPlan:
    """A step's tables on one device: cu_seqlens [S+1] and slots [S] int64, then per form a map from the constants
    its tables depend on (chunk size L, row tile R, heads H, groups G, query heads per KV head rep), via ``once``."""

    device: torch.device
    cu_seqlens: torch.Tensor
    slots: torch.Tensor
    #: (L, R, H, G) -> the torch decode form's layout (``ssd/decode.py``)
    ssd_decode: dict[tuple[int, int, int, int], DecodePlan] = field(default_factory=dict)
    #: (L, R) -> the Triton scan's plan, on the host and on the device (``ssd/triton_chunk.py``)
    ssd_chunk: dict[tuple[int, int], tuple[AdvancePlan, AdvancePlan]] = field(default_factory=dict)
    #: L -> the Triton decode's slots, chunk positions, whether a chunk may complete (``ssd/triton_decode.py``)
    ssd_decode_tables: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = field(default_factory=dict)
    #: L -> the chunk grid of the scan's gradient (``ssd/triton_backward.py``)
    chunk_grid: dict[int, ChunkGrid] = field(default_factory=dict)
    #: rep -> the torch attention form's cache tables (``attention/blocked.py``)
    attention_cache: dict[int, CacheTables] = field(default_factory=dict)
    #: rep -> the Triton attention's write positions and tiles (``attention/triton.py``); a decode step's at 0
    attention_tiles: dict[int, StepTables] = field(default_factory=dict)
    #: tables all given up front (a captured decode step): building one from placeholder fields is refused
    sealed: bool = False

    def once(self, table: dict[K, V], key: K, build: Callable[[], V]) -> V:
        """``table[key]``, built by ``build()`` the first time it is asked for."""
        if key not in table:
            if self.sealed:
                raise RuntimeError(f"a captured decode step has no table for {key!r}: it would be built from the "
                                   "host's placeholder fields")
            table[key] = build()
        return table[key]


@dataclass(frozen=True)
class Step:
    """One advance: S sequences, each with n_i new tokens packed in order; immutable, shared by every layer.

    slots [S] int64 (distinct), start_pos [S] int64 (tokens consumed), cu_seqlens [S+1] int64; all on the CPU.
    Derived: lengths [S], num_tokens T, decode_only (one token each), plans (device -> ``StepPlan``, made on use).
    """

    slots: torch.Tensor
    start_pos: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor = field(init=False, repr=False, compare=False)
    num_tokens: int = field(init=False, repr=False, compare=False)
    decode_only: bool = field(init=False, repr=False, compare=False)
    plans: dict[torch.device, StepPlan] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        set_ = functools.partial(object.__setattr__, self)  # frozen: the derived fields are set once, here
        set_("lengths", lengths)
        set_("num_tokens", int(self.cu_seqlens[-1]))
        set_("decode_only", self.slots.numel() > 0 and bool((lengths == 1).all()))
        set_("plans", _Plans(self))

    @classmethod
    def make(cls, slots: list[int], start_pos: list[int], new_tokens: list[int]) -> Step:
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one step: {slots}")
        if any(n <= 0 for n in new_tokens) or any(p < 0 for p in start_pos):
            raise ValueError("every sequence in a step needs >= 1 new token and a position >= 0")
        cu = [0]
        for n in new_tokens:
            cu.append(cu[-1] + n)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(slots=t(slots), start_pos=t(start_pos), cu_seqlens=t(cu))

    @classmethod
    def from_empty(cls, lengths: list[int]) -> Step:
        """The trainer's forward: sequences of ``lengths`` in slots 0 .. S-1, each from position 0."""
        return cls.make(list(range(len(lengths))), [0] * len(lengths), lengths)



class _Plans(dict):
    """A step's plans by device, a missing one made on first use (cu_seqlens and slots in one copy)."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.step = step

    def __missing__(self, dev: torch.device) -> StepPlan:
        s, n = self.step, self.step.slots.numel()
        if dev.type == "cpu":
            cu, slots = s.cu_seqlens.to(torch.int64), s.slots.to(torch.int64)
        else:
            t = torch.cat([s.cu_seqlens, s.slots]).to(torch.int64)
            t = (t.pin_memory() if dev.type == "cuda" else t).to(dev, non_blocking=True)
            cu, slots = t[:n + 1], t[n + 1:]
        plan = self[dev] = StepPlan(dev, cu, slots)
        return plan


__all__ = ["Step", "StepPlan"]
