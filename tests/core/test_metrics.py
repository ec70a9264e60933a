"""Framework-named mismatch metrics (``aligned_mamba.metrics``): values on a hand-computed case, the report
form, and verl's own ``calculate_debug_metrics`` on the same batch, from the copy of verl that
``scripts/setup`` unpacks into .venv/verl (skipped where it is absent)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

import aligned_mamba
from aligned_mamba import framework_metrics, nemo_rl_metrics, slime_metrics, verify, verl_metrics

LN2, LN4 = math.log(2.0), math.log(4.0)


def _case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences, right-padded; three real tokens, two of them differ:
    seq 0: trainer [-ln2, -ln4], sampler [-ln2, -ln2]  (token 1: p 1/4 vs 1/2, d logprob ln2)
    seq 1: trainer [-ln4, pad],  sampler [-ln2, junk]  (token 0: p 1/4 vs 1/2, d logprob ln2)
    The sequence lengths differ, so slime's per-sample mean differs from a token mean."""
    t = torch.tensor([[-LN2, -LN4, 0.0], [-LN4, 0.0, 0.0]], dtype=torch.float32)
    s = torch.tensor([[-LN2, -LN2, -9.0], [-LN2, -7.0, 5.0]], dtype=torch.float32)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return t, s, mask


def test_hand_computed_values() -> None:
    t, s, mask = _case()
    v = verl_metrics(t, s, mask)
    # probability diffs over the 3 real tokens: 0, 1/4, 1/4
    assert v["training/rollout_probs_diff_valid"] == 1
    assert v["training/rollout_probs_diff_max"] == pytest.approx(0.25, abs=1e-7)
    assert v["training/rollout_probs_diff_mean"] == pytest.approx(1 / 6, abs=1e-7)
    assert v["training/rollout_probs_diff_std"] == pytest.approx(math.sqrt(1 / 48), abs=1e-7)  # Bessel: var 1/48
    assert v["training/rollout_probs_mismatched_tokens"] == 2
    n = nemo_rl_metrics(t, s, mask)
    # exp(|d|) = 1, 2, 2 -> mean 5/3; k3 with logr = trainer - sampler = 0, -ln2, -ln2: e^-ln2 - 1 + ln2
    k3 = 0.5 - 1 + LN2
    assert n["token_mult_prob_error"] == pytest.approx(5 / 3, abs=1e-6)
    assert n["gen_kl_error"] == pytest.approx(2 * k3 / 3, abs=1e-7)
    assert nemo_rl_metrics(t, s, mask, kl_type="k1")["gen_kl_error"] == pytest.approx(2 * LN2 / 3, abs=1e-6)
    assert nemo_rl_metrics(t, s, mask, kl_type="k2")["gen_kl_error"] == pytest.approx(LN2**2 / 3, abs=1e-6)
    # slime: per sample (0 + ln2) / 2 and ln2 / 1, then the mean over samples
    assert slime_metrics(t, s, mask)["train/train_rollout_logprob_abs_diff"] == pytest.approx(0.75 * LN2, abs=1e-6)
    pearson = "training/rollout_actor_probs_pearson_corr"
    assert math.isnan(v[pearson])  # the sampler's probabilities are constant here
    both = framework_metrics(t, s, mask)
    assert math.isnan(both.pop(pearson))
    assert both == {k: x for k, x in {**v, **n, **slime_metrics(t, s, mask)}.items() if k != pearson}


def test_equal_bits_give_the_frameworks_zero_error_values() -> None:
    t, _, mask = _case()
    m = framework_metrics(t, t.clone(), mask)
    assert m["training/rollout_probs_diff_max"] == 0.0 and m["training/rollout_probs_mismatched_tokens"] == 0
    assert m["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-7) and m["gen_kl_error"] == 0.0
    assert m["train/train_rollout_logprob_abs_diff"] == 0.0


def test_from_a_verify_report() -> None:
    t, s, mask = _case()
    equal = framework_metrics(report=verify(t, t.clone(), mask=mask))
    assert equal["aligned_mamba/mismatched_tokens"] == 0 and equal["aligned_mamba/compared_tokens"] == 3
    assert equal["token_mult_prob_error"] == 1.0 and equal["train/train_rollout_logprob_abs_diff"] == 0.0
    differ = framework_metrics(report=verify(t, s, mask=mask))
    assert differ["aligned_mamba/mismatched_tokens"] == 2
    assert differ["aligned_mamba/max_abs_logprob_diff"] == pytest.approx(LN2, abs=1e-6)
    assert "token_mult_prob_error" not in differ  # a summary cannot give it exactly
    with pytest.raises(ValueError, match="not both"):
        framework_metrics(t, s, report=verify(t, s, mask=mask))


def test_no_unmasked_token_and_bad_input() -> None:
    t, s, mask = _case()
    v = verl_metrics(t, s, torch.zeros_like(mask))
    assert v["training/rollout_probs_diff_valid"] == 0 and math.isnan(v["training/rollout_probs_diff_max"])
    with pytest.raises(ValueError, match="one shape"):
        verl_metrics(t, s[:, :2])
    with pytest.raises(ValueError, match="bool or integer 0/1"):
        slime_metrics(t, s, mask.float())
    with pytest.raises(ValueError, match="kl_type"):
        nemo_rl_metrics(t, s, kl_type="k4")
    assert aligned_mamba.metrics.mismatched_tokens(t, s, mask.long()) == 2


VERL_DIR = Path(__file__).resolve().parents[2] / ".venv" / "verl"


def _verl_debug_metrics():
    if not (VERL_DIR / "verl" / "utils" / "debug" / "metrics.py").is_file():
        pytest.skip(f"verl is not unpacked at {VERL_DIR} (scripts/setup puts it there)")
    sys.path.insert(0, str(VERL_DIR))
    try:  # unpacked but not importing is a failure (setup installs what it imports), not a skip
        return importlib.import_module("verl.utils.debug.metrics"), importlib.import_module("verl.protocol")
    finally:
        sys.path.remove(str(VERL_DIR))


def test_verl_metrics_match_verls_own_function() -> None:
    debug, protocol = _verl_debug_metrics()
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    b, n = 4, 9
    t = -torch.rand(b, n, generator=g) * 4
    s = t + torch.randn(b, n, generator=g) * 0.05
    mask = torch.arange(n)[None] < torch.tensor([9, 3, 6, 1])[:, None]
    batch = TensorDict({"old_log_probs": t, "rollout_log_probs": s, "response_mask": mask.long(),
                        "responses": torch.zeros(b, n, dtype=torch.long)}, batch_size=[b])
    theirs = debug.calculate_debug_metrics(protocol.DataProto(batch=batch))
    ours = verl_metrics(t, s, mask)
    assert set(theirs) <= set(ours)
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
