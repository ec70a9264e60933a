"""The reference trainer and engine under tensor parallelism: what each rank runs.

Every rank builds the model from the full checkpoint's tensors with its ``TPGroup`` (cutting its
part itself) and runs the same work in lock-step: the trainer's one-pass forward, or the reference
engine's whole scenario (its schedule depends on the scenario alone, and the sampled tokens on the
logits, which every rank holds in full, so the ranks' all-gathers line up). Every rank returns the
same rows; ``parallel.launch`` and ``parallel.Ranks`` hand back rank 0's. The functions are module
level so that spawned processes can unpickle them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .contract import Contract
from .integrations import Scenario, ScenarioResult
from .models import CausalLM, build_model
from .parallel import TPGroup


def build(group: TPGroup, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, *,
          stock: bool = False) -> CausalLM:
    """This rank's model (``stock``: its row-parallel GEMMs summed as stock tensor parallelism does,
    ``baseline.stock_tp_model``)."""
    model = build_model(config, tensors, contract, tp=group)
    if stock:
        from .baseline import stock_tp_model

        model = stock_tp_model(model)
    return model


def forward(group: TPGroup, config: Any, tensors: dict[str, torch.Tensor], contract: Contract,
            sequences: Sequence[torch.Tensor], stock: bool = False) -> list[torch.Tensor]:
    """The trainer's logits of whole sequences at this rank's degree: [len_i] -> [len_i, vocab]."""
    return build(group, config, tensors, contract, stock=stock).forward(list(sequences))


def run_scenario(group: TPGroup, config: Any, tensors: dict[str, torch.Tensor], contract: Contract,
                 scenario: Scenario, exact_replay: bool = True) -> ScenarioResult:
    """The reference engine's scenario at this rank's degree (``exact_replay=False``: the baseline's
    recurrent decode)."""
    from .engine import ReferenceEngine

    model = build(group, config, tensors, contract)
    return ReferenceEngine.for_model(model, exact_replay=exact_replay).run(scenario)


__all__ = ["build", "forward", "run_scenario"]
