"""Train/rollout mismatch metrics under the names verl, NeMo-RL and slime log, computed in float64 as each
framework does (sources cited per function) from trainer and sampler logprobs, float [B, T] or [T], and a
``mask`` of that shape (bool or 0/1; TypeError / ValueError otherwise). Aligned bits give 0 for every
difference (NeMo-RL's ``token_mult_prob_error``: 1.0).

    m = framework_metrics(trainer_lp, sampler_lp, mask)   # every name, one dict
    m = framework_metrics(report=verify(t, s, mask=mask))  # what a VerifyReport fixes exactly
"""

from __future__ import annotations

from typing import Any

import torch

from .verify import VerifyReport

VERL_MISMATCHED = "training/rollout_probs_mismatched_tokens"  # this project's count, in verl's namespace


def _inputs(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked float64 [B, T] trainer, sampler and bool mask (a [T] input is one sequence)."""
    if not isinstance(trainer, torch.Tensor) or not isinstance(sampler, torch.Tensor):
        raise TypeError(f"expected logprob tensors, got {type(trainer).__name__} and {type(sampler).__name__}")
    if trainer.shape != sampler.shape or trainer.dim() not in (1, 2):
        raise ValueError(f"logprobs must be [T] or [B, T] of one shape, got trainer {list(trainer.shape)} and "
                         f"sampler {list(sampler.shape)}")
    if not (trainer.is_floating_point() and sampler.is_floating_point()):
        raise TypeError(f"logprobs must be floating point, got {trainer.dtype} and {sampler.dtype}")
    if mask is None:
        mask = torch.ones(trainer.shape, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.shape != trainer.shape:
        raise ValueError(f"mask must be a tensor of the logprobs' shape {list(trainer.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must be bool or integer 0/1")
        mask = mask.bool()
    t, s = trainer.detach().double().cpu(), sampler.detach().double().cpu()
    m = mask.cpu()
    return (t, s, m) if t.dim() == 2 else (t[None], s[None], m[None])


def mismatched_tokens(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """Unmasked positions whose logprobs are not equal (``torch.equal`` per token; NaN never equal)."""
    t, s, m = _inputs(trainer, sampler, mask)
    return int(((t != s) & m).sum())


def verl_metrics(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """verl's rollout-vs-actor debug metrics (verl/utils/debug/metrics.py, ``calculate_debug_metrics``).
    trainer: ``old_log_probs``, sampler: ``rollout_log_probs``, mask: ``response_mask``. Over unmasked tokens
    d = |exp(trainer) - exp(sampler)|: ``_max``, ``_mean``, ``_std`` (Bessel: NaN for one token), the Pearson
    correlation of the probabilities; ``_valid`` 0 with NaNs when none is unmasked. Also this project's
    ``training/rollout_probs_mismatched_tokens``: tokens whose logprobs differ at all."""
    t, s, m = _inputs(trainer, sampler, mask)
    out: dict[str, Any] = {VERL_MISMATCHED: int(((t != s) & m).sum())}
    if not bool(m.any()):
        nan = float("nan")
        return {"training/rollout_probs_diff_valid": 0, "training/rollout_probs_diff_max": nan,
                "training/rollout_probs_diff_mean": nan, "training/rollout_probs_diff_std": nan,
                "training/rollout_actor_probs_pearson_corr": nan, **out}
    pt, ps = torch.exp(t)[m], torch.exp(s)[m]
    d = (pt - ps).abs()
    return {"training/rollout_probs_diff_valid": 1,
            "training/rollout_probs_diff_max": float(d.max()),
            "training/rollout_probs_diff_mean": float(d.mean()),
            "training/rollout_probs_diff_std": float(torch.std(d)),
            "training/rollout_actor_probs_pearson_corr": float(torch.corrcoef(torch.stack([pt, ps]))[0, 1]),
            **out}


def nemo_rl_metrics(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None = None,
                    kl_type: str = "k3") -> dict[str, float]:
    """NeMo-RL's generation-vs-training errors (nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossFn;
    ``calculate_kl``, ``masked_mean`` in nemo_rl/algorithms/utils.py). trainer: ``prev_logprobs``, sampler:
    ``generation_logprobs``, mask: token x sample mask. ``token_mult_prob_error``: masked mean of
    exp(|sampler - trainer|); ``gen_kl_error``: masked mean of the ``kl_type`` estimate with logr = trainer -
    sampler (k1 -logr, k2 logr^2 / 2, k3 exp(logr) - 1 - logr; ValueError otherwise). Masked means divide by
    (unmasked tokens + 1e-8), unclamped."""
    t, s, m = _inputs(trainer, sampler, mask)
    denom = float(m.sum()) + 1e-8
    # masked positions add 0 (NeMo-RL multiplies by the mask, which NaN / inf padding would survive)
    mult = float(torch.where(m, torch.exp((s - t).abs()), torch.zeros_like(t)).sum()) / denom
    logr = t - s
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl_type {kl_type!r} refused: expected k1, k2 or k3")
    return {"token_mult_prob_error": mult,
            "gen_kl_error": float(torch.where(m, kl, torch.zeros_like(kl)).sum()) / denom}


def slime_metrics(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """slime's (and miles') ``train/train_rollout_logprob_abs_diff`` (slime/backends/megatron_utils/loss.py,
    reduced by cp_utils.py's ``get_sum_of_sample_mean``): each row's masked mean of |trainer - sampler|
    (denominator clamped to >= 1), averaged over rows (samples)."""
    t, s, m = _inputs(trainer, sampler, mask)
    mf = m.double()
    d = torch.where(m, (t - s).abs(), torch.zeros_like(t))
    per_sample = d.sum(1) / mf.sum(1).clamp_min(1)
    return {"train/train_rollout_logprob_abs_diff": float(per_sample.mean())}


def framework_metrics(trainer: torch.Tensor | None = None, sampler: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None, *, report: VerifyReport | None = None) -> dict[str, Any]:
    """Every framework's names in one dict, from logprobs (+ mask) or from a ``verify`` report. From a report:
    ``aligned_mamba/mismatched_tokens``, ``/compared_tokens``, ``/max_abs_logprob_diff``,
    ``/mean_abs_logprob_diff``, and the frameworks' names only when it is bitwise equal (a summary fixes them
    then only). ValueError unless exactly one of logprobs and ``report`` is given."""
    if report is not None:
        if trainer is not None or sampler is not None or mask is not None:
            raise ValueError("pass either logprobs (trainer, sampler, mask) or report=, not both")
        if not isinstance(report, VerifyReport):
            raise TypeError(f"report must be a VerifyReport, got {type(report).__name__}")
        compared = report.rows - report.masked_rows
        out: dict[str, Any] = {"aligned_mamba/mismatched_tokens": report.mismatched_rows,
                               "aligned_mamba/compared_tokens": compared,
                               "aligned_mamba/max_abs_logprob_diff": report.max_abs_logprob_diff,
                               "aligned_mamba/mean_abs_logprob_diff": report.mean_abs_logprob_diff}
        if report.bitwise_equal and compared:
            out.update({"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": 0.0,
                        "training/rollout_probs_diff_mean": 0.0, VERL_MISMATCHED: 0,
                        "token_mult_prob_error": 1.0, "gen_kl_error": 0.0,
                        "train/train_rollout_logprob_abs_diff": 0.0})
        return out
    if trainer is None or sampler is None:
        raise ValueError("framework_metrics needs trainer and sampler logprobs, or report=")
    return {**verl_metrics(trainer, sampler, mask), **nemo_rl_metrics(trainer, sampler, mask),
            **slime_metrics(trainer, sampler, mask)}


__all__ = ["framework_metrics", "mismatched_tokens", "nemo_rl_metrics", "slime_metrics", "verl_metrics"]
