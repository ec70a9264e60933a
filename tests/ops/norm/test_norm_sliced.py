"""The gated norm over tensor-parallel slices in Triton (``ops/norm/triton_sliced.py``).

- interpreter: TP 1, 2, 4 and 8 (ranks as threads, their kernel launches one at a time) give TP 1's bits
  over 1, 2 and 4 groups (groups split across ranks and whole on one), with slices of a power-of-two width
  and of a two-block one; each rank's output within fp32 roundings of the torch form; a rank without rows
  still meets the all-gather; the backward's kernels give TP 1's gradient bits at every TP degree, within
  fp32 roundings of the torch form's gradient. The baseline: a per-rank norm (each rank's channels
  normalised alone) differs from TP 1, in the output and in the gradient.
- gpu: the same TP equality in bf16 at the 8B hybrid's widths (8 groups of 1024, 16 slices) and the 2.7b's
  one group of 5120 (slices of 1280: two blocks), forward and gradient, and the rows of a call independent
  of M.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import CFG, DEV, gpu, rand, rows_invariant  # noqa: E402

from aligned_mamba.ops import norm  # noqa: E402
from aligned_mamba.ops.norm import triton_sliced as ns  # noqa: E402
from aligned_mamba.parallel import TPGroup, shard, threads  # noqa: E402


def _ranks(fn, size: int) -> list[torch.Tensor]:
    """fn(group) on ``size`` thread ranks, one rank's code at a time outside the all-gather's wait: the
    interpreter's launches do not interleave."""
    lock = threading.Lock()

    def rank(group: TPGroup) -> torch.Tensor:
        def all_gather(x: torch.Tensor) -> torch.Tensor:
            lock.release()
            try:
                return group.all_gather(x)
            finally:
                lock.acquire()

        with lock:
            return fn(TPGroup(group.rank, group.size, all_gather))

    return threads(rank, size)


def _sharded(y, z, w, groups: int, slices: int, size: int) -> torch.Tensor:
    def fn(grp: TPGroup) -> torch.Tensor:
        ch = shard(y.shape[1], grp)
        return ns.gated_rms_norm_sliced_triton(y[:, ch], z[:, ch], w[ch], 1e-5, groups, slices=slices, group=grp,
                                               cfg=CFG)

    return torch.cat(_ranks(fn, size), dim=1)


@pytest.mark.interpreter
@pytest.mark.parametrize("d,slices", [(64, 8), (80, 4)])  # slices of 8 and of 20 (16 + 4: two blocks)
def test_every_tp_degree_gives_tp1s_bits(d, slices):
    y, w = rand(5, d, seed=1), rand(d, seed=2)
    z = rand(5, d + 16, seed=3)[:, 8:8 + d]  # a column slice, as in_proj's output gives it
    single = TPGroup.single()
    for groups in (1, 2, 4):
        if d // groups % slices:
            continue
        one = ns.gated_rms_norm_sliced_triton(y, z, w, 1e-5, groups, slices=slices, group=single, cfg=CFG)
        torch.testing.assert_close(one, norm.gated_rms_norm(y, z, w, 1e-5, groups), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(one, norm.gated_rms_norm_sliced(y, z, w, 1e-5, groups, slices=slices,
                                                                   group=single), rtol=1e-5, atol=1e-6)
        for size in (2, 4, 8):
            if size > slices * groups or d % size:
                continue
            assert torch.equal(_sharded(y, z, w, groups, slices, size), one), (groups, size)
        # the baseline: each rank's channels normalised alone (a group cut across ranks) is not TP 1
        if groups < 4:
            def alone(grp: TPGroup) -> torch.Tensor:
                ch = shard(d, grp)
                return ns.gated_rms_norm_sliced_triton(y[:, ch], z[:, ch], w[ch], 1e-5, 1, slices=1,
                                                       group=TPGroup.single(), cfg=CFG)

            assert not torch.equal(torch.cat(_ranks(alone, 4), dim=1), one)


@pytest.mark.interpreter
def test_a_rank_without_rows_meets_the_all_gather():
    y = torch.zeros(0, 32, device=DEV)

    def fn(grp: TPGroup) -> tuple[int, ...]:
        return tuple(ns.gated_rms_norm_sliced_triton(y, y, torch.ones(32, device=DEV), 1e-5, 1, slices=4, group=grp,
                                                     cfg=CFG).shape)

    assert _ranks(fn, 2) == [(0, 32), (0, 32)]


def _autograd(fn, y, z, w, g) -> tuple[torch.Tensor, ...]:
    """(dy, dz, dweight) of fn(y, z, w) against g, through autograd."""
    leaves = [t.clone().requires_grad_() for t in (y, z, w)]
    return torch.autograd.grad(fn(*leaves), leaves, g)


def _grads(y, z, w, g, groups: int, slices: int, grp: TPGroup, torch_form: bool = False) -> tuple[torch.Tensor, ...]:
    """(dy, dz, dweight) of the sliced norm (the Triton Function, or the torch form) against g."""
    if torch_form:
        return _autograd(lambda *a: norm.gated_rms_norm_sliced(*a, 1e-5, groups, slices=slices, group=grp), y, z, w,
                         g)
    return _autograd(lambda *a: ns.gated_rms_norm_sliced(*a, 1e-5, groups, slices=slices, group=grp, cfg=CFG), y, z,
                     w, g)


def _sharded_grads(y, z, w, g, groups: int, slices: int, size: int) -> list[torch.Tensor]:
    """Each rank's forward and backward called directly, not through autograd: a CUDA backward runs on
    autograd's device thread, where one rank waiting in the all-gather would hold up the others."""
    def fn(grp: TPGroup) -> tuple[torch.Tensor, ...]:
        ch = shard(y.shape[1], grp)
        _, ss = ns.gated_rms_norm_sliced_triton(y[:, ch], z[:, ch], w[ch], 1e-5, groups, slices=slices, group=grp,
                                                cfg=CFG, with_ss=True)
        return ns.gated_rms_norm_sliced_backward_triton(y[:, ch], z[:, ch], w[ch], 1e-5, groups, g[:, ch], ss,
                                                        slices=slices, group=grp, cfg=CFG)

    parts = _ranks(fn, size)
    return [torch.cat([p[i] for p in parts], dim=-1) for i in range(3)]


@pytest.mark.interpreter
@pytest.mark.parametrize("d,slices", [(64, 8), (80, 4)])
def test_the_gradient_at_every_tp_degree_is_tp1s(d, slices):
    """The backward's kernels (the slices' shares of sum(g w vhat) joined as the squares are): TP 2, 4 and 8
    give TP 1's dy, dz and dweight bits; TP 1 within fp32 roundings of the torch form's gradient."""
    y, w, g = rand(5, d, seed=11), rand(d, seed=12), rand(5, d, seed=13)
    z = rand(5, d + 16, seed=14)[:, 8:8 + d]
    single = TPGroup.single()
    for groups in (1, 2):
        if d // groups % slices:
            continue
        one = _grads(y, z, w, g, groups, slices, single)
        ref = _grads(y, z, w, g, groups, slices, single, torch_form=True)
        for a, b in zip(one, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        for size in (2, 4, 8):
            if size > slices * groups or d % size:
                continue
            got = _sharded_grads(y, z, w, g, groups, slices, size)
            assert all(torch.equal(a, b) for a, b in zip(got, one)), (groups, size)
        if groups == 1:  # the baseline: each rank's channels normalised alone
            alone = [torch.cat(p, dim=-1) for p in zip(*[
                _grads(y[:, ch], z[:, ch], w[ch], g[:, ch], 1, 1, single)
                for ch in (shard(d, TPGroup(r, 2, None)) for r in range(2))])]
            assert not any(torch.equal(a, b) for a, b in zip(alone[:2], one[:2]))


@pytest.mark.interpreter
@pytest.mark.parametrize("silu", ["ieee", "device"])
def test_one_slice_gradient_is_the_unsliced_kernels(silu):
    """One slice a group at TP 1 sums as the unsliced gated norm's backward does: the same dy, dz, dweight
    bits, with either SiLU, so the sliced backward differentiates the SiLU its forward runs. The baseline:
    against the other SiLU's unsliced backward, dz differs."""
    from aligned_mamba.ops.norm import triton as nt

    cfg, other = (dataclasses.replace(CFG, silu=s) for s in (silu, "device" if silu == "ieee" else "ieee"))
    inputs = rand(6, 80, seed=21), rand(6, 80, seed=22, scale=3.0), rand(80, seed=23), rand(6, 80, seed=24)
    sliced = _autograd(lambda *a: ns.gated_rms_norm_sliced(*a, 1e-5, 2, slices=1, group=TPGroup.single(), cfg=cfg),
                       *inputs)
    unsliced = _autograd(lambda *a: nt.gated_rms_norm(*a, 1e-5, 2, cfg), *inputs)
    assert all(torch.equal(a, b) for a, b in zip(sliced, unsliced))
    assert not torch.equal(sliced[1], _autograd(lambda *a: nt.gated_rms_norm(*a, 1e-5, 2, other), *inputs)[1])


# -- gpu ------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("d,groups,slices", [(8192, 8, 16), (5120, 1, 4)])
def test_gpu_every_tp_degree_gives_tp1s_bits(d, groups, slices):
    g = torch.Generator(device="cuda").manual_seed(d)
    y = torch.randn(300, d, device="cuda", generator=g).to(torch.bfloat16)
    z = torch.randn(300, d, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(torch.bfloat16)
    one = ns.gated_rms_norm_sliced_triton(y, z, w, 1e-5, groups, slices=slices, group=TPGroup.single(), cfg=CFG)
    for size in (2, 4, 8):
        if slices * groups % size == 0:
            assert torch.equal(_sharded(y, z, w, groups, slices, size), one), size

    def call(t: torch.Tensor) -> torch.Tensor:
        return ns.gated_rms_norm_sliced_triton(t[:, :d], t[:, d:], w, 1e-5, groups, slices=slices,
                                               group=TPGroup.single(), cfg=CFG)

    assert all(n == 0 for _, n in rows_invariant(call, torch.cat([y, z], dim=1), [1, 7, 300]))
    gy = torch.randn(300, d, device="cuda", generator=g).to(torch.bfloat16)
    grads = _grads(y, z, w, gy, groups, slices, TPGroup.single())
    for size in (2, 4, 8):
        if slices * groups % size == 0:
            assert all(torch.equal(a, b) for a, b in zip(_sharded_grads(y, z, w, gy, groups, slices, size), grads))
    for a, b in zip(grads, _grads(y, z, w, gy, groups, slices, TPGroup.single(), torch_form=True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    ref = norm.gated_rms_norm(y, z, w, 1e-5, groups)  # a bf16 rounding apart at most, in few elements
    diff = (one.float() - ref.float()).abs()
    assert (diff <= ref.float().abs() * 2 ** -6 + 1e-6).all()
    assert (one != ref).float().mean().item() < 0.02
