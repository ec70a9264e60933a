#!/usr/bin/env python3
"""The RL loop's three actors in one process on one GPU: Megatron-Core's MambaModel with the hook
(triton backend) trains, the reference engine (triton backend, decode in CUDA graphs) samples, and
every sampled token's logprob and raw logits row is compared with the trainer's bit for bit.

    PYTHONPATH=. python3 benchmarks/train_megatron_h200.py --out OUT/h200_megatron.json [--iterations 20]
        [--model tiny|130m|hybrid|moe|PATH] [--prompts 4] [--prompt-len 200] [--gen-len 64] [--lr 1e-3]
    python3 benchmarks/train_megatron_h200.py --dry-run --out /tmp/m.json   (CPU, torch backend, 2 iterations)

Models: ``tiny`` the embedded default Mamba2; ``130m`` a Mamba2 of that shape; ``hybrid`` a dense
Nemotron-H (``M*M-``: Mamba2 8 heads x 32, GQA 4 attention with head_dim 64, a squared-ReLU MLP);
``moe`` a MoE hybrid (``MEM*E``: 16 experts top-6 in 4 groups of which the best 3 (Megatron scores a
group by its best top-k / topk_group experts, Nemotron-H by its best 2), expert width 256,
a shared expert of 384 in each MoE layer); Megatron builds the hybrid MambaModel for both (its
attention, MLP and MoE layers under the hook); else a checkpoint directory.

The actors are ``rollout.actors``' own classes (``aligned-mamba rl`` runs the same ones as Ray actors;
Ray is not installed on the GPU machine, so here they are called directly, in the loop's order):
per iteration the trainer exports versioned weights, both workers load them, each samples its
prompts, the trainer scores every sequence in one packed pass, the checker compares logprobs
(``verify``), and the trainer takes one REINFORCE step on the exact worker's batch.

- worker 0 runs exact replay; besides its logprobs, its raw logits rows (the row each token was
  sampled from) are compared with ``torch.equal`` against the trainer's one-pass rows;
- worker 1 runs the engine's stock decode (``exact_replay=False``): its batch is checked, never
  trained on, and must differ (the mismatch the contract prevents);
- ``loss`` is the step's REINFORCE loss before the update, ``loss_after`` on the same tokens and
  advantages after it; ``reward`` (fraction of even token ids, the loop's verifiable reward) is the
  objective the steps climb.

Writes the JSON after every iteration (GPU, torch, triton, megatron-core versions, commit, date).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"130m": dict(vocab_size=50280, hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64,
                       state_size=128)}
# small Nemotron-H hybrids (bf16); head_dim 64: the GPU attention kernels take 64 or 128
_HYBRID = dict(hidden_size=256, vocab_size=512, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=32, chunk_size=64,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64)
HYBRIDS = {"hybrid": dict(_HYBRID, pattern="M*M-", intermediate_size=512),
           "moe": dict(_HYBRID, pattern="MEM*E", n_routed_experts=16, num_experts_per_tok=6, n_group=4, topk_group=3,
                       moe_intermediate_size=256, moe_shared_expert_intermediate_size=384)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_source(name: str, tmp: str) -> str:
    """'tiny' as is; a shape name -> a bf16 checkpoint of that shape written under ``tmp``; else a path."""
    if name in HYBRIDS:
        from aligned_mamba.models.nemotron_h import make_tiny_hybrid
        from aligned_mamba.models.nemotron_h import save_checkpoint as save_hybrid

        over = dict(HYBRIDS[name])
        cfg, tensors = make_tiny_hybrid(5, dtype="bfloat16", pattern=over.pop("pattern"), **over)
        path = os.path.join(tmp, name)
        save_hybrid(path, cfg, tensors)
        return path
    if name not in SHAPES:
        return name
    from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

    cfg, tensors = make_tiny(0, **SHAPES[name])
    path = os.path.join(tmp, name)
    save_checkpoint(path, cfg, tensors)
    return path


def rows_check(trainer_logits: list, rows: list) -> dict:
    """Raw rows: the engine's (position, row) pairs of each request against the trainer's [len, vocab]."""
    import torch

    total = differ = 0
    for lg, req in zip(trainer_logits, rows):
        lg = lg.cpu()  # one copy per sequence (the engine's rows are on the host)
        for pos, row in req:
            total += 1
            differ += not torch.equal(lg[pos], row)
    return {"rows": total, "differing_rows": differ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, torch backend, 2 iterations (checks the script)")
    args = ap.parse_args()
    if args.dry_run:
        args.iterations = min(args.iterations, 2)
    sys.path.insert(0, str(ROOT))
    import torch

    from aligned_mamba.cli import build_contract
    from aligned_mamba.integrations import EngineSpec
    from aligned_mamba.models import describe, load_source
    from benchmarks.bench_h200 import git_commit
    from rollout.actors import AlignmentChecker, RolloutWorker, TrainerScorer, TrainerSpec
    from rollout.rl import _seed, make_prompts

    backend = "torch" if args.dry_run else "triton"
    if backend == "triton" and not torch.cuda.is_available():
        print("train_megatron_h200: needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import megatron.core

    result: dict = {
        "script": "benchmarks/train_megatron_h200.py", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "triton": _version("triton"), "megatron_core": megatron.core.__version__,
        "dry_run": args.dry_run, "args": vars(args), "iterations": []}

    with tempfile.TemporaryDirectory() as tmp:
        source = model_source(args.model, tmp)
        config, _ = load_source(source)
        contract = build_contract(config, None, backend, None, None)
        cdict = contract.to_dict()
        result.update(model={"source": args.model, **describe(config)}, contract=cdict)
        t0 = time.perf_counter()
        scorer = TrainerScorer(TrainerSpec("megatron", source, cdict, lr=args.lr, threads=torch.get_num_threads()))
        spec = dict(model=source, contract=cdict, max_model_len=args.prompt_len + args.gen_len + 8,
                    max_num_seqs=args.prompts, threads=torch.get_num_threads())
        exact = RolloutWorker(0, "reference", EngineSpec(**spec), None, keep_rows=True)
        stock = RolloutWorker(1, "reference", EngineSpec(**spec, exact_replay=False), None)
        checker = AlignmentChecker(contract.fingerprint)
        stock_checker = AlignmentChecker(contract.fingerprint)
        result["startup_s"] = round(time.perf_counter() - t0, 2)
        log(f"model {args.model} ({describe(config)['layers']} layers), contract {contract.fingerprint} "
            f"({backend}, chunk {contract.chunk_size}); actors ready in {result['startup_s']} s")

        for k in range(args.iterations):
            t0 = time.perf_counter()
            meta, blob = scorer.export()
            for w in (exact, stock):
                w.load_weights(blob, meta["weights_version"], meta["weights_digest"])
            batches = [w.sample(k, make_prompts(config.vocab_size, args.prompt_len, args.prompts, args.seed, k, i),
                                args.gen_len, _seed(args.seed, k, i)) for i, w in enumerate((exact, stock))]
            t1 = time.perf_counter()
            scores = scorer.score(*batches)
            rep = checker.check(k, scores, batches[0])
            stock_rep = stock_checker.check(k, scores, batches[1])
            seqs = [torch.tensor(s, dtype=torch.int64) for s in batches[0].sequences]
            raw = rows_check(scorer.trainer.forward(seqs), exact.last_rows or [])
            t2 = time.perf_counter()
            st = scorer.step(batches[0])
            t3 = time.perf_counter()
            row = {"iteration": k, "weights_version": rep.weights_version,
                   "weights_digest": meta["weights_digest"][:12], "tokens": rep.tokens,
                   "mismatched_tokens": rep.mismatched_tokens, **raw,
                   "stock_tokens": stock_rep.tokens, "stock_mismatched_tokens": stock_rep.mismatched_tokens,
                   "stock_max_abs_logprob_diff": stock_rep.max_abs_logprob_diff, "reward": st["reward"],
                   "loss": st["loss"], "loss_after": st["loss_after"], "grad_norm": st["grad_norm"],
                   "logprob_shift": st["logprob_shift"],
                   "timing": {"sample_s": round(t1 - t0, 3), "score_check_s": round(t2 - t1, 3),
                              "step_s": round(t3 - t2, 3)}}
            result["iterations"].append(row)
            out.write_text(json.dumps(result, indent=1))
            log(f"iteration {k}: {rep.tokens} tokens, {rep.mismatched_tokens} mismatched, raw rows "
                f"{raw['differing_rows']}/{raw['rows']} differ; stock worker {stock_rep.mismatched_tokens}/"
                f"{stock_rep.tokens}; reward {st['reward']:.4f}, loss {st['loss']:.5f} -> {st['loss_after']:.5f}, "
                f"grad norm {st['grad_norm']:.3g} ({t3 - t0:.1f} s)")

    its = result["iterations"]
    result["summary"] = {
        "iterations": len(its), "tokens": sum(r["tokens"] for r in its),
        "mismatched_tokens": sum(r["mismatched_tokens"] for r in its),
        "differing_rows": sum(r["differing_rows"] for r in its), "rows": sum(r["rows"] for r in its),
        "stock_mismatched_tokens": sum(r["stock_mismatched_tokens"] for r in its),
        "steps_lowering_their_loss": sum(r["loss_after"] < r["loss"] for r in its),
        "reward_first_last": [its[0]["reward"], its[-1]["reward"]] if its else None}
    out.write_text(json.dumps(result, indent=1))
    s = result["summary"]
    log(f"summary: {s['mismatched_tokens']}/{s['tokens']} tokens and {s['differing_rows']}/{s['rows']} raw rows "
        f"differ (stock worker: {s['stock_mismatched_tokens']}); {s['steps_lowering_their_loss']}/{s['iterations']} "
        f"steps lowered their batch's loss; reward {s['reward_first_last']}")
    exact_ok = s["mismatched_tokens"] == 0 and s["differing_rows"] == 0 and s["rows"] > 0
    return 0 if exact_ok and s["stock_mismatched_tokens"] > 0 else 1


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
