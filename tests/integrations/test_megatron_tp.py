"""The Megatron hook under tensor parallelism, on the CPU: one process per rank over gloo
(``aligned_mamba.parallel.launch``), Megatron's own model-parallel groups at TP k, each rank loading its
shard of one checkpoint (``megatron_shards``).

With a contract of ``row_parallel_slices`` S, Megatron at TP 1, 2 and 4 gives the reference trainer's TP 1
logits rows and token logprobs under the same contract bit for bit; Megatron's stock forward at TP 2 differs
from its own TP 1 on the same weights (its row-parallel all-reduce rounds in another order), which is what
the equality prevents. The ranks are forked from one process that imported Megatron once
(tests/preloaded_ranks.py); the CLI's own launches still spawn theirs.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from preloaded_ranks import launch  # noqa: E402

import aligned_mamba  # noqa: E402
from aligned_mamba import Contract  # noqa: E402
from aligned_mamba.models import build_model  # noqa: E402
from aligned_mamba.models.mamba2 import make_tiny  # noqa: E402
from aligned_mamba.models.nemotron_h import make_tiny_hybrid  # noqa: E402
from trainer_hooks.megatron import trainer as mc  # noqa: E402

pytestmark = pytest.mark.slow

MAMBA = dict(hidden_size=64, num_heads=8, head_dim=16, state_size=16, num_hidden_layers=2, vocab_size=128,
             conv_kernel=4, chunk_size=16)
HYBRID = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
              intermediate_size=128, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=4,
              chunk_size=16)


def model(name: str, dtype: str = "bfloat16"):
    if name == "hybrid":
        return make_tiny_hybrid(0, pattern="M*M-", dtype=dtype, **HYBRID)
    if name == "hybrid_moe":  # MoE as Nemotron 3 Nano's (8 experts in 4 groups, a shared expert), top 2 of 1 group
        return make_tiny_hybrid(0, pattern="ME*-", dtype=dtype, topk_group=1, **HYBRID)
    groups = {"mamba2_g8": 8, "mamba2_g2": 2, "mamba2_g1": 1}[name]
    return make_tiny(0, dtype=dtype, n_groups=groups, **MAMBA)


def sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (37, 16, 5)]


def reference(config, tensors, contract: Contract, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference trainer at TP 1 under ``contract``: logits rows and the packed next-token logprobs."""
    rows = torch.cat(build_model(config, tensors, contract).forward(seqs))
    labels = torch.cat(seqs).to(torch.int64).roll(-1)
    return rows, aligned_mamba.token_logprobs(rows, labels, 1.0, contract)


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).any(dim=-1).sum())


# n_groups 1 runs at TP 1 only: Megatron's MambaMixer gives each rank whole groups (it asserts
# ngroups % tp_size == 0), and megatron_shards refuses it (test_megatron_shards)
@pytest.mark.parametrize(("name", "tp", "sp"), [
    ("mamba2_g1", 1, False), ("mamba2_g8", 2, False), ("mamba2_g2", 2, False), ("hybrid", 2, False),
    ("hybrid_moe", 2, False), ("mamba2_g8", 4, False), ("hybrid_moe", 2, True), ("mamba2_g8", 4, True)])
def test_hook_at_tp_equals_reference_trainer(name: str, tp: int, sp: bool) -> None:
    """``sp``: Megatron's sequence parallelism, the layers between the mixers on sequence shards (the 59 packed
    tokens padded to 60 at TP 4); the gathers and scatters move rows, so the bits stay."""
    config, tensors = model(name)
    contract = Contract(chunk_size=16, model_dtype="bfloat16", row_parallel_slices=4)
    seqs = sequences(config.vocab_size) + ([torch.tensor([3])] if sp and tp == 4 else [])
    want_rows, want_lp = reference(config, tensors, contract, seqs)
    rows, lp = launch(mc.tp_rank_logits, tp, config, tensors, contract, seqs, True, sp)
    assert rows.shape == want_rows.shape and rows.dtype == want_rows.dtype
    assert differing_rows(rows, want_rows) == 0
    assert torch.equal(lp, want_lp)


@pytest.mark.parametrize("name", ["mamba2_g2", "hybrid"])
def test_stock_megatron_tp2_differs_from_tp1(name: str) -> None:
    """The baseline: Megatron's stock forward on the same converted checkpoint at TP 2 and TP 1."""
    config, tensors = model(name)
    contract = Contract(chunk_size=16, model_dtype="bfloat16")
    seqs = sequences(config.vocab_size)
    tp1, _ = launch(mc.tp_rank_logits, 1, config, tensors, contract, seqs, False)
    tp2, _ = launch(mc.tp_rank_logits, 2, config, tensors, contract, seqs, False)
    assert torch.isfinite(tp1.float()).all()
    # measured: all 58 rows differ (bf16; max |difference| 0.031 for Mamba2, 0.039 for the hybrid)
    assert differing_rows(tp1, tp2) > tp1.shape[0] // 2


def test_moe_baseline_stock_tp2_differs_from_tp1() -> None:
    """The MoE hybrid's baseline: stock Megatron cannot route on a CPU (megatron-core 0.16.1's router GEMM calls
    Transformer Engine's ``te_general_gemm``, absent here), so the stock is the reference model under stock
    tensor parallelism (each row-parallel partial rounded, then summed in rank order) at TP 2 against TP 1."""
    from aligned_mamba import tp_reference
    from aligned_mamba.parallel import TPGroup

    config, tensors = model("hybrid_moe")
    contract = Contract(chunk_size=16, model_dtype="bfloat16", row_parallel_slices=4)
    seqs = sequences(config.vocab_size)
    one = torch.cat(tp_reference.forward(TPGroup.single(), config, tensors, contract, seqs, True))
    two = torch.cat(launch(tp_reference.forward, 2, config, tensors, contract, seqs, True))
    assert differing_rows(one, two) > one.shape[0] // 2


def test_refusals() -> None:
    """What cannot keep the bits is refused before a model is built, in one line naming it."""
    from trainer_hooks.megatron.refusals import parallel_problems

    def problems(**kw) -> list[str]:
        args = dict(tp=1, pp=1, cp=1, fp8=None, hidden_dropout=0.0, slices=4)
        return parallel_problems(**{**args, **kw})

    assert problems(tp=2) == [] and problems(tp=4) == [] and problems(tp=1, slices=1) == []
    assert "row_parallel_slices 1" in problems(tp=2, slices=1)[0]
    assert "row_parallel_slices 4" in problems(tp=8)[0]
    assert "not a power of two" in problems(tp=3, slices=4)[0]
    assert "pipeline parallelism" in problems(pp=2)[0]
    assert "context parallelism" in problems(cp=2)[0]
    assert all("\n" not in p for p in problems(tp=3, pp=2, cp=2))
    config, _ = model("mamba2_g8")
    with pytest.raises(aligned_mamba.errors.ModelLoadError, match="sequence parallel at tensor-parallel size 1"):
        mc.megatron_transformer_config(config, "bfloat16", sequence_parallel=True)
    with pytest.raises(aligned_mamba.errors.ModelLoadError, match="sequence parallel with the hook off"):
        mc.MegatronTrainer(config, {}, Contract(chunk_size=16), hook=False, tp=2, sequence_parallel=True)


def rank_layout(group, config, tensors, contract: Contract) -> list[str]:
    """On each rank: the hooked model at TP k with its shard loaded, checked against Megatron's own
    description of its shards (``sharded_state_dict``: each tensor's global offset, and in_proj / conv1d
    split into z, x, B, C, dt by MambaMixer's factory). Returns every rank's mismatches (names)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from trainer_hooks import megatron as hk
    from trainer_hooks.megatron.weights import hf_to_megatron

    mc.prepare_process(group.size)
    hk.install(contract)
    m = mc.build_mamba_model(config, contract.model_dtype)
    mc.load_hf_weights(m, config, tensors)
    full = hf_to_megatron(tensors, config)
    H, P, G, N = config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size
    parts = {"z": (0, H * P), "x": (H * P, H * P), "B": (2 * H * P, G * N), "C": (2 * H * P + G * N, G * N),
             "dt": (2 * H * P + 2 * G * N, H)}
    checked, bad = 0, []
    for item in m.sharded_state_dict().values():
        pieces = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        for sh in pieces:
            if not isinstance(sh, ShardedTensor):
                continue
            name, _, part = sh.key.rpartition(".")
            if part in parts:  # in_proj.weight.z ... or conv1d.weight.x ...
                offset = parts[part][0] - (H * P if "conv1d" in name else 0)
                whole = full[name].narrow(0, offset, parts[part][1])
            else:
                whole = full[sh.key]
            index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))
            checked += 1
            if not torch.equal(whole[index], sh.data.reshape(sh.local_shape)):
                bad.append(sh.key)
    if checked < 20:
        bad.append(f"only {checked} sharded tensors")
    every: list[list[str]] = [[] for _ in range(group.size)]
    dist.all_gather_object(every, [f"rank {group.rank}: {b}" for b in bad])
    return [b for rank in every for b in rank]


def test_shards_are_megatrons_own_layout() -> None:
    config, tensors = model("hybrid")
    contract = Contract(chunk_size=16, model_dtype="bfloat16", row_parallel_slices=2)
    assert launch(rank_layout, 2, config, tensors, contract) == []


@pytest.mark.parametrize(("name", "tp", "hook"), [("mamba2_g8", 2, "on"), ("mamba2_g8", 2, "off"),
                                                  ("hybrid", 2, "on+sp"), ("mamba2_g8", 4, "on")])
def test_cli_check_trainer_megatron_tp(tmp_path, monkeypatch, name: str, tp: int, hook: str) -> None:
    """``aligned-mamba check --trainer megatron --trainer-tp K`` against the reference engine (TP 1) under one
    contract of row_parallel_slices 4: every exact-replay case 0 differing rows and logprobs; Megatron's
    stock forward at the same TP (hook off) differs. float32: at these sizes bf16 logits round the check's own
    baseline's differences away (it exits 4, no control). "on+sp": with ``--trainer-sp`` (the hybrid, whose
    attention, MLP and norms then run on sequence shards); the flag is refused for the reference trainer."""
    from aligned_mamba.cli import main
    from aligned_mamba.models import nemotron_h
    from aligned_mamba.models.mamba2 import save_checkpoint

    monkeypatch.setenv("ALIGNED_MAMBA_MEGATRON_HOOK", hook.removesuffix("+sp"))
    config, tensors = model(name, "float32")
    (nemotron_h.save_checkpoint if name == "hybrid" else save_checkpoint)(tmp_path / "ckpt", config, tensors)
    (tmp_path / "s4.yaml").write_text("chunk_size: 16\nstate_dtype: float32\nbackend: torch\nmodel_dtype: float32\n"
                                      "row_parallel_slices: 4\n")
    out = tmp_path / "result.json"
    args = ["check", "--model", str(tmp_path / "ckpt"), "--trainer", "megatron", "--trainer-tp", str(tp),
            "--backend", "torch", "--prompt-len", "40", "--gen-len", "16", "--requests", "2", "--jobs", "1",
            "--json", str(out)] + (["--trainer-sp"] if hook.endswith("+sp") else [])
    code = main([*args, "--contract", str(tmp_path / "s4.yaml")])
    result = json.loads(out.read_text())
    assert result["trainer"] == "megatron" and result["trainer_tp"] == tp
    assert result["trainer_sp"] == hook.endswith("+sp")
    exact = [case for case in result["cases"] if case["exact_replay"]]
    assert len(exact) == 4 and all(case["rows"] > 0 for case in exact)
    if hook.startswith("on"):
        assert code == 0 and result["ok"]
        assert all(case["mismatched_rows"] == 0 and case["mismatched_logprobs"] == 0 for case in exact)
    else:
        assert code == 1 and not result["ok"] and all(case["mismatched_rows"] > 0 for case in exact)
    if hook == "on" and tp == 2 and name != "hybrid":  # the plain contract (S = 1) cannot hold TP 2: refused
        assert main([*args, "--json", str(tmp_path / "refused.json")]) != 0
    if hook == "on+sp":  # sequence parallelism is Megatron's: refused for the reference trainer, in one line
        reference = [a if a != "megatron" else "reference" for a in args]
        assert main([*reference, "--contract", str(tmp_path / "s4.yaml"), "--json", str(tmp_path / "r.json")]) == 2
        assert json.loads((tmp_path / "r.json").read_text())["status"] == "refused"


def test_uneven_groups_refused_in_one_line() -> None:
    """n_groups 2 at TP 4: refused by the hook before Megatron's bare assertion, naming the numbers."""
    config, tensors = model("mamba2_g2")
    contract = Contract(chunk_size=16, model_dtype="bfloat16", row_parallel_slices=4)
    with pytest.raises(Exception, match=r"AlignmentRefused: MambaMixer at tensor parallel size 4: 2 groups do not "
                                        r"split evenly"):
        launch(mc.tp_rank_logits, 4, config, tensors, contract, sequences(config.vocab_size))


def rank_gradients(group, config, tensors, contract: Contract, seqs: list[torch.Tensor], path: str,
                   sequence_parallel: bool = False) -> None:
    """On each rank: the hooked model at TP k in train mode, loss = -(sum of the packed next-token logprobs,
    from this rank's vocabulary shard), backward (sequence parallel: then the marked parameters' parts summed
    over the ranks, as the trainer does); rank 0 saves every parameter's gradient merged to the TP 1 layout
    (``merge_megatron`` of the ranks' gradients), how many were summed, and the summed ones whose parts differed
    between the ranks, at ``path`` (a file: launch's result pipe is too small for them)."""
    import torch.distributed as dist

    from trainer_hooks import megatron as hk
    from trainer_hooks.megatron.shards import merge_megatron

    mc.prepare_process(group.size)
    hk.install(contract)
    m = mc.build_mamba_model(config, contract.model_dtype, sequence_parallel=sequence_parallel)
    mc.load_hf_weights(m, config, tensors)
    m.train()
    local = mc.megatron_packed_logits(m, seqs, gather=False)
    labels = torch.cat(seqs).to(torch.int64).roll(-1)
    loss = -hk.token_logprobs(local[None], labels[None], sequence_first=False, vocab_parallel=True).sum()
    loss.backward()
    parts = {n: p.grad.detach().clone() for n, p in m.named_parameters() if getattr(p, "sequence_parallel", False)}
    summed = mc.sum_sequence_parallel_gradients(m)
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    every: list[dict[str, torch.Tensor]] = [{} for _ in range(group.size)]
    dist.all_gather_object(every, grads)
    every_parts: list[dict[str, torch.Tensor]] = [{} for _ in range(group.size)]
    dist.all_gather_object(every_parts, parts)
    if group.rank == 0:
        differed = sorted(n for n, g in parts.items() if any(not torch.equal(g, o[n]) for o in every_parts[1:]))
        torch.save({"grads": merge_megatron(every, config), "summed": summed, "parts_differ": differed}, path)


@pytest.mark.parametrize(("name", "sp"), [("mamba2_g2", False), ("hybrid", False), ("hybrid_moe", False),
                                          ("hybrid_moe", True)])
def test_gradients_at_tp2_match_tp1(tmp_path, name: str, sp: bool) -> None:
    """Training through the hook at TP 2: the all-gathers pass each rank its own slot of the gradient and
    every replicated layer input sums the ranks' partial gradients, so the merged gradients are TP 1's
    (to fp32 rounding: the backward's sums are not the contract's trees). ``sp``: sequence parallel, where
    the norms' and the router's gradients are parts until summed over the ranks: the parts differ between
    the ranks (unsummed, the replicated weights would step apart), the sums are TP 1's."""
    config, tensors = model(name, "float32")
    contract = Contract(chunk_size=16, model_dtype="float32", row_parallel_slices=2)
    seqs = sequences(config.vocab_size)
    launch(rank_gradients, 1, config, tensors, contract, seqs, str(tmp_path / "tp1.pt"))
    launch(rank_gradients, 2, config, tensors, contract, seqs, str(tmp_path / "tp2.pt"), sp)
    saved = torch.load(tmp_path / "tp2.pt")
    one, two = torch.load(tmp_path / "tp1.pt")["grads"], saved["grads"]
    if sp:  # every layer norm, the final norm and the router: 4 layers' + 1 + 1 in "ME*-"
        assert saved["summed"] == 6 and len(saved["parts_differ"]) == 6, saved["parts_differ"]
    else:
        assert saved["summed"] == 0
    assert sorted(one) == sorted(two) and len(one) > 10
    for n, g in one.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(two[n], g, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize(("name", "sp"), [("mamba2_g8", False), ("hybrid", False), ("hybrid_moe", False),
                                          ("hybrid_moe", True)])
def test_training_at_tp2_serves_what_it_scores(name: str, sp: bool) -> None:
    """Three REINFORCE steps of the Megatron trainer at TP 2 (rank processes, each stepping its shard): after
    every step the merged weights it exports, run by the reference model at TP 1 under the same contract
    (the sampler's forward), give its logits rows and logprobs bit for bit, while the weights move. ``sp``:
    sequence parallel (72 tokens, 36 a rank); an export whose replicated weights differ between the ranks is
    refused (``merge_megatron``), so the norms' and router's summed gradients are checked every step."""
    from aligned_mamba.train import generated_logprobs, weights_from_bytes
    from trainer_hooks.megatron.trainer import make_trainer

    config, tensors = model(name)
    contract = Contract(chunk_size=16, model_dtype="bfloat16", row_parallel_slices=2)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 23, 9)]
    prompt_lens = [20, 10, 4]
    digests = []
    with make_trainer(config=config, tensors=tensors, contract=contract, lr=1e-3, tp=2, sequence_parallel=sp) as tr:
        for it in range(4):
            blob, digest = tr.export_bytes()
            digests.append(digest)
            served = weights_from_bytes(blob)
            assert {k: v.dtype for k, v in served.items()} == {k: v.dtype for k, v in tensors.items()}
            want = build_model(config, served, contract).forward(seqs)
            got = tr.forward(seqs)
            assert sum(differing_rows(a, b) for a, b in zip(got, want)) == 0, it
            for lp, ref in zip(tr.token_logprobs(seqs, prompt_lens), generated_logprobs(want, seqs, prompt_lens)):
                assert torch.equal(lp, ref), it
            if it < 3:
                stats = tr.step(seqs, prompt_lens, [1.0, -1.0, 0.5])
                assert stats["weights_version"] == it + 1 and stats["grad_norm"] > 0
    assert len(set(digests)) == 4  # every step moved the served bits


def test_rl_with_the_megatron_trainer_at_tp2(tmp_path) -> None:
    """``aligned-mamba rl --trainer megatron --trainer-tp 2 --trainer-sp --row-parallel-slices 2``: three
    iterations on Ray with reference rollout workers at TP 1 under the same contract, every sampled token's
    logprob equal to the TP 2 trainer's (sequence parallel) while its weights move."""
    pytest.importorskip("ray", reason="aligned-mamba rl needs Ray (pip install -e '.[ray]')")
    from aligned_mamba.models.mamba2 import save_checkpoint
    from rollout.rl import RLOptions, run_rl

    config, tensors = model("mamba2_g8", "float32")
    save_checkpoint(tmp_path / "ckpt", config, tensors)
    r = run_rl(RLOptions(model=str(tmp_path / "ckpt"), trainer="megatron", trainer_tp=2, trainer_sp=True,
                         row_parallel_slices=2, workers=2, iterations=3, prompt_len=40, gen_len=12,
                         prompts_per_worker=2))
    assert r["ok"] and r["trainer_tp"] == 2 and r["trainer_sp"] and r["contract"]["row_parallel_slices"] == 2
    assert len(r["iterations"]) == 3 and all(x["mismatched_tokens"] == 0 for x in r["iterations"])
    assert sum(x["tokens"] for x in r["iterations"]) > 0
    digests = [x["next_weights_digest"] for x in r["iterations"]]
    assert len(set(digests)) == 3  # every step moved the served weights
