"""The reference trainer and engine under tensor parallelism: what each rank runs.

Each rank builds its part from the full tensors and runs the same work in lock-step (the schedule depends
on the scenario alone, the sampled tokens on full logits rows, so the all-gathers line up); rank 0's rows
are returned. Module-level functions, so that spawned processes can unpickle them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .contract import Contract
from .integrations import EngineSpec, Scenario, ScenarioResult
from .models import CausalLM, build_model
from .parallel import Ranks, TPGroup, rank_state


def build(group: TPGroup, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, *,
          stock: bool = False) -> CausalLM:
    """This rank's model (``stock``: row-parallel partials summed as stock TP does, the baseline)."""
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
    """The reference engine's scenario at this rank (``exact_replay=False``: the recurrent baseline)."""
    from .engine import ReferenceEngine

    model = build(group, config, tensors, contract)
    return ReferenceEngine.for_model(model, exact_replay=exact_replay).run(scenario)


def tp_control(config: Any, tensors: dict[str, torch.Tensor], contract: Contract, size: int,
               sequences: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Whether TP could have shown a mismatch here: stock TP (``baseline.stock_tp_model``) at ``size`` against
    TP 1 on the same inputs. JSON-ready: degree, rows, stock_mismatched_rows, could_fail."""
    from .parallel import launch

    one = forward(TPGroup.single(), config, tensors, contract, sequences, True)
    many = launch(forward, size, config, tensors, contract, list(sequences), True)
    differ = sum(int((a != b).any(dim=-1).sum()) for a, b in zip(one, many))
    rows = sum(int(a.shape[0]) for a in one)
    return {"degree": size, "rows": rows, "stock_mismatched_rows": differ, "could_fail": differ > 0}


# -- kept in the ranks (``parallel.Ranks``): the model built once per rank --------------------------------


def load(group: TPGroup, key: str, config: Any, tensors: dict[str, torch.Tensor], contract: Contract) -> None:
    """Build this rank's model and keep it under ``key``."""
    rank_state()[key] = build(group, config, tensors, contract)


def load_source_rank(group: TPGroup, key: str, source: str, dtype: str | None, contract: Contract) -> None:
    """``load`` from a model source ("tiny" or a checkpoint directory) that each rank reads itself."""
    from .models import load_source

    config, tensors = load_source(source, dtype)
    load(group, key, config, tensors, contract)


def forward_kept(group: TPGroup, key: str, sequences: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kept model's one-pass logits of whole sequences."""
    return rank_state()[key].forward(list(sequences))


def run_kept(group: TPGroup, key: str, scenario: Scenario, exact_replay: bool) -> ScenarioResult:
    """The reference engine's scenario over the kept model (``exact_replay=False``: the baseline)."""
    from .engine import ReferenceEngine

    result = ReferenceEngine.for_model(rank_state()[key], exact_replay=exact_replay).run(scenario)
    result.info["tp"] = group.size
    return result


# -- training at TP > 1: a ``train.PolicyTrainer`` in every rank over its group ----------------------------------


def load_policy(group: TPGroup, key: str, config: Any, tensors: dict[str, torch.Tensor], contract: Contract,
                lr: float) -> None:
    """Keep this rank's ``PolicyTrainer`` (whole fp32 masters and Adam's state, its model over ``group``) under
    ``key``."""
    from .train import PolicyTrainer

    rank_state()[key] = PolicyTrainer(config, tensors, contract, lr=lr, tp=group)


def policy_forward(group: TPGroup, key: str, sequences: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The kept policy's one-pass logits of whole sequences, on its served weights."""
    return rank_state()[key].forward(list(sequences))


def policy_step(group: TPGroup, key: str, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                advantages: Sequence[float]) -> dict[str, Any]:
    return rank_state()[key].step(sequences, prompt_lens, advantages)


def policy_weights(group: TPGroup, key: str) -> dict[str, torch.Tensor]:
    return rank_state()[key].weights()


def policy_gradients(group: TPGroup, key: str) -> dict[str, torch.Tensor]:
    """The last step's gradients, summed over ranks (fp32, whole; empty before a step)."""
    master = rank_state()[key].master or {}
    return {k: v.grad.detach().clone() for k, v in master.items() if v.grad is not None}


class TPTrainer:
    """The reference trainer (``train.PolicyTrainer``'s REINFORCE and Adam) at TP ``size``, over ``size`` gloo
    rank processes: ``forward``, ``token_logprobs`` and ``step`` run in every rank, rank 0's result returned.
    Gradients match TP 1's to fp32 rounding (their sums run in another order); the logits are TP 1's bits."""

    def __init__(self, config: Any, tensors: dict[str, torch.Tensor], contract: Contract, size: int, *,
                 lr: float = 1e-4) -> None:
        from .parallel import check_tp
        from .train import check_lr

        check_lr(lr)
        check_tp(contract, config, size)  # refused here, before any process starts
        self.contract = contract
        self.version = 0
        self.size = size
        self.ranks = Ranks(size)
        self.ranks.call(load_policy, "trainer", config, tensors, contract, lr)

    def forward(self, sequences: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Raw logits of whole sequences in one pass at TP ``size``: [len_i] -> [len_i, vocab]."""
        return self.ranks.call(policy_forward, "trainer", [s.to(torch.int64) for s in sequences])

    def token_logprobs(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
                       temperature: float = 1.0) -> list[torch.Tensor]:
        """float32 logprob of each generated token under the one-pass logits: [len_i - prompt_len_i]."""
        from .train import generated_logprobs

        return generated_logprobs(self.forward(sequences), sequences, prompt_lens, temperature,
                                  contract=self.contract)

    def step(self, sequences: Sequence[torch.Tensor], prompt_lens: Sequence[int],
             advantages: Sequence[float]) -> dict[str, Any]:
        """One REINFORCE step in every rank. Returns loss, tokens, grad_norm and weights_version."""
        from .train import check_step_inputs

        check_step_inputs(sequences, prompt_lens, advantages)
        stats = self.ranks.call(policy_step, "trainer", list(sequences), list(prompt_lens), list(advantages))
        self.version = stats["weights_version"]
        return stats

    def weights(self) -> dict[str, torch.Tensor]:
        """The served weights, whole (rank 0's copy; every rank holds the same)."""
        return self.ranks.call(policy_weights, "trainer")

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last step's gradients of the loss, whole and fp32, as every rank applied them."""
        return self.ranks.call(policy_gradients, "trainer")

    def export_bytes(self) -> tuple[bytes, str]:
        """The served weights as safetensors bytes (version in the metadata) and their digest."""
        from .train import export_weights

        return export_weights(self.weights(), self.version)

    def close(self) -> None:
        self.ranks.close()


class TPReferenceEngine:
    """The reference ``integrations.Engine`` at TP ``spec.tp``: gloo rank processes, each loading the spec's
    source, run every scenario in lock-step; rank 0's result is returned."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.contract = Contract.from_dict(spec.contract)
        self.ranks = Ranks(spec.tp)
        self.ranks.call(load_source_rank, "engine", spec.model, spec.dtype, self.contract)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        from .models import load_source

        config, _ = load_source(self.spec.model, self.spec.dtype)
        self.ranks.call(load, "engine", config, tensors, self.contract)

    def run(self, scenario: Scenario, on_step: Any = None) -> ScenarioResult:
        """The scenario in every rank; ``on_step`` is never called (the steps run in the rank processes)."""
        result = self.ranks.call(run_kept, "engine", scenario, self.spec.exact_replay)
        result.pid = -1  # computed in the rank processes, not here
        return result

    def close(self) -> None:
        self.ranks.close()


__all__ = ["TPReferenceEngine", "TPTrainer", "build", "forward", "forward_kept", "load",
           "load_policy", "load_source_rank", "policy_forward", "policy_gradients", "policy_step",
           "policy_weights",
           "run_kept", "run_scenario", "tp_control"]
