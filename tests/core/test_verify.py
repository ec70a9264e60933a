"""verify: bitwise verdict per row (value and bit-pattern modes), refusals (ambiguous kinds,
other hardware), report figures, digests and rendering."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignmentError, ContractMismatchError, HardwareMismatchError
from aligned_mamba.hardware import HardwareClass
from aligned_mamba.ops.logprobs import log_softmax
from aligned_mamba.verify import AUTO_MIN_VOCAB, VerifyReport, rows_digest, verify

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
    r = verify(x, y, kind="logits")
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
    r = verify(x, y, kind="logits")
    assert not r and r.nan_rows == 1 and r.mismatched_row_indices == [2]
    r = verify(both, both.clone(), kind="logits")  # NaN in both at the same place: still not equal
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
        verify(x, x, kind="logits", token_ids=torch.zeros(5, dtype=torch.int64))


def test_matching_contracts_record_fingerprint() -> None:
    x = _logits(2, 40)
    c = Contract(256)
    assert verify(x, x, trainer_contract=c, sampler_contract=Contract(256)).fingerprint == c.fingerprint
    assert verify(x, x, trainer_contract=c, sampler_contract=c.fingerprint).fingerprint == c.fingerprint


def test_strict_raises_with_report() -> None:
    x = _logits(4, 40)
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
    r = verify(x, y, kind="logits", token_ids=tok)
    lt = torch.log_softmax(x[1, 2], -1)[5]
    ls = torch.log_softmax(y[1, 2], -1)[5]
    d = float(lt) - float(ls)
    assert r.mismatched_row_indices == [5]
    assert r.max_abs_logprob_diff == pytest.approx(abs(d), rel=1e-4)
    assert r.mean_abs_logprob_diff == pytest.approx(abs(d) / 6, rel=1e-4)
    assert r.kl == pytest.approx((math.exp(d) - d - 1) / 6, rel=1e-3)
    with pytest.raises(ValueError, match="out of range"):
        verify(x, y, kind="logits", token_ids=tok + 16)


def test_empty_inputs() -> None:
    for x, kind in ((torch.empty(0, 7), "logits"), (torch.empty(2, 0, 7), "logits"), (torch.empty(0), "auto")):
        r = verify(x, x.clone(), kind=kind)
        assert r.bitwise_equal and r.rows == 0 and r.mismatch_map() == "" and json.loads(r.to_json())["rows"] == 0
        # strict promises an alignment was shown: an empty comparison shows none
        with pytest.raises(AlignmentError, match="compared nothing"):
            verify(x, x.clone(), kind=kind, strict=True)


def test_mismatch_map_characters() -> None:
    x = _logits(10, 4)
    y = x.clone()
    y[0:2] += 1  # bucket 0 (rows 0-1): all differ
    y[3] += 1  # bucket 1 (rows 2-3): some differ
    y[9, 0] = float("nan")  # bucket 4 (rows 8-9): NaN
    r = verify(x, y, kind="logits")
    assert r.mismatch_map(width=5) == "Xx..!"
    assert len(r.mismatch_map(width=64)) == 10 and r.mismatch_map(width=3) == "x.!"  # 4 rows per char


def test_non_finite_figures_serialise_as_null() -> None:
    x = _logits(2, 4)
    y = x.clone()
    y[0, 1] = float("-inf")  # a masked logit on one side only: infinite logprob gap
    r = verify(x, y, kind="logits")
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
    rep = verify(x, y, kind="logits")
    assert rep.mismatched_row_indices == sorted(picked)
    assert rep.bitwise_equal == (not picked) and rep.first_mismatch == (min(picked) if picked else None)
    assert rep.max_abs_diff == float((x.double() - y.double()).abs().max())


def _one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


# --- kind="auto": logits only where the input cannot be logprobs ---------------------------------


def test_auto_takes_model_logits() -> None:
    x = _logits(4, 6, AUTO_MIN_VOCAB)
    assert verify(x, x.clone()).kind == "logits" and verify(x[0], x[0].clone()).kind == "logits"


def test_auto_refuses_batched_logprobs() -> None:
    # [B, T] per-token logprobs with a long T: all <= 0, so never taken as [T, V] logits
    lp = torch.log_softmax(_logits(4, 600, 40), -1).amax(-1)
    assert lp.shape == (4, 600) and bool((lp <= 0).all())
    with pytest.raises(ValueError) as e:
        verify(lp, lp.clone())
    assert "kind='auto' refused: the trainer's values are not of both signs" in _one_line(e)
    assert "pass kind='logits' or kind='logprobs'" in str(e.value)
    r = verify(lp, lp.clone(), kind="logprobs")
    assert r and r.rows == 2400 and r.kind == "logprobs"  # one row per token, as meant


def test_auto_refuses_short_last_dim() -> None:
    lp = torch.log_softmax(_logits(4, 6, 40), -1).amax(-1)  # [4, 6] logprobs
    with pytest.raises(ValueError) as e:
        verify(lp, lp.clone())
    assert f"a last dim under {AUTO_MIN_VOCAB} may be [B, T] logprobs" in _one_line(e)
    x = _logits(3, AUTO_MIN_VOCAB - 1)  # both signs, but too short to tell from logprobs
    with pytest.raises(ValueError, match="last dim under"):
        verify(x, x.clone())
    assert verify(x, x.clone(), kind="logits").rows == 3


def test_auto_checks_both_sides() -> None:
    x = _logits(5, 64)
    lp = torch.log_softmax(x, -1)  # the sampler sent logprobs of the whole vocabulary
    with pytest.raises(ValueError) as e:
        verify(x, lp)
    assert "the sampler's values are not of both signs" in _one_line(e)
    assert not verify(x, lp, kind="logits")  # stated explicitly, it is compared (and differs)
    probs = torch.softmax(x, -1)  # probabilities (or NLLs): all >= 0, not logits either
    with pytest.raises(ValueError, match="trainer's values are not of both signs"):
        verify(probs, probs.clone())


# --- NaN rows, bit patterns, KL clamp -----------------------------------------------------------


def test_nan_rows_counted_and_never_equal() -> None:
    x = _logits(8, 40)
    y = x.clone()
    for row in (1, 4, 6):
        y[row, row] = float("nan")
    for bits in (False, True):
        r = verify(x, y, bits=bits)
        assert r.nan_rows == 3 and r.nan_row_indices == [1, 4, 6] and r.mismatched_row_indices == [1, 4, 6]
        assert "3/8 rows differ (first row 1, 3 with NaN)" in r.summary()
        same = verify(y, y.clone(), bits=bits)  # the same NaN bits on both sides: still not equal
        assert not same and same.nan_rows == 3 and same.mismatched_rows == 3
        assert same.trainer_digest == same.sampler_digest  # the bits agree; the verdict does not


def test_bits_mode_tells_signed_zeros_apart() -> None:
    x = _logits(4, 40)
    x[2, 7] = 0.0
    y = x.clone()
    y[2, 7] = -0.0
    assert verify(x, y) and torch.equal(x, y)  # default: torch.equal semantics, -0.0 == +0.0
    r = verify(x, y, bits=True)
    assert not r and r.bits and r.mismatched_row_indices == [2] and r.max_abs_diff == 0.0
    assert "bit patterns" in r.summary() and r.kl == 0.0
    assert verify(x, x.clone(), bits=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_bits_mode_per_dtype(dtype: torch.dtype) -> None:
    x = _logits(3, 40, dtype=dtype)
    y = x.clone()
    y[1, 0] = -0.0
    x[1, 0] = 0.0
    assert verify(x, y, kind="logits") and not verify(x, y, kind="logits", bits=True)


def test_bits_mode_compares_nan_payloads() -> None:
    x = _logits(3, 40)
    y = x.clone()
    x.view(torch.int32)[0, 3] = 0x7FC00000  # quiet NaN
    y.view(torch.int32)[0, 3] = 0x7FC00001  # another payload
    assert x[0, 3].isnan() and y[0, 3].isnan()
    r = verify(x, y, bits=True)
    assert r.nan_rows == 1 and r.mismatched_row_indices == [0]
    assert r.trainer_digest != r.sampler_digest


def _unclamped_kl_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """KL(y || x) per row as verify computes it, without the clamp."""
    lt, ls = log_softmax(x).double(), log_softmax(y).double()
    ps = ls.exp()
    return torch.where(ps > 0, ps * (ls - lt), torch.zeros_like(ps)).sum(1)


def test_kl_clamped_at_zero() -> None:
    # One-ulp perturbations: each row's exact KL is >= 0, but the fp32 logprobs' rounding leaves
    # some rows' estimate a hair below 0 (on every machine tried, within a few seeds).
    found = 0
    for seed in range(40):
        x = _logits(8, 64, seed=seed)
        y = x.clone()
        y.view(torch.int32)[:, 5] ^= 1
        raw = _unclamped_kl_rows(x, y)
        if not bool((raw < 0).any()):
            continue
        found += 1
        r = verify(x, y)
        assert r.kl >= 0 and r.kl == pytest.approx(float(raw.clamp_min(0).sum()) / 8, rel=1e-9, abs=0)
        assert r.kl > float(raw.mean())  # the clamp moved it: negative rows no longer cancel others
    assert found, "no seed gave a negative unclamped KL row: the clamp test shows nothing"


def test_k3_figure_non_negative() -> None:
    lp = torch.log_softmax(_logits(64, 40), -1).amax(-1)
    other = lp.clone()
    other.view(torch.int32)[::3] ^= 1
    r = verify(lp, other, kind="logprobs")
    assert not r and r.kl >= 0


# --- digests ------------------------------------------------------------------------------------


def test_rows_digest_equal_for_equal_bits() -> None:
    x = _logits(6, 40, dtype=torch.bfloat16)
    d = rows_digest(x)
    assert len(d) == 16 and int(d, 16) >= 0 and d == rows_digest(x.clone())
    assert rows_digest(x.t().contiguous().t()) == d  # a strided layout of the same rows: the same digest
    r = verify(x, x.clone())
    assert r.trainer_digest == r.sampler_digest == d
    assert json.loads(r.to_json())["trainer_digest"] == d


def test_rows_digest_changes_with_one_ulp() -> None:
    x = _logits(6, 40)
    y = _flip_lowest_bit(x, (5, 39))
    assert rows_digest(x) != rows_digest(y)
    r = verify(x, y)
    assert r.trainer_digest == rows_digest(x) and r.sampler_digest == rows_digest(y)


def test_rows_digest_names_dtype_and_shape() -> None:
    x = _logits(6, 40)
    same_bytes = {
        "int32 view": x.view(torch.int32),
        "reshaped": x.reshape(40, 6),
        "flat": x.reshape(-1),
        "batched": x.reshape(2, 3, 40),
    }
    digests = {name: rows_digest(t) for name, t in same_bytes.items()}
    assert len({rows_digest(x), *digests.values()}) == 5, digests
    h = _logits(6, 40, dtype=torch.bfloat16)
    assert rows_digest(h) != rows_digest(h.view(torch.float16))  # 2-byte floats, same bytes
    zero = torch.zeros(3, 40)
    assert rows_digest(zero) != rows_digest(-zero)  # bit patterns, like bits=True
    with pytest.raises(TypeError, match="rows_digest expects a torch tensor"):
        rows_digest([1.0, 2.0])  # type: ignore[arg-type]


# --- hardware -----------------------------------------------------------------------------------

_AVX2 = HardwareClass("cpu", "AMD EPYC", isa="avx2", native_isa="avx2")
_DEFAULT = HardwareClass("cpu", "AMD EPYC", isa="default", native_isa="avx2")


def test_different_hardware_refused() -> None:
    x = _logits(4, 40)
    with pytest.raises(HardwareMismatchError) as e:
        verify(x, x.clone(), trainer_hardware=_AVX2, sampler_hardware=_DEFAULT)
    msg = _one_line(e)
    assert "trainer 'cpu:avx2' vs sampler 'cpu:default/avx2'" in msg and "--allow-cross-hardware" in msg
    # a key string or a to_dict() from another process declares the class just as well
    with pytest.raises(HardwareMismatchError):
        verify(x, x.clone(), trainer_hardware=_AVX2.key, sampler_hardware=_DEFAULT.to_dict())
    # contracts are still checked first
    with pytest.raises(ContractMismatchError):
        verify(x, x, trainer_contract=Contract(128), sampler_contract=Contract(256), trainer_hardware=_AVX2,
               sampler_hardware=_DEFAULT)


def test_cross_hardware_allowed_and_recorded() -> None:
    x = _logits(4, 40)
    r = verify(x, x.clone(), trainer_hardware=_AVX2, sampler_hardware=_DEFAULT, allow_cross_hardware=True)
    assert r and r.hardware == {"trainer": "cpu:avx2", "sampler": "cpu:default/avx2", "same": False}
    assert "hardware trainer cpu:avx2 vs sampler cpu:default/avx2 (cross-hardware allowed)" in r.summary()
    same = verify(x, x.clone(), trainer_hardware=_AVX2, sampler_hardware=_AVX2.to_dict())
    assert same.hardware == {"trainer": "cpu:avx2", "sampler": "cpu:avx2", "same": True}
    assert "hardware cpu:avx2]" in same.summary() and json.loads(same.to_json())["hardware"]["same"] is True
    # one side declared checks nothing, so it is refused rather than shown as checked
    for kw in ({"trainer_hardware": _AVX2}, {"sampler_hardware": _AVX2.key}):
        with pytest.raises(ValueError, match="for one side only"):
            verify(x, x.clone(), **kw)


# -- mask= (padded [B, T] logprobs) and the refusals of one-sided or malformed declarations -----------------


def _padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl-style [4, 30] logprobs, right-padded with 0.0 (the trainer) / garbage (the sampler), and the mask."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([30, 12, 1, 25])
    mask = torch.arange(30)[None] < lens[:, None]
    lp = -torch.rand(4, 30, generator=g) * 5
    trainer = torch.where(mask, lp, torch.zeros_like(lp))
    sampler = torch.where(mask, lp, torch.full_like(lp, -3.0))
    return trainer, sampler, mask


def test_mask_leaves_padding_out() -> None:
    t, s, mask = _padded()
    # the mismatch a mask prevents: without it the padding differs (and auto refuses a [4, 30] input)
    assert verify(t, s, kind="logprobs").mismatched_rows == int((~mask).sum())
    with pytest.raises(ValueError, match="kind='auto' refused"):
        verify(t, s)
    r = verify(t, s, mask=mask, strict=True)  # [B, T] floats with a mask: logprobs, no kind needed
    assert r and r.kind == "logprobs" and r.rows == 120 and r.masked_rows == int((~mask).sum())
    assert f"bitwise equal: {int(mask.sum())}/{int(mask.sum())} rows" in r.summary()
    assert "masked out" in r.summary()
    # NaN in the padding is not a NaN row
    s2 = s.clone()
    s2[2, 5] = float("nan")
    assert verify(t, s2, mask=mask).nan_rows == 0


def test_mask_reports_one_unmasked_difference() -> None:
    t, s, mask = _padded()
    s = s.clone()
    s[1, 11] = torch.nextafter(s[1, 11], torch.tensor(0.0))  # the last real token of row 1, one ulp
    r = verify(t, s, mask=mask)
    assert not r and r.mismatched_rows == 1 and r.mismatched_row_indices == [30 + 11] and r.first_mismatch == 41
    assert r.max_abs_logprob_diff > 0 and r.mean_abs_logprob_diff == pytest.approx(r.max_abs_logprob_diff / 68)
    assert f"1/{int(mask.sum())} rows differ" in r.summary()
    with pytest.raises(AlignmentError):
        verify(t, s, mask=mask, strict=True)


def test_mask_on_logits_rows_and_token_ids() -> None:
    x = _logits(2, 6, 40)
    y = x.clone()
    y[1, 4:] += 1  # padding positions of sequence 1
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    tok = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, -100, -100]])  # padding ids out of range: ignored
    r = verify(x, y, mask=mask, token_ids=tok)
    assert r and r.kind == "logits" and r.masked_rows == 2
    assert not verify(x, y, mask=torch.ones(2, 6, dtype=torch.bool))


def test_mask_bad_input() -> None:
    t, s, mask = _padded()
    with pytest.raises(TypeError, match="bool tensor"):
        verify(t, s, mask=mask.int())
    with pytest.raises(ValueError, match=r"mask must have the logprobs rows' shape \[4, 30\]"):
        verify(t, s, kind="logprobs", mask=mask[:, :5])
    with pytest.raises(AlignmentError, match="compared nothing"):
        verify(t, s, mask=torch.zeros_like(mask), strict=True)


def test_one_sided_or_integer_contracts_are_refused() -> None:
    x = _logits(4, 40)
    for kw in ({"trainer_contract": Contract(128)}, {"sampler_contract": Contract(128).fingerprint}):
        with pytest.raises(ValueError, match="for one side only"):
            verify(x, x.clone(), **kw)
    with pytest.raises(TypeError, match="trainer_contract must be a Contract or its fingerprint string, got int"):
        verify(x, x.clone(), trainer_contract=123456789012, sampler_contract=123456789012)
    with pytest.raises(ValueError, match="empty fingerprint"):
        verify(x, x.clone(), trainer_contract="", sampler_contract="")


def test_meta_tensors_are_refused_in_one_line() -> None:
    x = torch.empty(4, 40, device="meta")
    with pytest.raises(ValueError, match="meta-device tensor") as e:
        verify(x, x, kind="logits")
    assert "\n" not in str(e.value)
