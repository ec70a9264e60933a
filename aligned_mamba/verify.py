"""Bitwise comparison of trainer and sampler logits (or per-token logprobs), with a report.

The verdict is per row; the logprob and KL figures only say how far apart mismatched rows are, never
soften it. What cannot be checked (one-sided contracts, ``strict`` over nothing, meta tensors) is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .contract import Contract, check_compatible
from .errors import AlignmentError, ContractMismatchError
from .hardware import HardwareLike, check_same_hardware, hardware_key
from .ops.logprobs import log_softmax

KINDS = ("auto", "logits", "logprobs")
# kind="auto" takes logits only from a last dim this long: a shorter one may be the T of [B, T] logprobs
AUTO_MIN_VOCAB = 32
DIGEST_CHARS = 16  # hex chars of sha256 kept: 64 bits, ample for telling two tensors apart
# bit patterns of each float width, for bits=True
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_BLOCK_BYTES = 1 << 26  # rows hashed in 64 MiB pieces: a GPU tensor is never copied whole
# elements per block: the fp64 figures of a [4096, 50280] input need tens of MB per temporary, not GBs
_BLOCK_ELEMENTS = 1 << 23
_MAX_BLOCK_ROWS = 1024


@dataclass
class VerifyReport:
    """Outcome of ``verify``, truthy iff bitwise equal. Rows are the flattened [B*T] positions; figures floats.

    ``max_abs_diff``: over elements finite on both sides. The logprob figures and ``kl`` skip NaN rows; ``kl``
    is the row mean of KL(sampler || trainer) for full logits, or of k3 = exp(d) - d - 1 (d = lp_trainer -
    lp_sampler) at given tokens, each row's term clamped at >= 0 (rounding must not cancel another row's
    divergence). ``trainer_digest`` / ``sampler_digest``: ``rows_digest`` of each input. ``hardware``:
    {"trainer", "sampler", "same"} or None. ``masked_rows``: counted in ``rows``, never compared.
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
    bits: bool = False
    trainer_digest: str | None = None
    sampler_digest: str | None = None
    hardware: dict[str, Any] | None = None
    masked_rows: int = 0

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
        if self.bits:
            what += ", bit patterns"
        if self.hardware is not None:
            hw = self.hardware
            what += (f", hardware {hw['trainer']}" if hw["same"]
                     else f", hardware trainer {hw['trainer']} vs sampler {hw['sampler']} (cross-hardware allowed)")
        compared = self.rows - self.masked_rows
        if self.masked_rows:
            what += f", {self.masked_rows} masked out"
        if self.bitwise_equal:
            return f"bitwise equal: {compared}/{compared} rows [{what}]"
        nans = f", {self.nan_rows} with NaN" if self.nan_rows else ""
        return (
            f"NOT bitwise equal: {self.mismatched_rows}/{compared} rows differ "
            f"(first row {self.first_mismatch}{nans}); "
            f"max|d| {self.max_abs_diff:.3g}, max|d logprob| "
            f"{self.max_abs_logprob_diff:.3g}, mean|d logprob| {self.mean_abs_logprob_diff:.3g}, "
            f"kl {self.kl:.3g} [{what}]"
        )


def _contract_fingerprint(trainer: Contract | str | None, sampler: Contract | str | None) -> str | None:
    """Refuse differing or one-sided contracts before any comparison; the shared fingerprint."""
    for side, c in (("trainer", trainer), ("sampler", sampler)):
        if c is not None and not isinstance(c, (Contract, str)):
            raise TypeError(f"{side}_contract must be a Contract or its fingerprint string, got {type(c).__name__}")
        if isinstance(c, str) and not c:
            raise ValueError(f"{side}_contract is an empty fingerprint")
    if (trainer is None) != (sampler is None):
        given = "trainer" if trainer is not None else "sampler"
        raise ValueError(f"{given}_contract given for one side only: pass both trainer_contract and "
                         "sampler_contract, or neither (a one-sided contract checks nothing)")
    if isinstance(trainer, Contract) and isinstance(sampler, Contract):
        check_compatible(trainer, sampler)
    fps = [c.fingerprint if isinstance(c, Contract) else c for c in (trainer, sampler)]
    if fps[0] is not None and fps[1] is not None and fps[0] != fps[1]:
        raise ContractMismatchError(f"contract mismatch: fingerprint trainer={fps[0]!r} sampler={fps[1]!r}")
    return fps[0] if fps[0] is not None else fps[1]


def rows_digest(rows: torch.Tensor) -> str:
    """First 16 hex chars of sha256 over a tensor's dtype, shape and bytes (machine order: little-endian
    wherever torch ships), for any shape, dtype and device.

    Equal digests mean equal bit patterns (-0.0 != +0.0, NaN payloads count), as ``verify(bits=True)``
    compares; the same bytes as another dtype or shape give another digest. TypeError for a non-tensor.
    """
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows_digest expects a torch tensor, got {type(rows).__name__}")
    h = hashlib.sha256(f"aligned-mamba rows v1 {str(rows.dtype).removeprefix('torch.')} {list(rows.shape)}\n".encode())
    flat = rows.detach().contiguous().reshape(-1)
    step = max(1, _DIGEST_BLOCK_BYTES // max(1, flat.element_size()))
    for lo in range(0, flat.numel(), step):
        # uint8 view: raw bytes for every dtype, bf16 and fp8 included (numpy has neither)
        h.update(flat[lo : lo + step].cpu().view(torch.uint8).numpy())
    return h.hexdigest()[:DIGEST_CHARS]


def _hardware(trainer: HardwareLike | None, sampler: HardwareLike | None, allow: bool) -> dict[str, Any] | None:
    """Refuse differing declared hardware classes (unless allowed); the report's hardware entry."""
    if (trainer is None) != (sampler is None):
        given = "trainer" if trainer is not None else "sampler"
        raise ValueError(f"{given}_hardware given for one side only: pass both trainer_hardware and "
                         "sampler_hardware, or neither (a one-sided class checks nothing)")
    if trainer is None or sampler is None:
        return None
    same = check_same_hardware(trainer, sampler, allow=allow)
    return {"trainer": hardware_key(trainer), "sampler": hardware_key(sampler), "same": same}


def _auto_kind(t: torch.Tensor, s: torch.Tensor) -> str:
    """kind="auto": 1-D is logprobs; >= 2-D is logits only when it cannot be [B, T] logprobs."""
    if t.dim() <= 1 or t.dim() > 3:
        return "logprobs" if t.dim() <= 1 else "logits"  # the shape check after refuses what fits neither
    hint = "pass kind='logits' or kind='logprobs'"
    if t.shape[-1] < AUTO_MIN_VOCAB:
        raise ValueError(f"kind='auto' refused for shape {list(t.shape)}: a last dim under {AUTO_MIN_VOCAB} may be "
                         f"[B, T] logprobs rather than a vocabulary; {hint}")
    # Logprobs are all <= 0 (probabilities, NLLs all >= 0); logits of a model take both signs.
    for side, x in (("trainer", t), ("sampler", s)):
        if not (bool((x > 0).any()) and bool((x < 0).any())):
            raise ValueError(f"kind='auto' refused: the {side}'s values are not of both signs, so they may be "
                             f"logprobs (all <= 0) or probabilities rather than logits; {hint}")
    return "logits"


def _row_equal(xa: torch.Tensor, xb: torch.Tensor, bits: bool) -> torch.Tensor:
    """[R, W] x2 -> [R] bool: every element equal by value (torch.equal) or by bit pattern."""
    if bits:
        ints = _INT_OF_SIZE[xa.element_size()]
        return (xa.view(ints) == xb.view(ints)).all(1)
    return (xa == xb).all(1)


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
    bits: bool = False,
    trainer_hardware: HardwareLike | None = None,
    sampler_hardware: HardwareLike | None = None,
    allow_cross_hardware: bool = False,
    mask: torch.Tensor | None = None,
) -> VerifyReport:
    """Compare trainer and sampler outputs row by row, bit for bit; returns a ``VerifyReport``.

    Inputs, one shape and float dtype on both sides: logits [T, V] / [B, T, V] or per-token logprobs [T] /
    [B, T]. ``kind="auto"``: 1-D is logprobs; 2-D/3-D is logits only if the last dim is >= AUTO_MIN_VOCAB (32)
    and each side has values of both signs, else refused (pass ``kind``). A row is equal iff every element is
    equal by value (-0.0 == +0.0) or, with ``bits=True``, by bit pattern; a row with a NaN is never equal.
    ``token_ids`` (int, the logits' leading shape): logprob figures at those tokens. ``mask`` (bool, the rows'
    shape, True = compared): padding left out; a 2-D input of the mask's shape is taken as logprobs.
    Contracts (``Contract`` or fingerprint) and hardware classes (``HardwareClass``, its dict or key) are
    given for both sides or neither and checked first (ContractMismatchError; HardwareMismatchError unless
    ``allow_cross_hardware``). ``strict``: AlignmentError carrying the report when a row differs or nothing
    was compared. Malformed inputs raise TypeError / ValueError.
    """
    fingerprint = _contract_fingerprint(trainer_contract, sampler_contract)
    hardware = _hardware(trainer_hardware, sampler_hardware, allow_cross_hardware)
    t, s = trainer_logits, sampler_logits
    if not isinstance(t, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError(f"expected torch tensors, got {type(t).__name__} and {type(s).__name__}")
    if t.shape != s.shape:
        raise ValueError(f"shape mismatch: trainer {list(t.shape)} vs sampler {list(s.shape)} (refused, not compared)")
    if t.dtype != s.dtype:
        raise ValueError(f"dtype mismatch: trainer {t.dtype} vs sampler {s.dtype} (refused, not compared)")
    if t.is_meta or s.is_meta:
        raise ValueError("verify needs tensors with data, got a meta-device tensor (materialise it first)")
    if not t.is_floating_point():
        raise ValueError(f"expected floating-point logits or logprobs, got {t.dtype}")
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} refused: expected one of {', '.join(KINDS)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"mask must be a bool tensor (True = compared), got {what}")
        if mask.is_meta:
            raise ValueError("verify needs tensors with data, got a meta-device mask")
        if kind == "auto" and t.dim() == 2 and mask.shape == t.shape:
            kind = "logprobs"  # [B, T] values with a [B, T] mask: per-token logprobs, padded
        elif kind == "auto" and t.dim() in (2, 3) and mask.shape == t.shape[:-1]:
            kind = "logits"
    if kind == "auto":
        kind = _auto_kind(t, s)
    if (kind == "logits" and t.dim() not in (2, 3)) or (kind == "logprobs" and t.dim() not in (1, 2)):
        want = "[T, V] or [B, T, V]" if kind == "logits" else "[T] or [B, T]"
        raise ValueError(f"{kind} must be {want}, got shape {list(t.shape)}")

    a, b = _as_rows(t.detach(), kind), _as_rows(s.detach(), kind)  # a comparison, never part of a graph
    rows, width = a.shape
    keep = None
    if mask is not None:
        lead = t.shape if kind == "logprobs" else t.shape[:-1]
        if mask.shape != lead:
            raise ValueError(f"mask must have the {kind} rows' shape {list(lead)}, got {list(mask.shape)}")
        keep = mask.reshape(rows).to(a.device)
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
        if keep is not None:
            tok = torch.where(keep, tok, torch.zeros_like(tok))  # padding may hold any id
        if rows and (int(tok.min()) < 0 or int(tok.max()) >= width):
            raise ValueError(f"token_ids out of range [0, {width})")

    step = max(1, min(_MAX_BLOCK_ROWS, _BLOCK_ELEMENTS // max(width, 1)))
    equal = torch.empty(rows, dtype=torch.bool, device=a.device)
    nan = torch.empty(rows, dtype=torch.bool, device=a.device)
    for lo in range(0, rows, step):
        xa, xb = a[lo : lo + step], b[lo : lo + step].to(a.device)
        nan[lo : lo + step] = xa.isnan().any(1) | xb.isnan().any(1)
        equal[lo : lo + step] = _row_equal(xa, xb, bits)
    equal &= ~nan  # a NaN row is never equal, in either mode (in bits mode equal NaN bits would be)
    if keep is not None:  # masked-out rows are not compared: never mismatched, never NaN rows
        nan &= keep
        equal |= ~keep
    masked = 0 if keep is None else rows - int(keep.sum())
    bad_idx = (~equal).nonzero().flatten()

    # Equal rows contribute exactly 0 to every figure, so only mismatched rows are processed.
    max_abs = max_lp = sum_lp = kl_sum = 0.0
    for lo in range(0, bad_idx.numel(), step):
        idx = bad_idx[lo : lo + step]
        xa, xb = a[idx], b[idx.to(b.device)].to(a.device)  # trainer and sampler rows may live apart
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
        kl_rows = kl_rows.clamp_min(0.0)  # >= 0 exactly; fp rounding must not cancel other rows' KL
        max_lp = max(max_lp, float(absd.max()))
        sum_lp += float(absd.sum())
        kl_sum += float(kl_rows.sum())

    n_nan = int(nan.sum())
    valid_rows = rows - masked - n_nan
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
        bits=bits,
        trainer_digest=rows_digest(t),
        sampler_digest=rows_digest(s),
        hardware=hardware,
        masked_rows=masked,
    )
    if strict and rows - masked == 0:
        raise AlignmentError(f"strict verify compared nothing: {rows} rows, {masked} masked out; an empty "
                             "comparison proves no alignment", report)
    if strict and not report.bitwise_equal:
        raise AlignmentError(report.summary(), report)
    return report
