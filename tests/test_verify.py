"""verify: bitwise verdict per row, refusals, report figures and rendering."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignmentError, ContractMismatchError
from aligned_mamba.verify import VerifyReport, verify

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _flip_lowest_bit(x: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    """Copy of x with the lowest mantissa bit of x[index] flipped."""
    y = x.clone()
    bits = y.view(_INT_VIEW[x.dtype])
    bits[index] ^= 1
    return y


def _logits(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def test_equal_tensors() -> None:
    x = _logits(8, 50)
    r = verify(x, x.clone())
    assert r and r.bitwise_equal and r.rows == 8 and r.mismatched_rows == 0 and r.first_mismatch is None
    assert (r.max_abs_diff, r.max_abs_logprob_diff, r.mean_abs_logprob_diff, r.kl) == (0.0, 0.0, 0.0, 0.0)
    assert (r.shape, r.dtype, r.kind, r.fingerprint) == ([8, 50], "float32", "logits", None)
    d = json.loads(r.to_json())
    assert d["bitwise_equal"] is True and d["rows"] == 8 and d["mismatched_row_indices"] == []
    assert r.mismatch_map(4) == "...." and r.summary().startswith("bitwise equal: 8/8 rows")


def test_negative_zero_counts_as_equal() -> None:
    # torch.equal is value equality: -0.0 == 0.0.
    assert verify(torch.zeros(2, 4), -torch.zeros(2, 4)).bitwise_equal


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_flipped_bit(dtype: torch.dtype) -> None:
    x = _logits(16, 40, dtype=dtype)
    y = _flip_lowest_bit(x, (11, 7))
    r = verify(x, y)
    assert not r and r.mismatched_rows == 1 and r.first_mismatch == 11 and r.mismatched_row_indices == [11]
    assert r.max_abs_diff == abs(float(x[11, 7]) - float(y[11, 7])) > 0
    # One ulp of one logit may or may not survive log_softmax's rounding; either way it is tiny.
    assert 0 <= r.max_abs_logprob_diff <= 2 * r.max_abs_diff + 1e-6 and abs(r.kl) < 1e-6
    assert r.dtype == str(dtype).removeprefix("torch.")
    assert "1/16 rows differ (first row 11)" in r.summary()


def test_batched_logits_flatten_rows() -> None:
    x = _logits(3, 5, 20)
    y = _flip_lowest_bit(x, (2, 1, 0))
    r = verify(x, y)
    assert r.rows == 15 and r.mismatched_row_indices == [2 * 5 + 1] and r.shape == [3, 5, 20]


def test_logprob_inputs() -> None:
    lp = torch.log_softmax(_logits(4, 6, 30), -1).amax(-1)  # [B, T] per-token logprobs
    r = verify(lp, lp.clone(), kind="logprobs")
    assert r and r.rows == 24 and r.kind == "logprobs"
    lp1 = lp[0].clone()
    assert verify(lp1, lp1.clone()).kind == "logprobs"  # auto: 1-D means logprobs
    other = lp1.clone()
    other[3] -= 0.5
    r = verify(lp1, other)
    assert r.mismatched_row_indices == [3]
    assert r.max_abs_logprob_diff == pytest.approx(0.5) and r.mean_abs_logprob_diff == pytest.approx(0.5 / 6)
    # k3 with d = lp_trainer - lp_sampler = +0.5 at one of 6 tokens.
    assert r.kl == pytest.approx((math.exp(0.5) - 0.5 - 1) / 6)


def test_nan_rows_fail_closed() -> None:
    x = _logits(6, 10)
    y = x.clone()
    y[2, 3] = float("nan")
    both = x.clone()
    both[4, 0] = float("nan")
    r = verify(x, y)
    assert not r and r.nan_rows == 1 and r.mismatched_row_indices == [2]
    r = verify(both, both.clone())  # NaN in both at the same place: still not equal
    assert not r and r.nan_rows == 1 and r.mismatched_row_indices == [4] and r.nan_row_indices == [4]
    assert r.kl == 0.0 and r.max_abs_logprob_diff == 0.0  # NaN rows are left out of the figures
    assert r.mismatch_map(6) == "....!." and json.loads(r.to_json())["nan_rows"] == 1


def test_refusals_name_both_values() -> None:
    x = _logits(4, 8)
    with pytest.raises(ValueError, match=r"\[4, 8\].*\[4, 9\]"):
        verify(x, _logits(4, 9))
    with pytest.raises(ValueError, match="float32.*bfloat16.*refused, not compared"):
        verify(x, x.to(torch.bfloat16))
    with pytest.raises(ContractMismatchError, match="fingerprint trainer='aaaaaaaaaaaa' sampler='bbbbbbbbbbbb'"):
        verify(x, x, trainer_contract="aaaaaaaaaaaa", sampler_contract="bbbbbbbbbbbb")
    with pytest.raises(ContractMismatchError, match="chunk_size trainer=128 sampler=256"):
        verify(x, x, trainer_contract=Contract(128), sampler_contract=Contract(256))
    # Contracts are checked before anything else, even before shapes.
    with pytest.raises(ContractMismatchError):
        verify(x, _logits(4, 9), trainer_contract=Contract(128), sampler_contract=Contract(256).fingerprint)
    with pytest.raises(ValueError, match="kind"):
        verify(x, x, kind="probs")
    with pytest.raises(ValueError, match="token_ids"):
        verify(x, x, token_ids=torch.zeros(5, dtype=torch.int64))


def test_matching_contracts_record_fingerprint() -> None:
    x = _logits(2, 8)
    c = Contract(256)
    assert verify(x, x, trainer_contract=c, sampler_contract=Contract(256)).fingerprint == c.fingerprint
    assert verify(x, x, trainer_contract=c, sampler_contract=c.fingerprint).fingerprint == c.fingerprint


def test_strict_raises_with_report() -> None:
    x = _logits(4, 8)
    assert verify(x, x, strict=True)
    with pytest.raises(AlignmentError) as e:
        verify(x, _flip_lowest_bit(x, (1, 1)), strict=True)
    report = e.value.report
    assert isinstance(report, VerifyReport) and report.first_mismatch == 1 and str(e.value) == report.summary()


def test_kl_zero_when_equal_positive_when_perturbed() -> None:
    x = _logits(32, 64)
    assert verify(x, x.clone()).kl == 0.0
    y = x + 0.1 * _logits(32, 64, seed=1)
    r = verify(x, y)
    assert r.kl > 0 and r.mismatched_rows == 32
    # KL(sampler || trainer), mean over rows.
    lt, ls = torch.log_softmax(x.double(), -1), torch.log_softmax(y.double(), -1)
    assert r.kl == pytest.approx(float((ls.exp() * (ls - lt)).sum(-1).mean()), rel=1e-4)


def test_token_ids_figures() -> None:
    x = _logits(2, 3, 16)
    y = x.clone()
    y[1, 2, 5] += 1.0
    tok = torch.tensor([[0, 1, 2], [3, 4, 5]])
    r = verify(x, y, token_ids=tok)
    lt = torch.log_softmax(x[1, 2], -1)[5]
    ls = torch.log_softmax(y[1, 2], -1)[5]
    d = float(lt) - float(ls)
    assert r.mismatched_row_indices == [5]
    assert r.max_abs_logprob_diff == pytest.approx(abs(d), rel=1e-4)
    assert r.mean_abs_logprob_diff == pytest.approx(abs(d) / 6, rel=1e-4)
    assert r.kl == pytest.approx((math.exp(d) - d - 1) / 6, rel=1e-3)
    with pytest.raises(ValueError, match="out of range"):
        verify(x, y, token_ids=tok + 16)


def test_empty_inputs() -> None:
    for x in (torch.empty(0, 7), torch.empty(2, 0, 7), torch.empty(0)):
        r = verify(x, x.clone())
        assert r.bitwise_equal and r.rows == 0 and r.mismatch_map() == "" and json.loads(r.to_json())["rows"] == 0


def test_mismatch_map_characters() -> None:
    x = _logits(10, 4)
    y = x.clone()
    y[0:2] += 1  # bucket 0 (rows 0-1): all differ
    y[3] += 1  # bucket 1 (rows 2-3): some differ
    y[9, 0] = float("nan")  # bucket 4 (rows 8-9): NaN
    r = verify(x, y)
    assert r.mismatch_map(width=5) == "Xx..!"
    assert len(r.mismatch_map(width=64)) == 10 and r.mismatch_map(width=3) == "x.!"  # 4 rows per char


def test_non_finite_figures_serialise_as_null() -> None:
    x = _logits(2, 4)
    y = x.clone()
    y[0, 1] = float("-inf")  # a masked logit on one side only: infinite logprob gap
    r = verify(x, y)
    assert r.max_abs_logprob_diff == math.inf and r.max_abs_diff == 0.0  # no finite element differs
    d = json.loads(r.to_json())
    assert d["max_abs_logprob_diff"] is None and d["mismatched_rows"] == 1


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 9),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    data=st.data(),
)
def test_property_exact_perturbed_set(rows: int, width: int, dtype: torch.dtype, data: st.DataObject) -> None:
    x = _logits(rows, width, dtype=dtype, seed=rows * 31 + width)
    picked = data.draw(st.sets(st.integers(0, rows - 1)))
    y = x.clone()
    bits = y.view(_INT_VIEW[dtype])
    for r in picked:
        bits[r, data.draw(st.integers(0, width - 1))] ^= 1
    rep = verify(x, y)
    assert rep.mismatched_row_indices == sorted(picked)
    assert rep.bitwise_equal == (not picked) and rep.first_mismatch == (min(picked) if picked else None)
    assert rep.max_abs_diff == float((x.double() - y.double()).abs().max())
