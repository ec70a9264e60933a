"""Log-softmax and per-token logprobs, row-invariant by construction, and their vocab-sharded form.

log_softmax(x) = x - (m + log(sliced_sum(exp(x - m)))), m the row max, x = fp32(logits) / fp32(T) (one IEEE division;
T = 1 skips it). The tree, and why shards get the unsharded bits: docs/design.md, "How the bits are kept", Logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from .. import elementwise as ew
from ..reduce import tree_sum

# the leaves of the vocabulary sum's tree: part of the contract's arithmetic (changing it changes the bits)
VOCAB_SLICES = 8

AllGather = Callable[[torch.Tensor], Sequence[torch.Tensor]]


def scale(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The contract's temperature: [..., V] any float dtype -> [..., V] float32 logits / T."""
    check_temperature(temperature)
    t = float(temperature)
    x = logits.to(torch.float32)
    return x if t == 1.0 else x / torch.tensor(t, dtype=torch.float32, device=x.device)


def check_temperature(temperature: object) -> None:
    """Refuse (one line) a temperature that is not a finite real number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _shift(m: torch.Tensor) -> torch.Tensor:
    """The row max as the exp's shift, 0 where it is not finite (an all -inf row: no inf - inf)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _slice_sums(e: torch.Tensor, slices: int) -> torch.Tensor:
    """[..., n] -> [..., slices]: contiguous slices of ceil(n / slices) (zero-padded), each by ``tree_sum``."""
    n = e.shape[-1]
    c = max(1, -(-n // slices))
    if c * slices != n:
        e = torch.nn.functional.pad(e, (0, c * slices - n))
    return tree_sum(e.reshape(*e.shape[:-1], slices, c))


def pair_tree(s: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by adjacent pairs: [..., n] -> [...]. Unlike ``tree_sum``'s halves,
    an aligned run of 2^k entries is a subtree, so a shard's contiguous slices compute a node of the unsharded tree."""
    n = s.shape[-1]
    if n & (n - 1):
        raise ValueError(f"pair_tree needs a power-of-two width, got {n}")
    while s.shape[-1] > 1:
        s = s[..., 0::2] + s[..., 1::2]
    return s[..., 0]


def sliced_sum(e: torch.Tensor) -> torch.Tensor:
    """The log-softmax's sum: [..., V] float32 -> [...], a ``pair_tree`` over VOCAB_SLICES slice sums."""
    return pair_tree(_slice_sums(e, VOCAB_SLICES))


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[..., V] logits (any float dtype) -> [..., V] float32 logprobs of logits / temperature."""
    x = scale(logits, temperature)
    m = _shift(x.amax(dim=-1, keepdim=True))
    lse = m + ew.log(sliced_sum(ew.exp(x - m))).unsqueeze(-1)
    return x - lse


def log_softmax_backward(out: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``log_softmax``'s gradient from its output out [..., V] fp32: g - softmax * sum(g) in ``dtype``
    (torch ops: not row-invariant)."""
    gf = g.to(torch.float32)
    return (gf - torch.exp(out) * gf.sum(-1, keepdim=True)).to(dtype)


def check_token_shapes(logits: object, token_ids: object) -> None:
    """Refuse (one line each) logits [..., V] and token ids [...] whose types or shapes ``token_logprobs`` cannot
    score; reads nothing from the device."""
    if not isinstance(logits, torch.Tensor) or not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"token_logprobs expects torch tensors, got logits {type(logits).__name__} and "
                        f"token_ids {type(token_ids).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [..., V], got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {list(logits.shape)}")
    if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
        raise TypeError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"shape mismatch: token_ids {list(token_ids.shape)} must be logits' leading shape "
                         f"{list(logits.shape[:-1])} (logits [..., V], token_ids [...])")
    if token_ids.is_meta or logits.is_meta:
        raise ValueError("token_logprobs needs tensors with data, got a meta-device tensor")


def check_token_inputs(logits: object, token_ids: object) -> None:
    """``check_token_shapes``, and (one line) an id outside [0, V): one read from the ids' device."""
    check_token_shapes(logits, token_ids)
    v = logits.shape[-1]
    lo, hi = id_range(token_ids)
    if lo < 0 or hi >= v:
        raise ValueError(f"token_ids out of range [0, {v}): min {lo}, max {hi}")


def id_range(token_ids: torch.Tensor) -> tuple[int, int]:
    """(min, max) of integer ids, (0, 0) when there are none: one host read (a CUDA tensor: one sync)."""
    if not token_ids.numel():
        return 0, 0
    lo, hi = torch.stack(torch.aminmax(token_ids.reshape(-1))).tolist()
    return lo, hi


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logprob of ``token_ids`` under ``logits`` / temperature. [..., V], [...] int64 -> [...] float32."""
    check_token_inputs(logits, token_ids)
    lp = log_softmax(logits, temperature)
    return lp.gather(-1, token_ids.to(device=lp.device, dtype=torch.int64).unsqueeze(-1)).squeeze(-1)


# -- the vocab-sharded form (tensor parallelism): all-gathers and the fixed tree, never an all-reduce --


def check_shards(vocab: int, shard_index: int, shard_count: int) -> None:
    """Refuse (one line) a layout of the full vocabulary ``vocab`` whose shards' sums are not whole subtrees."""
    if not (isinstance(shard_count, int) and shard_count >= 1 and shard_count & (shard_count - 1) == 0
            and VOCAB_SLICES % shard_count == 0):
        raise ValueError(f"shard_count {shard_count!r} refused: the vocab-sharded log-softmax needs a power of two "
                         f"dividing the contract's {VOCAB_SLICES} vocabulary slices")
    if not (isinstance(shard_index, int) and 0 <= shard_index < shard_count):
        raise ValueError(f"shard_index {shard_index!r} refused: expected 0 <= shard_index < {shard_count}")
    if shard_count > 1 and vocab % VOCAB_SLICES:
        raise ValueError(f"vocabulary {vocab} refused for {shard_count} shards: the sharded log-softmax needs V a "
                         f"multiple of the contract's {VOCAB_SLICES} slices (pad the vocabulary, as Megatron does)")


def sharded_ids(local_logits: torch.Tensor, token_ids: torch.Tensor, shard_count: int) -> torch.Tensor:
    """Global ids [...] for a shard's logits [..., V / S] as int64 on the logits' device; refused (one line) where
    the shapes do not match or an id is outside [0, V)."""
    ids = token_ids.to(device=local_logits.device, dtype=torch.int64)
    v = local_logits.shape[-1]
    if ids.shape != local_logits.shape[:-1]:
        raise ValueError(f"shape mismatch: token_ids {list(ids.shape)} must be the logits' leading shape "
                         f"{list(local_logits.shape[:-1])}")
    lo, hi = id_range(ids)
    if lo < 0 or hi >= v * shard_count:
        raise ValueError(f"token_ids out of range [0, {v * shard_count})")
    return ids


def _gathered(all_gather: AllGather, t: torch.Tensor, shard_count: int) -> torch.Tensor:
    """all_gather(t) as one tensor [shard_count, ...t.shape], checked."""
    parts = list(all_gather(t.contiguous()))
    if len(parts) != shard_count or any(p.shape != t.shape for p in parts):
        raise ValueError(f"all_gather returned {len(parts)} tensors of shapes {[list(p.shape) for p in parts]}, "
                         f"expected {shard_count} of {list(t.shape)}")
    return torch.stack([p.to(t.device) for p in parts])


def _sharded_lse(x: torch.Tensor, shard_index: int, shard_count: int, all_gather: AllGather) -> torch.Tensor:
    """log(sum(exp(x))) over the whole vocabulary from this shard's fp32 x [..., V / S] -> [..., 1]."""
    check_shards(x.shape[-1] * shard_count, shard_index, shard_count)
    m_local = x.amax(dim=-1)
    # exact in any order: the gathered maxes' max is the unsharded max
    m = _shift(_gathered(all_gather, m_local, shard_count).amax(dim=0)).unsqueeze(-1)
    # this shard's VOCAB_SLICES / S slices are one subtree of the unsharded tree (S | VOCAB_SLICES)
    part = pair_tree(_slice_sums(ew.exp(x - m), VOCAB_SLICES // shard_count))
    parts = _gathered(all_gather, part, shard_count)  # [S, ...], shard order = vocabulary order
    total = pair_tree(parts.movedim(0, -1))  # the tree's top log2(S) levels
    return m + ew.log(total).unsqueeze(-1)


def log_softmax_sharded(local_logits: torch.Tensor, shard_index: int, shard_count: int, all_gather: AllGather,
                        temperature: float = 1.0) -> torch.Tensor:
    """The contract's log-softmax of a vocabulary cut into ``shard_count`` (S) contiguous equal shards: this shard's
    [..., V / S] logits (any float dtype) -> [..., V / S] float32, the unsharded bits (S a power of two dividing
    VOCAB_SLICES, V a multiple of it). all_gather: this shard's tensor -> every shard's, in shard order."""
    x = scale(local_logits, temperature)
    return x - _sharded_lse(x, shard_index, shard_count, all_gather)


def token_logprobs_sharded(local_logits: torch.Tensor, token_ids: torch.Tensor, shard_index: int,
                           shard_count: int, all_gather: AllGather, temperature: float = 1.0) -> torch.Tensor:
    """``token_logprobs`` from a vocab shard: [..., V / S] logits, [...] global ids in [0, V) -> [...] float32 on
    every shard, the unsharded bits (the owner's entry chosen from the all-gathered candidates: no rounding).
    Differentiable: each shard's gradient is the vocab-parallel cross entropy's, (onehot(id) - softmax) / T on its
    own entries (``_ShardedTokenLogprobs``)."""
    if torch.is_grad_enabled() and local_logits.requires_grad:
        return _ShardedTokenLogprobs.apply(local_logits, token_ids, shard_index, shard_count, all_gather,
                                           float(temperature))
    return _token_logprobs_sharded(local_logits, token_ids, shard_index, shard_count, all_gather, temperature)


def _token_logprobs_sharded(local_logits: torch.Tensor, token_ids: torch.Tensor, shard_index: int,
                            shard_count: int, all_gather: AllGather, temperature: float = 1.0) -> torch.Tensor:
    x = scale(local_logits, temperature)
    v = x.shape[-1]
    lse = _sharded_lse(x, shard_index, shard_count, all_gather)
    ids = sharded_ids(x, token_ids, shard_count)
    # every shard offers its entry at the id (clamped where another shard owns it); the owner's is kept
    local = (ids - shard_index * v).clamp(0, v - 1)
    cand = (x.gather(-1, local.unsqueeze(-1)) - lse).squeeze(-1)
    cands = _gathered(all_gather, cand, shard_count)  # [S, ...]
    owner = torch.div(ids, v, rounding_mode="floor")
    return cands.gather(0, owner.unsqueeze(0)).squeeze(0)


class _ShardedTokenLogprobs(torch.autograd.Function):
    """``token_logprobs_sharded`` with the vocab-parallel cross entropy's analytic backward, (onehot(id) -
    softmax(x)) / T on this shard's entries. Every shard has the whole loss, so nothing is communicated; through
    the gathered max each shard would get only its share of that (zero-sum) path."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, token_ids: torch.Tensor, shard_index: int, shard_count: int,
                all_gather: AllGather, temperature: float) -> torch.Tensor:
        lp = _token_logprobs_sharded(local, token_ids, shard_index, shard_count, all_gather, temperature)
        ctx.save_for_backward(log_softmax_sharded(local, shard_index, shard_count, all_gather, temperature),
                              token_ids.to(device=local.device, dtype=torch.int64))
        ctx.offset, ctx.temperature, ctx.dtype = shard_index * local.shape[-1], temperature, local.dtype
        return lp

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lp_local, ids = ctx.saved_tensors
        v = lp_local.shape[-1]
        g = grad.to(torch.float32)
        out = -torch.exp(lp_local) * g.unsqueeze(-1)
        local = ids - ctx.offset
        mine = ((local >= 0) & (local < v)).to(torch.float32)
        out.scatter_add_(-1, local.clamp(0, v - 1).unsqueeze(-1), (g * mine).unsqueeze(-1))
        return (out / ctx.temperature).to(ctx.dtype), None, None, None, None, None
