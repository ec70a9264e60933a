"""Bitwise comparison of trainer and sampler logits (or per-token logprobs), with a report.

The verdict is per row: a row is equal iff ``torch.equal`` holds for it. The logprob and KL
figures only say how far apart mismatched rows are; they never soften the verdict.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .contract import Contract, check_compatible
from .errors import AlignmentError, ContractMismatchError
from .ops.logprobs import log_softmax

KINDS = ("auto", "logits", "logprobs")
# Rows per block are capped so that a block holds at most this many elements: the fp64
# logprob/KL work on a [4096, 50280] input then needs tens of MB per temporary, not GBs.
_BLOCK_ELEMENTS = 1 << 23
_MAX_BLOCK_ROWS = 1024


@dataclass
class VerifyReport:
    """Outcome of ``verify``. Rows are the flattened [B*T] positions; figures are Python floats.

    ``max_abs_diff`` is over elements finite on both sides; the logprob figures and ``kl`` skip
    NaN rows. ``kl`` is the mean over rows of KL(sampler || trainer) for full logits, or the
    k3 estimator mean(exp(d) - d - 1), d = lp_trainer - lp_sampler, at given tokens.
    """

    bitwise_equal: bool
    rows: int
    mismatched_rows: int
    first_mismatch: int | None
    max_abs_diff: float
    max_abs_logprob_diff: float
    mean_abs_logprob_diff: float
    kl: float
    nan_rows: int
    shape: list[int]
    dtype: str
    kind: str
    fingerprint: str | None
    mismatched_row_indices: list[int] = field(default_factory=list)
    nan_row_indices: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.bitwise_equal

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict; non-finite floats become None."""
        d = dataclasses.asdict(self)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def mismatch_map(self, width: int = 64) -> str:
        """One char per ceil(rows/width) rows: '.' none differ, 'x' some, 'X' all, '!' a NaN row."""
        if self.rows == 0:
            return ""
        per = -(-self.rows // max(1, width))
        n = -(-self.rows // per)
        bad = torch.zeros(n * per, dtype=torch.int64)
        nan = torch.zeros(n * per, dtype=torch.int64)
        bad[torch.tensor(self.mismatched_row_indices, dtype=torch.int64)] = 1
        nan[torch.tensor(self.nan_row_indices, dtype=torch.int64)] = 1
        bad_count, nan_count = bad.view(n, per).sum(1).tolist(), nan.view(n, per).sum(1).tolist()
        chars = []
        for i in range(n):
            size = min(per, self.rows - i * per)
            if nan_count[i]:
                chars.append("!")
            elif bad_count[i] == size:
                chars.append("X")
            else:
                chars.append("x" if bad_count[i] else ".")
        return "".join(chars)

    def summary(self) -> str:
        """One line: the verdict, then where and how far apart (if not equal)."""
        what = f"{self.dtype} {self.kind} {self.shape}" + (f", contract {self.fingerprint}" if self.fingerprint else "")
        if self.bitwise_equal:
            return f"bitwise equal: {self.rows}/{self.rows} rows [{what}]"
        nans = f", {self.nan_rows} with NaN" if self.nan_rows else ""
        return (
            f"NOT bitwise equal: {self.mismatched_rows}/{self.rows} rows differ "
            f"(first row {self.first_mismatch}{nans}); "
            f"max|d| {self.max_abs_diff:.3g}, max|d logprob| "
            f"{self.max_abs_logprob_diff:.3g}, mean|d logprob| {self.mean_abs_logprob_diff:.3g}, "
            f"kl {self.kl:.3g} [{what}]"
        )


def _contract_fingerprint(trainer: Contract | str | None, sampler: Contract | str | None) -> str | None:
    """Refuse differing contracts before any comparison; return the shared fingerprint."""
    if isinstance(trainer, Contract) and isinstance(sampler, Contract):
        check_compatible(trainer, sampler)
    fps = [c.fingerprint if isinstance(c, Contract) else c for c in (trainer, sampler)]
    if fps[0] is not None and fps[1] is not None and fps[0] != fps[1]:
        raise ContractMismatchError(f"contract mismatch: fingerprint trainer={fps[0]!r} sampler={fps[1]!r}")
    return fps[0] if fps[0] is not None else fps[1]


def _as_rows(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Logits [..., V] -> [R, V]; logprobs [...] -> [R, 1]."""
    if kind == "logprobs":
        return x.reshape(x.numel(), 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _fail_closed(x: torch.Tensor) -> torch.Tensor:
    """NaN figures (e.g. inf - inf from +inf logits) count as infinitely far apart, never as 0."""
    return torch.nan_to_num(x, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def _abs_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x - y| with equal values (both -inf included) at 0."""
    return _fail_closed(torch.where(x == y, torch.zeros_like(x), (x - y).abs()))


def _token_figures(lt: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token |d| and k3 = exp(d) - d - 1, d = lp_trainer - lp_sampler (float64 in, float64 out)."""
    d = torch.where(lt == ls, torch.zeros_like(lt), lt - ls)
    return _fail_closed(d.abs()), _fail_closed(torch.expm1(d) - d)


def verify(
    trainer_logits: torch.Tensor,
    sampler_logits: torch.Tensor,
    *,
    strict: bool = False,
    kind: str = "auto",
    token_ids: torch.Tensor | None = None,
    trainer_contract: Contract | str | None = None,
    sampler_contract: Contract | str | None = None,
) -> VerifyReport:
    """Compare trainer and sampler outputs row by row, bit for bit.

    Inputs: logits [T, V] or [B, T, V] (any float dtype), or per-token logprobs [T] / [B, T]
    (``kind="logprobs"``; "auto" takes 1-D as logprobs, 2-D/3-D as logits). ``token_ids``
    (int, the logits' leading shape) switches the logprob figures to those tokens. Contracts
    (``Contract`` or fingerprint string) are checked first. ``strict`` raises AlignmentError
    carrying the report when any row differs.
    """
    fingerprint = _contract_fingerprint(trainer_contract, sampler_contract)
    t, s = trainer_logits, sampler_logits
    if not isinstance(t, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError(f"expected torch tensors, got {type(t).__name__} and {type(s).__name__}")
    if t.shape != s.shape:
        raise ValueError(f"shape mismatch: trainer {list(t.shape)} vs sampler {list(s.shape)} (refused, not compared)")
    if t.dtype != s.dtype:
        raise ValueError(f"dtype mismatch: trainer {t.dtype} vs sampler {s.dtype} (refused, not compared)")
    if not t.is_floating_point():
        raise ValueError(f"expected floating-point logits or logprobs, got {t.dtype}")
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} refused: expected one of {', '.join(KINDS)}")
    if kind == "auto":
        kind = "logprobs" if t.dim() == 1 else "logits"
    if (kind == "logits" and t.dim() not in (2, 3)) or (kind == "logprobs" and t.dim() not in (1, 2)):
        want = "[T, V] or [B, T, V]" if kind == "logits" else "[T] or [B, T]"
        raise ValueError(f"{kind} must be {want}, got shape {list(t.shape)}")

    a, b = _as_rows(t.detach(), kind), _as_rows(s.detach(), kind)  # a comparison, never part of a graph
    rows, width = a.shape
    tok = None
    if token_ids is not None:
        if kind != "logits":
            raise ValueError("token_ids applies to logits only; logprob inputs are already per token")
        token_ids = torch.as_tensor(token_ids)
        if token_ids.shape != t.shape[:-1] or token_ids.is_floating_point():
            raise ValueError(
                f"token_ids must be integer with shape {list(t.shape[:-1])}, got {token_ids.dtype} "
                f"{list(token_ids.shape)}"
            )
        tok = token_ids.reshape(rows).to(device=a.device, dtype=torch.int64)
        if rows and (int(tok.min()) < 0 or int(tok.max()) >= width):
            raise ValueError(f"token_ids out of range [0, {width})")

    step = max(1, min(_MAX_BLOCK_ROWS, _BLOCK_ELEMENTS // max(width, 1)))
    equal = torch.empty(rows, dtype=torch.bool, device=a.device)
    nan = torch.empty(rows, dtype=torch.bool, device=a.device)
    for lo in range(0, rows, step):
        xa, xb = a[lo : lo + step], b[lo : lo + step].to(a.device)
        nan[lo : lo + step] = xa.isnan().any(1) | xb.isnan().any(1)
        equal[lo : lo + step] = (xa == xb).all(1)  # NaN != NaN, so NaN rows are never equal
    equal &= ~nan
    bad_idx = (~equal).nonzero().flatten()

    # Equal rows contribute exactly 0 to every figure, so only mismatched rows are processed.
    max_abs = max_lp = sum_lp = kl_sum = 0.0
    for lo in range(0, bad_idx.numel(), step):
        idx = bad_idx[lo : lo + step]
        xa, xb = a[idx], b[idx].to(a.device)
        both_finite = xa.isfinite() & xb.isfinite()
        if both_finite.any():
            d = (xa.double() - xb.double()).abs()
            max_abs = max(max_abs, float(d[both_finite].max()))
        keep = ~nan[idx]
        xa, xb = xa[keep], xb[keep]
        if xa.shape[0] == 0:
            continue
        if kind == "logprobs":
            absd, kl_rows = _token_figures(xa[:, 0].double(), xb[:, 0].double())
        elif tok is not None:
            ti = tok[idx][keep].unsqueeze(1)
            lt = log_softmax(xa).gather(1, ti).squeeze(1).double()
            ls = log_softmax(xb).gather(1, ti).squeeze(1).double()
            absd, kl_rows = _token_figures(lt, ls)
        else:
            lt, ls = log_softmax(xa).double(), log_softmax(xb).double()
            absd = _abs_diff(lt, ls)
            ps = ls.exp()
            # KL(s || t) per row; p_s = 0 terms are 0 (not 0 * inf = NaN).
            kl_rows = _fail_closed(torch.where(ps > 0, ps * (ls - lt), torch.zeros_like(ps)).sum(1))
        max_lp = max(max_lp, float(absd.max()))
        sum_lp += float(absd.sum())
        kl_sum += float(kl_rows.sum())

    n_nan = int(nan.sum())
    valid_rows = rows - n_nan
    per_row = width if kind == "logits" and tok is None else 1
    report = VerifyReport(
        bitwise_equal=bad_idx.numel() == 0,
        rows=rows,
        mismatched_rows=bad_idx.numel(),
        first_mismatch=int(bad_idx[0]) if bad_idx.numel() else None,
        max_abs_diff=max_abs,
        max_abs_logprob_diff=max_lp,
        mean_abs_logprob_diff=sum_lp / (valid_rows * per_row) if valid_rows * per_row else 0.0,
        kl=kl_sum / valid_rows if valid_rows else 0.0,
        nan_rows=n_nan,
        shape=list(t.shape),
        dtype=str(t.dtype).removeprefix("torch."),
        kind=kind,
        fingerprint=fingerprint,
        mismatched_row_indices=bad_idx.tolist(),
        nan_row_indices=nan.nonzero().flatten().tolist(),
    )
    if strict and not report.bitwise_equal:
        raise AlignmentError(report.summary(), report)
    return report
