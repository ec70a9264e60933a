"""Tensor parallelism in the reference model: the logits rows and token logprobs at TP 1, 2 and 4 all
torch.equal under a contract with row_parallel_slices 4 (Mamba2 with n_groups 1 and 8, a hybrid),
through the one-pass forward and the engine's schedules; stock tensor parallelism (the row-parallel
partials all-reduced) shown to differ; the refusals, one line each.

Most tests run the ranks as threads of this process (``parallel.threads``: the same all-gathers
without the processes' start-up); ``test_gloo_processes`` runs them as gloo processes
(``parallel.launch``), as the CLI does."""

from __future__ import annotations

import dataclasses
import re
from functools import cache

import pytest
import torch

from aligned_mamba import tp_reference
from aligned_mamba.check import CASES, make_prompts, scenario_for
from aligned_mamba.contract import Contract
from aligned_mamba.errors import AlignedMambaError
from aligned_mamba.models.mamba2 import make_tiny
from aligned_mamba.models.nemotron_h import make_tiny_hybrid
from aligned_mamba.ops.backend import resolve
from aligned_mamba.ops.logprobs import token_logprobs
from aligned_mamba.ops.norm import gated_rms_norm, gated_rms_norm_sliced
from aligned_mamba.parallel import TPGroup, check_tp, gather_rows, launch, scatter_rows, shard, threads
from aligned_mamba.train import PolicyTrainer

S = 4  # the contract's row_parallel_slices: TP 1, 2 and 4 give the same bits


@cache
def _model(name: str):
    """Small checkpoints: Mamba2 with n_groups 1 (B/C replicated at TP 2 and 4) and 8 (split), a hybrid
    (Mamba2, attention with one KV head, replicated; the MLP), one with a MoE layer (8 experts, 2 a
    token, a shared expert: each expert's channels split, the router whole on every rank)."""
    if name == "g1":
        return make_tiny(0, hidden_size=128, num_heads=8, head_dim=32, state_size=32, n_groups=1,
                         num_hidden_layers=2, chunk_size=32)
    if name == "g8":
        return make_tiny(1, hidden_size=128, num_heads=8, head_dim=32, state_size=32, n_groups=8,
                         num_hidden_layers=2, chunk_size=32)
    if name == "moe":
        return make_tiny_hybrid(3, pattern="M*E", chunk_size=32)
    return make_tiny_hybrid(2, pattern="M*M-", chunk_size=32)


def _contract(slices: int = S, dtype: str = "bfloat16") -> Contract:
    return Contract(32, model_dtype=dtype, row_parallel_slices=slices)


def _seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 512, (n,), generator=g) for n in (45, 7, 70)]


def _logprobs(logits: list[torch.Tensor], seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [token_logprobs(lg[:-1], s[1:]) for lg, s in zip(logits, seqs)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _rows_differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).any(dim=-1).sum()) for x, y in zip(a, b))


@pytest.mark.parametrize("name,dtype", [("g1", "bfloat16"), ("g8", "bfloat16"), ("hybrid", "bfloat16"),
                                        ("g8", "float32"), ("moe", "bfloat16")])
def test_forward_is_the_same_bits_at_tp_1_2_4(name: str, dtype: str) -> None:
    config, tensors = _model(name)
    seqs, c = _seqs(), _contract(dtype=dtype)
    one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
    for size in (2, 4):
        for rank, got in enumerate(threads(tp_reference.forward, size, config, tensors, c, seqs)):
            assert _equal(got, one), (name, size, rank)
            assert _equal(_logprobs(got, seqs), _logprobs(one, seqs))
    # the baseline: stock tensor parallelism (row-parallel partials rounded and all-reduced) at TP 2
    # against its own TP 1, the same weights: rows differ
    stock1 = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs, True)
    stock2 = threads(tp_reference.forward, 2, config, tensors, c, seqs, True)[0]
    assert _rows_differing(stock1, stock2) > 0, name
    assert not _equal(_logprobs(stock1, seqs), _logprobs(stock2, seqs))


def test_one_slice_is_the_model_as_before() -> None:
    """row_parallel_slices 1 (every existing contract) builds today's model: its bits are the plain
    linear's, which S = 4 changes on some rows (the contract's new arithmetic, fingerprinted)."""
    config, tensors = _model("g1")
    seqs = _seqs()
    from aligned_mamba.models import build_model

    plain = build_model(config, tensors, Contract(32, model_dtype="float32")).forward(seqs)
    s1 = tp_reference.forward(TPGroup.single(), config, tensors, _contract(1, "float32"), seqs)
    s4 = tp_reference.forward(TPGroup.single(), config, tensors, _contract(4, "float32"), seqs)
    assert _equal(s1, plain)
    assert _rows_differing(s4, plain) > 0


def _engine_case(group: TPGroup, config, tensors, contract, case_name: str):
    case = next(c for c in CASES if c.name == case_name)
    prompts = make_prompts(512, 70, 3, seed=3)
    return tp_reference.run_scenario(group, config, tensors, contract, scenario_for(case, prompts, 40, 23, 3),
                                     case.exact_replay)


@pytest.mark.parametrize("name,case", [("g1", "chunked_prefill_unaligned"), ("g1", "preempt_recompute"),
                                       ("g8", "mixed_batch"), ("hybrid", "chunked_prefill_unaligned"),
                                       ("hybrid", "preempt_recompute"), ("moe", "chunked_prefill_unaligned")])
def test_engine_schedules_at_tp2_give_the_trainers_tp1_rows(name: str, case: str) -> None:
    """Chunked prefill, decode, preemption and recompute at TP 2: every row the engine emits is the
    TP 1 trainer's one-pass row, and every reported logprob its logprob."""
    config, tensors = _model(name)
    c = _contract()
    got = threads(_engine_case, 2, config, tensors, c, case)
    assert all(_equal([r for _, r in sum(g.rows, [])], [r for _, r in sum(got[0].rows, [])]) for g in got)
    res = got[0]
    seqs = [torch.tensor(t) for t in res.tokens]
    trainer = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
    rows = sum(len(r) for r in res.rows)
    assert rows > 40
    for req_rows, lg, seq, reported in zip(res.rows, trainer, seqs, res.sampled_logprobs):
        for pos, row in req_rows:
            assert torch.equal(row, lg[pos]), (name, case, pos)
        start = len(seq) - 40
        want = token_logprobs(lg[start - 1:start - 1 + len(reported)], seq[start:start + len(reported)])
        assert torch.equal(want, torch.tensor(reported, dtype=torch.float32))


def test_gated_norm_slices() -> None:
    """One slice is the gated norm as before; S slices give the same bits whether a group's slices
    sit on one rank or span 2 or 4 (n_groups 1 and 2 at TP 4: B/C replicated)."""
    g = torch.Generator().manual_seed(0)
    y, z = torch.randn(9, 256, generator=g).bfloat16(), torch.randn(9, 256, generator=g).bfloat16()
    w = torch.randn(256, generator=g).bfloat16()
    single = TPGroup.single()
    for groups in (1, 2, 4):
        assert torch.equal(gated_rms_norm_sliced(y, z, w, 1e-5, groups, slices=1, group=single),
                           gated_rms_norm(y, z, w, 1e-5, groups))
        one = gated_rms_norm_sliced(y, z, w, 1e-5, groups, slices=8, group=single)
        for size in (2, 4, 8):
            def rank(grp: TPGroup, n: int = groups) -> torch.Tensor:
                ch = shard(256, grp)
                return gated_rms_norm_sliced(y[:, ch], z[:, ch], w[ch], 1e-5, n, slices=8, group=grp)

            assert torch.equal(torch.cat(threads(rank, size), dim=1), one), (groups, size)


def _empty_step(group: TPGroup, config, tensors, contract) -> tuple[torch.Size, torch.Size]:
    model = tp_reference.build(group, config, tensors, contract)
    y = torch.zeros(0, 128, dtype=torch.bfloat16)  # this rank's 128 of 256 channels, one group
    norm = gated_rms_norm_sliced(y, y, torch.ones(128, dtype=torch.bfloat16), 1e-5, 1, slices=4, group=group)
    return model.logits(torch.zeros(0, config.hidden_size, dtype=torch.bfloat16)).shape, norm.shape


def test_a_step_without_rows_at_tp2() -> None:
    """An engine step that wants no logits row (a prefill chunk mid-prompt) still meets every rank's
    all-gathers: the empty tensors pass through."""
    config, tensors = _model("g1")
    for logits, norm in threads(_empty_step, 2, config, tensors, _contract()):
        assert logits == (0, 512) and norm == (0, 128)


def _refused(contract: Contract, config, size: int, match: str) -> None:
    with pytest.raises(AlignedMambaError, match=match) as e:
        check_tp(contract, config, size)
    assert "\n" not in str(e.value)


def test_refusals_one_line() -> None:
    g1, _ = _model("g1")
    hybrid, _ = _model("hybrid")
    _refused(_contract(), g1, 3, "power of two")
    _refused(_contract(2), g1, 4, "row_parallel_slices >= 4")
    _refused(Contract(32), g1, 2, "row_parallel_slices >= 2")
    _refused(_contract(16), g1, 16, "vocabulary's log-softmax has 8 fixed slices")
    _refused(_contract(8), dataclasses.replace(g1, vocab_size=500), 2, "vocab_size 500")
    _refused(_contract(8), dataclasses.replace(g1, num_heads=4, head_dim=64), 8, "num_heads 4 refused")
    moe, _ = make_tiny_hybrid(0, pattern="ME")
    check_tp(_contract(), moe, 2)  # each expert cut by channels, the router whole on every rank
    _refused(_contract(128), moe, 1, "MoE moe_intermediate_size 64 refused")
    _refused(_contract(256), hybrid, 1, "Mamba2 intermediate size 128 refused")
    check_tp(_contract(), hybrid, 4)  # 1 KV head replicated over 4 ranks: allowed
    check_tp(_contract(8), g1, 1)


def test_check_parallel_names_the_flag_in_one_line() -> None:
    """``check`` and ``rl`` share one refusal of tensor-parallel degrees: an engine or trainer without tensor
    parallelism (an entry point's), sequence parallelism off Megatron, a degree the contract cannot keep."""
    from aligned_mamba.integrations import check_parallel

    g1, c = _model("g1")[0], _contract()
    sides = dict(trainer="reference", trainer_tp=1, trainer_sp=False, trainer_contract=c, engine="reference",
                 sampler_tp=1, sampler_contract=c)
    check_parallel(g1, **{**sides, "trainer": "megatron", "trainer_tp": 4, "trainer_sp": True, "sampler_tp": 2})
    for change, words in (({"trainer": "other", "trainer_tp": 2}, "--trainer-tp 2 refused: tensor parallelism runs "
                           "on the reference and megatron trainers for now, not other"),
                          ({"engine": "other", "sampler_tp": 2}, "--sampler-tp 2 refused: tensor parallelism runs "
                           "on the reference and vllm engines for now, not other"),
                          ({"trainer_tp": 2, "trainer_sp": True}, "--trainer-sp refused for the reference trainer"),
                          ({"sampler_tp": 8}, "--sampler-tp 8: tensor-parallel size 8 refused: the contract's "
                           "row_parallel_slices is 4"),
                          ({"trainer_tp": 3}, "--trainer-tp 3: tensor-parallel size 3 refused: must be a power")):
        with pytest.raises(AlignedMambaError, match=re.escape(words)) as e:
            check_parallel(g1, **{**sides, **change})
        assert "\n" not in str(e.value)


def _rows_through(group: TPGroup, x: torch.Tensor, summed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank: its rows x [2, 3] gathered, a loss weighted by a rank-specific w (each rank's partial gradient of
    the whole), and the whole [k * 2, 3] kept back to this rank's rows by ``scatter_rows`` under another weight
    v: (the gathered rows, x's gradient, the whole's gradient)."""
    x = x[group.rank].clone().requires_grad_()
    whole = gather_rows(group, x, summed=summed)
    w = torch.arange(whole.numel(), dtype=torch.float32).view_as(whole) / 7 + group.rank
    (whole * w).sum().backward()
    y = whole.detach().clone().requires_grad_()
    v = torch.full((2, 3), 1.0 + group.rank)
    (scatter_rows(group, y) * v).sum().backward()
    return whole.detach(), x.grad, y.grad


@pytest.mark.parametrize("summed", [True, False])
def test_sequence_parallel_rows(summed: bool) -> None:
    """``gather_rows`` / ``scatter_rows``, sequence parallelism's two moves: the gather is every rank's rows in
    rank order; its backward is the ranks' gradients of this rank's rows summed in rank order (``summed``), or
    this rank's own; the scatter keeps this rank's rows, and its backward gathers the ranks' gradients."""
    k = 4
    x = torch.randn(k, 2, 3, generator=torch.Generator().manual_seed(0))
    out = threads(_rows_through, k, x, summed)
    w = [torch.arange(k * 6, dtype=torch.float32).view(k * 2, 3) / 7 + r for r in range(k)]
    for r, (whole, gx, gy) in enumerate(out):
        assert torch.equal(whole, x.reshape(k * 2, 3))
        rows = slice(2 * r, 2 * r + 2)
        want = w[0][rows] + w[1][rows] + w[2][rows] + w[3][rows] if summed else w[r][rows]
        assert torch.equal(gx, want)
        assert torch.equal(gy, torch.cat([torch.full((2, 3), 1.0 + q) for q in range(k)]))
    with pytest.raises(AlignedMambaError, match="5 rows cannot be split into 2 equal sequence-parallel shards"):
        scatter_rows(TPGroup(0, 2, lambda t: t[None]), torch.zeros(5, 3))


def _exchanged(group: TPGroup, parts: torch.Tensor, x: torch.Tensor) -> tuple:
    """One rank: its parts [size, 3, 2] (bf16) through ``exchange``, then ``_rows_through`` (summed)."""
    mine = parts[group.rank]
    return group.all_to_all is not None, group.exchange(mine), _rows_through(group, x, True)


@pytest.mark.engines("own")
def test_exchange_over_gloo_is_an_all_to_all_with_the_all_gathers_bits() -> None:
    """Over gloo processes ``exchange`` is ``all_to_all_single`` (each rank sends only the parts it owes, not its
    whole tensor): rank 0 receives every rank's part 0 in rank order, bit for bit, and sequence parallelism's
    summed backward through it gives the threads' (all-gather) gradients."""
    k = 2
    parts = torch.randn(k, k, 3, 2, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = torch.randn(k, 2, 3, generator=torch.Generator().manual_seed(0))
    has, got, rows = launch(_exchanged, k, parts, x)
    assert has
    assert torch.equal(got, parts[:, 0])
    want = threads(_rows_through, k, x, True)[0]
    assert all(torch.equal(a, b) for a, b in zip(rows, want))
    with pytest.raises(AlignedMambaError, match="exchange takes one part per rank: 3 parts for 2 ranks"):
        TPGroup(0, 2, lambda t: t[None]).exchange(torch.zeros(3, 1))


@pytest.mark.engines("own")
def test_gloo_processes() -> None:
    """The ranks as gloo processes (``launch``): TP 2 on every checkpoint, TP 4 on the hybrid, all the
    TP 1 bits; stock TP 2 (its partials all-reduced) differs."""
    seqs, c = _seqs(), _contract()
    for name in ("g1", "g8", "hybrid"):
        config, tensors = _model(name)
        one = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
        assert _equal(launch(tp_reference.forward, 2, config, tensors, c, seqs), one), name
        if name == "hybrid":
            assert _equal(launch(tp_reference.forward, 4, config, tensors, c, seqs), one)
            stock = launch(tp_reference.forward, 2, config, tensors, c, seqs, True)
            assert _rows_differing(stock, tp_reference.forward(TPGroup.single(), config, tensors, c, seqs, True)) > 0


def test_backend_has_the_sliced_forms() -> None:
    be = resolve(_contract())
    assert be.linear_partial is not None and be.gated_rms_norm_sliced is not None


@pytest.mark.engines("own")
@pytest.mark.parametrize("name,dtype", [("hybrid", "float32"), ("g1", "bfloat16")])
def test_tp_trainer_scores_and_trains_as_tp1(name: str, dtype: str) -> None:
    """The reference trainer at TP 2 (gloo processes kept alive): its logits and token logprobs are TP 1's
    bits; two REINFORCE steps give TP 1's loss and gradients to fp32 rounding (summed in another order),
    and after each its logits are the bits of a TP 1 model on the weights it serves (what a sampler
    computes). The gradients of a TP 2 step whose all-gathers pass no gradient to the other ranks miss
    the sharded layers' terms (a mutation of ``parallel._Gather`` fails here)."""
    config, tensors = _model(name)
    seqs, c = _seqs(), _contract(dtype=dtype)
    pls, adv = [3, 3, 3], [1.0, -0.5, -0.5]
    one = PolicyTrainer(config, tensors, c, lr=1e-3)
    trainer = tp_reference.TPTrainer(config, tensors, c, 2, lr=1e-3)
    try:
        ref = tp_reference.forward(TPGroup.single(), config, tensors, c, seqs)
        assert _equal(trainer.forward(seqs), ref)
        lps = trainer.token_logprobs(seqs, pls)
        assert _equal(lps, [token_logprobs(lg[2:-1], s[3:]) for lg, s in zip(ref, seqs)])
        # loss and norm to fp32 rounding; per tensor, the replicated norms' gradients are sums of the ranks'
        # halves, which cancel (the vocabulary shards' softmax gradients sum to zero): up to 2.5e-3 of the
        # tensor's norm in fp32, 1.5e-2 in bf16 (a TP 2 step without the cross-rank sum: 0.3 to 3)
        tol, per_tensor = (1e-5, 1e-2) if dtype == "float32" else (1e-3, 5e-2)
        for version in (1, 2):
            a, b = one.step(seqs, pls, adv), trainer.step(seqs, pls, adv)
            assert b["weights_version"] == trainer.version == version and b["tokens"] == a["tokens"]
            assert b["loss"] == pytest.approx(a["loss"], rel=tol, abs=tol)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=tol)
            assert one.master is not None
            grads = trainer.gradients()
            assert set(grads) == set(one.master)
            for k, g in grads.items():
                want = one.master[k].grad
                assert want is not None and g.shape == want.shape
                assert float((g - want).norm()) <= per_tensor * float(want.norm()), k
            served = trainer.weights()
            assert {k: v.dtype for k, v in served.items()} == {k: v.dtype for k, v in tensors.items()}
            assert _equal(trainer.forward(seqs), tp_reference.forward(TPGroup.single(), config, served, c, seqs))
        assert any(not torch.equal(served[k], tensors[k]) for k in tensors)  # the weights moved
    finally:
        trainer.close()


@pytest.mark.engines("own")  # a process SIGKILLed, its children waited for
def test_ranks_end_when_their_parent_is_killed(tmp_path) -> None:
    """A parent killed outright (a Ray actor's SIGKILL), here as soon as its ranks exist, sends them no
    stop; they notice it is gone and end (before, they waited on their inbox forever)."""
    import os
    import subprocess
    import sys
    import time

    script = ("import os, signal, time\n"
              "from aligned_mamba.processes import descendants\n"
              "from aligned_mamba.parallel import Ranks\n"
              "if __name__ == '__main__':\n"
              "    ranks = Ranks(2)\n"
              "    while len(descendants(os.getpid())) < 3:\n"  # two ranks and the resource tracker
              "        time.sleep(0.1)\n"
              "    print(*descendants(os.getpid()), flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")
    out = tmp_path / "pids.txt"
    with open(out, "w") as f:  # a file, not a pipe: the orphans would hold a pipe open
        code = subprocess.run([sys.executable, "-c", script], stdout=f, stderr=subprocess.DEVNULL,
                              timeout=120).returncode
    assert code == -9
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) >= 2

    def running(p: int) -> bool:
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 60  # a rank first finishes starting (torch's import, the gloo group)
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if running(p)]
    for p in left:
        os.kill(p, 9)
    assert not left, f"ranks outlived their parent: {left}"


def test_decode_graphs_refused_over_a_host_all_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo group (its all-gather through the host) cannot be captured in a CUDA graph: ``from_torch``
    says so, and an engine asked for graphs over it refuses in one line (the default runs eager); so does
    one over a MoE layer run expert by expert under the slices."""
    import torch.distributed as dist

    from aligned_mamba.engine import SamplerEngine

    # the group as torch.distributed describes it (another test's process group may be live in this worker)
    for name, value in (("is_initialized", True), ("get_world_size", 2), ("get_rank", 1)):
        monkeypatch.setattr(dist, name, lambda *a, v=value, **k: v)
    for backend, capturable in (("gloo", False), ("nccl", True)):
        monkeypatch.setattr(dist, "get_backend", lambda *a, b=backend, **k: b)
        group = TPGroup.from_torch()
        assert (group.rank, group.size, group.capturable) == (1, 2, capturable), backend
    assert TPGroup.single().capturable
    config, tensors = _model("g1")
    host = TPGroup(0, 1, lambda x: x.unsqueeze(0), capturable=False)
    m = tp_reference.build(host, config, tensors, _contract())
    with pytest.raises(AlignedMambaError, match="through the host") as e:
        SamplerEngine(m, num_slots=2, graphs=True)
    assert "\n" not in str(e.value)
    assert SamplerEngine(m, num_slots=2).graphs is None
    # a MoE layer under the slices runs expert by expert, its token counts read on the host: refused too
    moe = tp_reference.build(TPGroup.single(), *_model("moe"), _contract())
    assert tp_reference.build(TPGroup.single(), *_model("moe"), _contract(1)).uncapturable is None
    with pytest.raises(AlignedMambaError, match="MoE layers run expert by expert") as e:
        SamplerEngine(moe, num_slots=2, graphs=True)
    assert "\n" not in str(e.value)
