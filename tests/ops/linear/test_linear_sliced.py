"""The row-parallel linear layer (``ops.linear.sliced``): the same bits at every TP degree dividing the
contract's slice count, S = 1 the plain linear, and the all-reduce it replaces shown to differ."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aligned_mamba.contract import Contract
from aligned_mamba.errors import ContractError
from aligned_mamba.ops.backend import resolve
from aligned_mamba.ops.linear import row_parallel_linear
from aligned_mamba.parallel import TPGroup, shard, threads

BACKEND = resolve(Contract(256))  # the CPU backend: the C loops where they load
PARTIAL = BACKEND.linear_partial


def _tp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, slices: int, size: int) -> list[torch.Tensor]:
    """Every rank's output of the row-parallel GEMM at TP ``size`` (ranks as threads)."""

    def rank(group: TPGroup) -> torch.Tensor:
        k = shard(x.shape[1], group)
        return row_parallel_linear(x[:, k], w[:, k], b, slices=slices, group=group, partial=PARTIAL)

    return threads(rank, size)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 9), kc=st.integers(1, 12), n=st.integers(1, 24), log_s=st.integers(0, 3),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_every_tp_degree_gives_tp1s_bits(m: int, kc: int, n: int, log_s: int, dtype: torch.dtype, bias: bool,
                                          seed: int) -> None:
    s = 1 << log_s
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, kc * s, generator=g).to(dtype)
    w = (torch.randn(n, kc * s, generator=g) / 4).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    one = row_parallel_linear(x, w, b, slices=s, group=TPGroup.single(), partial=PARTIAL)
    assert one.dtype == dtype and one.shape == (m, n)
    if s == 1:  # one slice is today's linear, bit for bit
        assert torch.equal(one, BACKEND.linear(x, BACKEND.linear_weight(w), b))
    size = 2
    while size <= s:
        for got in _tp(x, w, b, s, size):
            assert torch.equal(got, one), (size, s)
        size *= 2


def test_prepared_slice_weights_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g).bfloat16(), torch.randn(12, 64, generator=g).bfloat16()
    ws = [BACKEND.linear_weight(w[:, j * 16:(j + 1) * 16]) for j in range(4)]
    single = TPGroup.single()
    assert torch.equal(row_parallel_linear(x, ws, None, slices=4, group=single, partial=PARTIAL),
                       row_parallel_linear(x, w, None, slices=4, group=single, partial=PARTIAL))


def _all_reduced(x: torch.Tensor, w: torch.Tensor, size: int) -> torch.Tensor:
    """Stock row parallelism (Megatron's RowParallelLinear): each rank's GEMM over its K rounded to the
    model dtype, then summed across ranks (an all-reduce; here in rank order)."""
    parts = [BACKEND.linear(x[:, k], w[:, k]) for k in (shard(x.shape[1], TPGroup(r, size, None)) for r in range(size))]
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_the_all_reduce_it_replaces_differs(size: int) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g).bfloat16(), (torch.randn(128, 256, generator=g) / 16).bfloat16()
    aligned = [row_parallel_linear(x, w, None, slices=8, group=TPGroup.single(), partial=PARTIAL)]
    aligned += _tp(x, w, None, 8, size)
    assert all(torch.equal(a, aligned[0]) for a in aligned)
    one = BACKEND.linear(x, BACKEND.linear_weight(w))
    stock = _all_reduced(x, w, size)
    differing = (stock != one).any(dim=1).sum().item()
    assert differing > 0, "stock TP should round differently from TP 1 on some rows"


def test_refusals_are_one_line() -> None:
    x, w = torch.zeros(2, 12), torch.zeros(3, 12)
    with pytest.raises(ValueError, match="multiple of the slice count"):
        row_parallel_linear(x, w, None, slices=8, group=TPGroup.single(), partial=PARTIAL)
    with pytest.raises(ValueError, match="power of two"):
        row_parallel_linear(x, w, None, slices=3, group=TPGroup.single(), partial=PARTIAL)
    with pytest.raises(ValueError, match="must divide row_parallel_slices"):
        threads(lambda grp: row_parallel_linear(x[:, :6], w[:, :6], None, slices=1, group=grp, partial=PARTIAL), 2)


def test_contract_field() -> None:
    assert Contract(256).fingerprint == Contract(256, row_parallel_slices=1).fingerprint
    assert "row_parallel_slices" not in Contract(256).to_dict()
    c = Contract(256, row_parallel_slices=4)
    assert c.fingerprint != Contract(256).fingerprint and c.to_dict()["row_parallel_slices"] == 4
    assert Contract.from_dict(c.to_dict()) == c
    assert ("row_parallel_slices", 4, 1) in c.diff(Contract(256))
    for bad in (0, 3, True, 2.0, 2048):
        with pytest.raises(ContractError, match="row_parallel_slices"):
            Contract(256, row_parallel_slices=bad)
    assert Contract(256, backend="triton", row_parallel_slices=2).row_parallel_slices == 2
    with pytest.raises(ContractError, match="triton backend: its tree GEMM sums at most 16 slices"):
        Contract(256, backend="triton", row_parallel_slices=32)
