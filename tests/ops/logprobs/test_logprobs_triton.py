"""The Triton log-softmax and token logprobs (``ops/logprobs/triton.py``), forward and backward.

- interpreter (the Triton interpreter on a CPU; compiled where a GPU runs them): fp32, tiny shapes,
  the logic against the torch ops: log-softmax over ragged vocabulary blocks with -inf entries and an
  all -inf row, token logprobs as its entries, a row alone giving the same bits; the backward in one
  pass a row against the torch form from the same output (dense and broadcast gradients), the same
  bits twice; the token logprob's Function (no logits-sized fp32 held) against log-softmax then gather.
- the split grid (interpreter and gpu): a program per row and slice gives the one-program bits.
- the vocab-sharded form (interpreter and gpu): the slices' (max, sum) of any power-of-two shard count
  join to the row's lse bit for bit; the sharded token logprob and its gradient are the unsharded kernel's
  bits and each shard's columns of its gradient; Megatron's way of joining shards (the all-reduced max, then
  the shards' sums of exponentials all-reduced) gives other bits, so the equality can fail.
- gpu (skipped without CUDA; run on the H200): a 256k vocabulary in bf16: a row's bits do not depend
  on the other rows of the call, token logprobs are log-softmax's entries, close to fp64; the token
  logprobs op under autograd is log-softmax then gather's bits, forward and backward.

The contract's function and its vocab-sharded form (torch, no Triton): tests/ops/logprobs/test_logprobs.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

pytest.importorskip("triton")

from fp64_reference import rel_err  # noqa: E402
from kernel_cases import CFG, DEV, gpu, rand, rows_invariant  # noqa: E402

from aligned_mamba.ops import logprobs  # noqa: E402
from aligned_mamba.ops.configs import TritonKernelConfigs  # noqa: E402
from aligned_mamba.ops.logprobs import triton as lpt  # noqa: E402
from aligned_mamba.parallel import threads  # noqa: E402


@pytest.mark.interpreter
def test_log_softmax_matches_the_torch_op_and_token_logprobs_are_its_entries():
    cfg = dataclasses.replace(CFG, logprobs_block_v=128)  # 300 logits: three blocks, the last ragged
    x = rand(4, 300, seed=50, scale=5.0)
    x[1, 7] = -float("inf")
    x[3] = -float("inf")
    lp = lpt.log_softmax_triton(x, cfg)
    ref = logprobs.log_softmax(x)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(lp)) and torch.equal(torch.isnan(lp), torch.isnan(ref))
    torch.testing.assert_close(lp[fin], ref[fin], rtol=1e-6, atol=2e-6)
    tok = torch.tensor([1, 7, 299, 0], device=DEV)
    tp, lse = lpt.token_logprobs_triton(x, tok, cfg, return_lse=True)
    assert torch.equal(tp[:3], lp[torch.arange(3), tok[:3]])
    assert torch.isnan(tp[3]) and lse[3] == -float("inf")
    # a row alone gives the same bits
    assert torch.equal(lpt.log_softmax_triton(x[2:3], cfg), lp[2:3])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_softmax_backward_kernel_is_the_torch_forms_gradient(dtype):
    """The logits' gradient in one pass a row (``log_softmax_backward_triton``, the Function's backward)
    against the torch form from the same output: equal but for the row sum's order (within fp32
    rounding before the cast to ``dtype``), for a dense g and for a broadcast one (stride 0), and the
    same bits twice. A backward that dropped the softmax term would be off by its whole size."""
    from aligned_mamba.ops.logprobs import sliced

    cfg = TritonKernelConfigs(logprobs_block_v=128)  # several blocks a row
    out = torch.log_softmax(rand(5, 300, seed=31, scale=3.0), -1).to(DEV)
    for g in (rand(5, 300, seed=32).to(DEV), torch.ones((), device=DEV).expand(5, 300)):
        got = lpt.log_softmax_backward_triton(out, g, dtype, cfg)
        want = sliced.log_softmax_backward(out, g, dtype)
        assert got.dtype == dtype and torch.equal(got, lpt.log_softmax_backward_triton(out, g, dtype, cfg))
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        assert rel_err(got, want.double()) < tol, rel_err(got, want.double())
        assert rel_err(g.to(dtype), want.double()) > 0.1  # what the softmax term contributes


@pytest.mark.interpreter
def test_token_logprobs_function_holds_no_logits_sized_fp32_and_keeps_the_gather_paths_bits():
    """``_TokenLogprobs`` (a token's logprob with its own backward, from the logits and lse) against
    log-softmax then gather: the same forward bits, the same gradient bits (the backward kernel is the
    log-softmax backward's for a gradient that is g at the token and zero elsewhere), and what it saves is
    the caller's logits, the ids and lse [M]. The gather path saves an [M, V] fp32 tensor of its own,
    which the check on saved tensors shows, so that check can fail."""
    cfg = dataclasses.replace(CFG, logprobs_block_v=128)  # 300 logits: three blocks, the last ragged
    x = rand(5, 300, seed=51, scale=4.0)
    ids = torch.tensor([0, 299, 128, 7, 255], device=DEV)
    g = rand(5, seed=52)

    def run(fn):
        xs = x.clone().requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(xs)
        out.backward(g)
        own = [t for t in saved if t.shape == x.shape and t.untyped_storage().data_ptr() !=
               xs.untyped_storage().data_ptr()]
        return out.detach(), xs.grad, own

    got, dx, own = run(lambda xs: lpt._TokenLogprobs.apply(xs, ids, cfg))
    want, dx_want, own_want = run(lambda xs: lpt._LogSoftmax.apply(xs, cfg).gather(1, ids[:, None]).squeeze(1))
    assert torch.equal(got, want) and torch.equal(dx, dx_want)
    assert not own and own_want


@pytest.mark.interpreter
@pytest.mark.parametrize("v", [2432, 300], ids=["ragged", "short-slices"])
def test_the_split_grid_gives_the_one_program_forms_bits(v):
    """``logprobs_split_max_m``: a program per row and slice, then the join (with the write, or the token's entry),
    gives the one-program kernels' log-softmax, token logprobs and lse bit for bit: -inf entries, an all -inf row,
    a slice past the row's end (V = 300). Stock torch.log_softmax gives other bits, so the equality can fail."""
    one = dataclasses.replace(CFG, logprobs_block_v=128, logprobs_split_max_m=0)
    many = dataclasses.replace(one, logprobs_split_max_m=16)
    x = rand(6, v, seed=70, scale=5.0)
    x[1, 5] = -float("inf")
    x[4] = -float("inf")
    tok = torch.tensor([0, v - 1, 7, 100, 0, v // 2], device=DEV)
    assert lpt.split(6, many) and not lpt.split(6, one) and not lpt.split(17, many)

    def bits(t: torch.Tensor) -> torch.Tensor:  # NaN (the all -inf row) compares by its bits
        return t.view(torch.int32)

    lp = lpt.log_softmax_triton(x, one)
    assert torch.equal(bits(lpt.log_softmax_triton(x, many)), bits(lp))
    out, lse = lpt.token_logprobs_triton(x, tok, one, return_lse=True)
    out_s, lse_s = lpt.token_logprobs_triton(x, tok, many, return_lse=True)
    assert torch.equal(bits(out_s), bits(out)) and torch.equal(lse_s, lse) and torch.isnan(out_s[4])
    fin = torch.isfinite(lp)
    assert not torch.equal(torch.log_softmax(x, -1)[fin], lp[fin])


# -- the vocab-sharded form ------------------------------------------------------------------------------


@pytest.fixture
def one_launch_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank threads (``parallel.threads``) launch interpreted kernels one at a time: the interpreter patches
    module state for the length of a launch. (Compiled kernels need no lock.)"""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    lock, run = threading.Lock(), InterpretedFunction.run

    def locked(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", locked)


def _megatron_join(x: torch.Tensor, shards: int) -> torch.Tensor:
    """lse as Megatron's vocab-parallel cross entropy joins shards: the all-reduced max, then each shard's sum of
    exp(x - max) all-reduced (here added in rank order)."""
    parts = [p.to(torch.float32) for p in x.chunk(shards, dim=1)]
    m = torch.stack([p.amax(-1) for p in parts]).amax(0)
    return m + torch.log(sum(torch.exp(p - m[:, None]).sum(-1) for p in parts))


def _sharded(x: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, shards: int, cfg: TritonKernelConfigs):
    """Every shard's (token logprobs, gradient of its logits against g), the ranks as threads."""
    def rank(group):
        part = x.chunk(shards, dim=1)[group.rank].clone().requires_grad_()
        out = lpt._ShardedTokenLogprobs.apply(part, ids, group.rank, shards, group.all_gather, cfg)
        out.backward(g)
        return out.detach(), part.grad

    return threads(rank, shards)


@pytest.mark.interpreter
@pytest.mark.parametrize("v, block", [(1024, 128), (4096, 256), (2432, 128)], ids=["1-block", "2-blocks", "ragged"])
def test_the_slices_of_any_shard_count_join_to_the_rows_lse(v, block):
    """Each shard's slices' (max, sum), concatenated in vocabulary order, join to the lse the one-row kernel
    returns, bit for bit, at 1, 2, 4 and 8 shards: rows with -inf entries, an all -inf shard, an all -inf row.
    Megatron's join of the same shards gives other bits in some rows."""
    cfg = dataclasses.replace(CFG, logprobs_block_v=block)
    x = rand(16, v, seed=60, scale=5.0)
    x = x - torch.logsumexp(x, -1, keepdim=True) + 0.3  # lse near 0.3: the sum's last bits show in it
    x[1, 5] = -float("inf")
    x[2, : v // 2] = -float("inf")
    x[4] = -float("inf")
    _, lse = lpt.token_logprobs_triton(x, torch.zeros(16, dtype=torch.int64, device=DEV), cfg, return_lse=True)
    for shards in (1, 2, 4, 8):
        stats = torch.cat([lpt.slice_stats_triton(p, 8 // shards, cfg) for p in x.chunk(shards, dim=1)], dim=2)
        assert torch.equal(lpt.lse_of_stats_triton(stats), lse), shards
    fin = torch.isfinite(lse)
    assert not torch.equal(_megatron_join(x, 2)[fin], lse[fin])


@pytest.mark.interpreter
def test_sharded_token_logprobs_and_gradients_are_the_unsharded_kernels_bits(one_launch_at_a_time):
    """The sharded Function at 2 and 4 shards (ranks as threads): every shard's logprobs are the unsharded
    ``_TokenLogprobs``'s bits, and each shard's gradient is its columns of the unsharded gradient."""
    cfg = dataclasses.replace(CFG, logprobs_block_v=128)  # two blocks a slice
    x = rand(5, 2048, seed=61, scale=4.0)
    ids = torch.tensor([0, 2047, 1024, 255, 1500], device=DEV)
    g = rand(5, seed=62)
    xs = x.clone().requires_grad_()
    want = lpt._TokenLogprobs.apply(xs, ids, cfg)
    want.backward(g)
    for shards in (2, 4):
        for r, (out, dx) in enumerate(_sharded(x, ids, g, shards, cfg)):
            assert torch.equal(out, want.detach()), (shards, r)
            assert torch.equal(dx, xs.grad.chunk(shards, dim=1)[r]), (shards, r)


def test_a_vocabulary_whose_shards_are_not_whole_slices_is_refused() -> None:
    """V = 2400 is a multiple of 8 (the torch form shards it) but not of 128: its shards would not be whole slices
    of the triton form's (widths a multiple of 16)."""
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of 128") as e:
        lpt.token_logprobs_sharded_triton(torch.zeros(2, 1200), ids, 0, 2, lambda t: [t, t], CFG)
    assert "\n" not in str(e.value)
    lpt.check_shards(2400, 0, 1)  # one shard: any vocabulary


# -- gpu ------------------------------------------------------------------------------------------------


@gpu
def test_gpu_logprob_rows_do_not_depend_on_m():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(300, 256000, device="cuda", generator=g) * 4).to(torch.bfloat16)
    ms = [1, 7, 64]
    assert all(n == 0 for _, n in rows_invariant(lambda t: lpt.log_softmax_triton(t, CFG), x, ms))
    tok = torch.randint(0, 256000, (300,), generator=g, device="cuda")
    lp = lpt.log_softmax_triton(x, CFG)
    assert torch.equal(lpt.token_logprobs_triton(x, tok, CFG), lp.gather(1, tok[:, None]).squeeze(1))
    ref = torch.log_softmax(x.double(), dim=-1)
    assert (lp.double() - ref).abs().max().item() < 1e-4


@gpu
def test_gpu_token_logprobs_op_is_the_gather_paths_bits_forward_and_backward():
    """The triton backend's ``token_logprobs`` op on a 256k bf16 vocabulary under autograd: log_softmax then
    gather's bits forward and backward, at T = 1 and 0.7; an id out of range is refused in one line."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(64, 256000, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    ids = torch.randint(0, 256000, (64,), generator=gen, device="cuda")
    g = torch.randn(64, device="cuda", generator=gen)
    for t in (1.0, 0.7):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = lpt.token_logprobs(a, ids, t, cfg=CFG)
        want = lpt.log_softmax(b, t, cfg=CFG).gather(1, ids[:, None]).squeeze(1)
        assert torch.equal(got, want)
        got.backward(g)
        want.backward(g)
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="out of range") as e:
        lpt.token_logprobs(x, torch.full_like(ids, 256000), cfg=CFG)
    assert "\n" not in str(e.value)


@gpu
def test_gpu_sharded_token_logprobs_are_the_unsharded_bits_forward_and_backward():
    """The same on the GPU at a 256k bf16 vocabulary, 2, 4 and 8 shards; through the op (``token_logprobs_sharded``
    at T = 0.7) too; Megatron's join differs."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(64, 256000, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    ids = torch.randint(0, 256000, (64,), generator=gen, device="cuda")
    g = torch.randn(64, device="cuda", generator=gen)
    xs = x.clone().requires_grad_()
    want = lpt._TokenLogprobs.apply(xs, ids, CFG)
    want.backward(g)
    for shards in (2, 4, 8):
        for r, (out, dx) in enumerate(_sharded(x, ids, g, shards, CFG)):
            assert torch.equal(out, want.detach()) and torch.equal(dx, xs.grad.chunk(shards, dim=1)[r]), (shards, r)
    xf = x.to(torch.float32)
    xf = xf - torch.logsumexp(xf, -1, keepdim=True) + 0.3  # lse near 0.3: the sum's last bits show in it
    assert not torch.equal(_megatron_join(xf, 2), lpt.token_logprobs_triton(xf, ids, CFG, return_lse=True)[1])
    whole = lpt.token_logprobs(x, ids, 0.7, cfg=CFG)
    got = threads(lambda grp: lpt.token_logprobs_sharded(x.chunk(2, dim=1)[grp.rank], ids, grp.rank, 2,
                                                         grp.all_gather, 0.7, cfg=CFG), 2)
    assert all(torch.equal(t, whole) for t in got)


@gpu
def test_gpu_split_grid_gives_the_one_program_forms_bits():
    """``logprobs_split_max_m`` on the GPU (256k bf16 vocabulary, 1 and 64 rows): log-softmax, token logprobs and
    lse are the one-program kernels' bits (the slice walk compiled at the same block and warps)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    many = dataclasses.replace(CFG, logprobs_split_max_m=64)
    one = dataclasses.replace(CFG, logprobs_split_max_m=0)
    for m in (1, 64):
        x = (torch.randn(m, 256000, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        ids = torch.randint(0, 256000, (m,), generator=gen, device="cuda")
        assert lpt.split(m, many) and not lpt.split(m, one)
        assert torch.equal(lpt.log_softmax_triton(x, many), lpt.log_softmax_triton(x, one))
        out, lse = lpt.token_logprobs_triton(x, ids, one, return_lse=True)
        out_s, lse_s = lpt.token_logprobs_triton(x, ids, many, return_lse=True)
        assert torch.equal(out_s, out) and torch.equal(lse_s, lse)
