"""The baseline: a model decoding as engines do today, to show the mismatch exact replay removes.

Each Mamba2 layer keeps the running fp32 state (no boundary, no buffer): a one-token step takes the
recurrent update, a longer one a chunked scan anchored at the call's start; every other op is the model's.
Only ``aligned-mamba check`` and the tests use it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .layers.base import StateSpec
from .layers.mamba2 import Mamba2Mixer
from .models.causal_lm import Block, CausalLM
from .ops.ssd import SSMParams, recurrent_step, ssd_chunk
from .ops.step import Step
from .parallel import TPGroup


@dataclass
class RunningState:
    """ssm_state [slots, H, P, N] float32 at each slot's last token; conv_window as the replay state's."""

    ssm_state: torch.Tensor
    conv_window: torch.Tensor

    @property
    def ssd(self) -> RunningState:
        """What the mixer hands its backend's ``ssd_advance``: this state itself."""
        return self


class RecurrentMamba2Mixer(Mamba2Mixer):
    """A ``Mamba2Mixer`` on the same weights whose backend's ``ssd_advance`` is the baseline's."""

    def __init__(self, mixer: Mamba2Mixer) -> None:  # shares the mixer's weights
        self.__dict__.update(mixer.__dict__)
        self.backend = mixer.backend.replace(ssd_advance=self._advance)

    def state_spec(self) -> StateSpec:
        c = self.config
        return StateSpec((("ssm_state", (c.num_heads, c.head_dim, c.state_size), torch.float32),
                          ("conv_window", (c.conv_kernel - 1, c.conv_dim), self.dtype)))

    def state(self, tensors: Mapping[str, torch.Tensor]) -> RunningState:
        return RunningState(tensors["ssm_state"], tensors["conv_window"])

    def _advance(self, state: RunningState, batch: Step, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, params: SSMParams, rows: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.zeros_like(x)
        lens = batch.lengths
        seq = torch.repeat_interleave(torch.arange(lens.numel()), lens)
        one = lens == 1
        if one.any():  # decode: the recurrent update, the state rounded nowhere but updated in place
            r = one[seq]
            sl = batch.slots[one]
            s = state.ssm_state[sl].clone()
            y[r] = recurrent_step(s, x[r], dt[r], B[r], C[r], params)
            state.ssm_state[sl] = s
        if (~one).any():  # prefill: a chunked scan anchored at the call's first token
            r = (~one)[seq]
            sl = batch.slots[~one]
            cu = torch.zeros(int((~one).sum()) + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(lens[~one], 0)
            yp, h = ssd_chunk(x[r], dt[r], B[r], C[r], params, cu, state.ssm_state[sl],
                              chunk_size=self.chunk_size, row_tile=self.backend.configs.scan_row_tile(self.chunk_size),
                              final="end")
            y[r] = yp
            state.ssm_state[sl] = h
        return y


def baseline_model(model: CausalLM) -> CausalLM:
    """``model`` with every Mamba2 mixer decoding as the baseline (the same weight tensors)."""
    blocks = [Block(norm=b.norm, mixer=RecurrentMamba2Mixer(b.mixer) if isinstance(b.mixer, Mamba2Mixer) else b.mixer)
              for b in model.blocks]
    out = CausalLM.__new__(CausalLM)
    out.__dict__.update(model.__dict__)
    out.blocks = blocks
    return out


def stock_row_parallel(x: torch.Tensor, w: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | None = None, *,
                       slices: int, group: TPGroup, partial: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       tree: object = None) -> torch.Tensor:
    """Stock row-parallel GEMM (Megatron's RowParallelLinear, vLLM's) with ``row_parallel_linear``'s signature:
    each rank's partial rounded to the model dtype and summed as an all-reduce (rank order), then the bias.
    ``slices`` and ``tree`` are ignored, so TP 2 rounds otherwise than TP 1."""
    ws = w if isinstance(w, torch.Tensor) else torch.cat(list(w), dim=1)
    parts = group.all_gather(partial(x, ws).to(x.dtype))
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out if b is None else out + b.to(out.dtype)


def stock_tp_model(model: CausalLM) -> CausalLM:
    """``model`` (same weights and group) with every row-parallel GEMM as ``stock_row_parallel``: the
    baseline for the mismatch across TP degrees."""
    blocks = []
    for b in model.blocks:
        mixer = b.mixer
        if hasattr(mixer, "row_parallel") and getattr(mixer, "sliced", False):
            mixer = copy.copy(mixer)
            mixer.row_parallel = stock_row_parallel
        elif hasattr(mixer, "with_row_parallel") and mixer.sliced:  # a MoE layer: its experts' down projections
            mixer = mixer.with_row_parallel(stock_row_parallel)
        blocks.append(Block(norm=b.norm, mixer=mixer))
    out = CausalLM.__new__(CausalLM)
    out.__dict__.update(model.__dict__)
    out.blocks = blocks
    return out


__all__ = ["RecurrentMamba2Mixer", "RunningState", "baseline_model", "stock_row_parallel", "stock_tp_model"]
