#!/usr/bin/env python3
"""The trainer's forward and the sampler's schedules at TP 1, 2 (4) over NCCL, one process per GPU.

    python3 benchmarks/tp_forward_gpus.py --out OUT/h200_tp.json [--sizes 1,2,4] [--models mamba2-1.3b,hybrid-8b] \
        [--megatron [--sequence-parallel]]
    python3 benchmarks/tp_forward_gpus.py --dist gloo --backend torch --models tiny --out /tmp/tp.json   (CPU)
    python3 benchmarks/tp_forward_gpus.py --dist gloo --sizes 1,2,4 --out OUT/h200_tp_one_gpu.json   (one GPU)

Per model and TP degree k, k processes (spawned) join one process group (``--dist``: nccl, each rank
on GPU ``rank``; gloo on the CPU, or with the triton backend every rank on GPU 0, the all-gathers through
the host: the GPU kernels' bits under sharding on one GPU, its times not a TP run's), each builds its
shard of the same checkpoint (``TPGroup.from_torch``, ``tp_reference``) under a contract of
``row_parallel_slices`` S, and runs: the trainer's one-pass
forward over a few sequences (every logits row and token logprob kept), the same forward under stock
tensor parallelism (row-parallel partials rounded and all-gathered in rank order: the baseline), and
the reference engine's chunked prefill + decode schedule (rows and reported logprobs). Rank 0's results
are compared with TP 1's: rows and logprobs differing (expected 0), stock TP k against stock TP 1
(expected > 0); times: the forward's median over repeats (CUDA events on the GPU), and the stock
forward's at the same degree (the library's stock TP model on the same weights). ``--megatron``: each rank
also builds Megatron-Core's MambaModel at TP k over the same process group, hooked (``--aligned-mamba``)
and stock (``tp_rank_model``), and runs its packed forward: the hooked rows and its vocab-parallel
logprobs must equal the core's TP 1 (expected 0 differing), stock Megatron TP k must differ from stock
Megatron TP 1, and both forwards are timed; ``--sequence-parallel`` adds, at every degree above 1, the hooked
model with Megatron's sequence parallelism (its rows and logprobs must equal the core's TP 1 too; timed).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), set here before any process starts and again in each rank. Models are
random weights in checkpoint proportions (``--layers`` of them): the 1.3b-shaped Mamba2 (hidden 2048,
64 heads x 64, state 128, n_groups 1, its vocabulary padded to 50304 as Megatron pads it: the triton
backend's vocab-sharded logprobs need a multiple of 128) and a Nemotron-H-8B-shaped hybrid (Mamba2 128 heads x 64, 8
groups; attention 32 x 128 heads, 8 KV heads; MLP 21504), the first layers of a Nemotron-3-Nano-30B-A3B-shaped
MoE hybrid (``nano-moe``: 128 experts, top 6, each run alone at TP > 1), or tiny ones for the CPU (``tiny``,
``tiny-hybrid``, ``tiny-moe``). The MoE models run without ``--megatron`` where Transformer Engine is missing:
stock Megatron's fp32 router GEMM calls it (megatron-core 0.16.1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _k, _v in NO_MULTICAST.items():  # before torch and any child: spawned ranks inherit the environment
    os.environ[_k] = _v


def model(name: str, layers: int):
    """(config, tensors) of a named shape."""
    from aligned_mamba.models.mamba2 import make_tiny
    from aligned_mamba.models.nemotron_h import make_tiny_hybrid

    if name == "tiny":
        return make_tiny(1, hidden_size=128, num_heads=8, head_dim=32, state_size=32, n_groups=8,
                         num_hidden_layers=2, chunk_size=32)
    if name == "tiny-hybrid":
        return make_tiny_hybrid(2, pattern="M*M-", chunk_size=32, n_groups=2, num_key_value_heads=2)
    if name == "tiny-moe":
        return make_tiny_hybrid(3, pattern="M*E", chunk_size=32, topk_group=1)  # routing Megatron can build
    if name == "nano-moe":  # Nemotron-3-Nano-30B-A3B's shapes, the first `layers` of its pattern (MoE at TP > 1:
        # each expert run alone, its down projection the tree GEMM); weights as the hybrid bench draws them
        # (on the GPU: the tiny models' exact CPU draws take minutes at 1.3 B parameters a MoE layer)
        import torch

        from aligned_mamba.models.nemotron_h import NemotronHConfig, expected_shapes
        from benchmarks.stock_hybrid import NANO, draw

        config = NemotronHConfig(**dict(NANO, hybrid_override_pattern=NANO["hybrid_override_pattern"][:max(4, layers)]),
                                 dtype="bfloat16")
        g = torch.Generator("cuda" if torch.cuda.is_available() else "cpu").manual_seed(4)
        return config, {n: draw(n, s, config.torch_dtype, g).cpu() for n, s in expected_shapes(config).items()}
    if name == "mamba2-1.3b":
        return make_tiny(0, hidden_size=2048, num_heads=64, head_dim=64, state_size=128, n_groups=1,
                         num_hidden_layers=layers, chunk_size=256, vocab_size=50304, expand=2)
    if name == "hybrid-8b":
        pattern = ("M-M*M-" * layers)[:max(4, layers)]
        return make_tiny_hybrid(3, pattern=pattern, hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64,
                                n_groups=8, ssm_state_size=128, num_attention_heads=32, num_key_value_heads=8,
                                head_dim=128, intermediate_size=21504, vocab_size=131072, chunk_size=256)
    raise SystemExit(f"unknown model {name!r}")


def _rank(rank: int, size: int, port: int, dist_backend: str, job: dict, queue) -> None:
    for k, v in NO_MULTICAST.items():
        os.environ[k] = v
    import torch
    import torch.distributed as dist

    from aligned_mamba import tp_reference
    from aligned_mamba.check import CASES, scenario_for
    from aligned_mamba.contract import Contract
    from aligned_mamba.ops.backend import token_logprobs
    from aligned_mamba.parallel import TPGroup

    try:
        if dist_backend == "nccl":
            torch.cuda.set_device(rank)
        else:  # gloo: CPU ranks, or on the triton backend every rank on GPU 0 (bits only, times not comparable)
            torch.set_num_threads(1)
        dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        group = TPGroup.from_torch() if size > 1 else TPGroup.single()
        t_start = time.perf_counter()

        def phase(what: str) -> None:  # progress on rank 0: where a long degree spends its time
            if rank == 0:
                print(f"[tp{size}] {what} at {time.perf_counter() - t_start:.0f} s", file=sys.stderr, flush=True)

        # the parent drew the weights once (a single-threaded generator: minutes at the 8B shape); mapped here
        config, tensors = torch.load(job["weights"], mmap=True, weights_only=False)
        phase("weights")
        c = Contract(config.chunk_size, backend=job["backend"], row_parallel_slices=job["slices"])
        seqs = [torch.tensor(s) for s in job["seqs"]]
        cuda = job["backend"] == "triton" and torch.cuda.is_available()
        out: dict = {}

        def median_ms(fn) -> float | None:
            times = []
            for _ in range(job["repeats"]):
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier()
                t = time.perf_counter()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            return times[len(times) // 2] if times else None

        for stock in (False, True):
            m = tp_reference.build(group, config, tensors, c, stock=stock)
            rows = m.forward(list(seqs))
            out["stock" if stock else "aligned"] = dict(
                rows=[r.cpu() for r in rows], ms=median_ms(lambda m=m: m.forward(list(seqs))),
                logprobs=[token_logprobs(r[:-1], s[1:].to(r.device), 1.0, c).cpu() for r, s in zip(rows, seqs)])
            phase("stock forward" if stock else "forward")
        if job["megatron"]:
            from trainer_hooks.megatron import trainer as mt

            lens = [int(s.numel()) for s in seqs]
            variants = [("megatron", True, False), ("megatron_stock", False, False)]
            if job["sequence_parallel"] and size > 1:
                variants.append(("megatron_sp", True, True))
            for key, hook, sp in variants:
                m = mt.tp_rank_model(group, config, tensors, c, hook, sp)
                def forward(m=m, hook=hook):
                    return mt.tp_rank_forward(group, m, config, list(seqs), hook)

                rows, lps = forward()
                entry = dict(rows=list(rows.cpu().split(lens)), ms=median_ms(forward))
                if lps is not None:  # packed next-token logprobs: each sequence's but its last position
                    entry["logprobs"] = [lp[:-1] for lp in lps.cpu().split(lens)]
                out[key] = entry
                phase(key)
                del m
        case = next(x for x in CASES if x.name == "chunked_prefill_unaligned")
        scen = scenario_for(case, [list(map(int, s)) for s in job["seqs"]], job["gen_len"], job["budget"], 3)
        res = tp_reference.run_scenario(group, config, tensors, c, scen, True)
        phase("engine")
        out["engine"] = dict(tokens=res.tokens, rows=[[(p, r.cpu()) for p, r in req] for req in res.rows],
                             logprobs=[list(map(float, lp)) for lp in res.sampled_logprobs])
        dist.barrier()
        if rank == 0:  # plain pickled bytes: a tensor shared by file descriptor would die with this process
            queue.put(("ok", pickle.dumps(out)))
        dist.destroy_process_group()
    except Exception as e:  # one line to the parent, which reports it
        queue.put(("error", f"rank {rank} of {size}: {type(e).__name__}: {' '.join(str(e).split())[:500]}"))


def run_degree(size: int, dist_backend: str, job: dict, timeout: float) -> dict:
    import multiprocessing
    import socket

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, size, port, dist_backend, job, queue)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(payload)
    return pickle.loads(payload)


def _differing(a, b) -> int:

    return sum(int((x != y).any(dim=-1).sum()) if x.shape == y.shape else int(x.shape[0]) for x, y in zip(a, b))


def compare(one: dict, other: dict) -> dict:
    """Rank 0's results at a degree against TP 1's."""
    eng_rows = sum(int(not (p == q and bool((r == s).all()))) for a, b in zip(one["engine"]["rows"],
                                                                           other["engine"]["rows"])
                   for (p, r), (q, s) in zip(a, b))
    eng_lp = sum(int(x != y) for a, b in zip(one["engine"]["logprobs"], other["engine"]["logprobs"])
                 for x, y in zip(a, b))
    # the engine's rows are those the trainer's one pass computes at the same positions (exact replay)
    return dict(
        rows=sum(int(r.shape[0]) for r in one["aligned"]["rows"]),
        rows_differing=_differing(one["aligned"]["rows"], other["aligned"]["rows"]),
        logprobs_differing=_differing([x[:, None] for x in one["aligned"]["logprobs"]],
                                      [x[:, None] for x in other["aligned"]["logprobs"]]),
        engine_tokens_equal=one["engine"]["tokens"] == other["engine"]["tokens"],
        engine_rows_differing=eng_rows, engine_logprobs_differing=eng_lp,
        stock_rows_differing_from_stock_tp1=_differing(one["stock"]["rows"], other["stock"]["rows"]),
        aligned_ms=other["aligned"]["ms"], stock_ms=other["stock"]["ms"], **_megatron(one, other))


def _megatron(one: dict, other: dict) -> dict:
    """Hooked Megatron at this degree against the core's TP 1 (rows, logprobs), stock Megatron against its TP 1."""
    if "megatron" not in other:
        return {}
    sp = {}
    if "megatron_sp" in other:  # sequence parallel, at degrees above 1
        sp = dict(megatron_sp_rows_differing_from_core_tp1=_differing(other["megatron_sp"]["rows"],
                                                                      one["aligned"]["rows"]),
                  megatron_sp_logprobs_differing_from_core_tp1=_differing(
                      [x[:, None] for x in other["megatron_sp"]["logprobs"]],
                      [x[:, None] for x in one["aligned"]["logprobs"]]),
                  megatron_sp_ms=other["megatron_sp"]["ms"])
    return dict(**sp,
        megatron_rows_differing_from_core_tp1=_differing(other["megatron"]["rows"], one["aligned"]["rows"]),
        megatron_logprobs_differing_from_core_tp1=_differing([x[:, None] for x in other["megatron"]["logprobs"]],
                                                             [x[:, None] for x in one["aligned"]["logprobs"]]),
        megatron_stock_rows_differing_from_its_tp1=_differing(other["megatron_stock"]["rows"],
                                                              one["megatron_stock"]["rows"]),
        megatron_ms=other["megatron"]["ms"], megatron_stock_ms=other["megatron_stock"]["ms"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dist", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--backend", default="triton", choices=("triton", "torch"))
    ap.add_argument("--models", default="mamba2-1.3b,hybrid-8b")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-lens", default="300,77")
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--budget", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=540)
    ap.add_argument("--megatron", action="store_true", help="also Megatron-Core's MambaModel, hooked and stock")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --megatron: also the hooked model with Megatron's sequence parallelism (degrees > 1)")
    args = ap.parse_args()
    import torch
    import triton

    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 1:
        raise SystemExit("--sizes must start with 1 (the degree every other is compared with)")
    res: dict = dict(dist=args.dist, backend=args.backend, slices=args.slices, layers=args.layers,
                     torch=torch.__version__, triton=triton.__version__,
                     gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                     commit=os.environ.get("GIT_COMMIT"), no_multicast=NO_MULTICAST,
                     date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), models={})
    ok = True
    for name in args.models.split(","):
        t = time.perf_counter()
        config, tensors = model(name, args.layers)
        held = tempfile.TemporaryDirectory()  # removed when the model's degrees end, or the run fails
        weights = Path(held.name) / "weights.pt"
        torch.save((config, tensors), weights)
        del tensors
        print(f"[tp] {name}: weights drawn in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        g = torch.Generator().manual_seed(7)
        seqs = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in map(int,
                                                                                             args.seq_lens.split(","))]
        job = dict(model=name, layers=args.layers, backend=args.backend, slices=args.slices, seqs=seqs,
                   gen_len=args.gen_len, budget=args.budget, repeats=args.repeats, megatron=args.megatron,
                   sequence_parallel=args.sequence_parallel, weights=str(weights))
        runs = {}
        with held:
            for k in sizes:
                t = time.perf_counter()
                runs[k] = run_degree(k, args.dist, job, args.timeout_s)
                print(f"[tp] {name} tp{k}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        res["models"][name] = {f"tp{k}": compare(runs[1], runs[k]) for k in sizes}
        for k in sizes:
            c = res["models"][name][f"tp{k}"]
            if args.megatron:
                ok &= c["megatron_rows_differing_from_core_tp1"] == c["megatron_logprobs_differing_from_core_tp1"] == 0
                ok &= k == 1 or c["megatron_stock_rows_differing_from_its_tp1"] > 0
                if args.sequence_parallel and k > 1:
                    ok &= c["megatron_sp_rows_differing_from_core_tp1"] == 0
                    ok &= c["megatron_sp_logprobs_differing_from_core_tp1"] == 0
            if k == 1:
                continue
            ok &= c["rows_differing"] == 0 and c["logprobs_differing"] == 0 and c["engine_rows_differing"] == 0
            ok &= c["stock_rows_differing_from_stock_tp1"] > 0
        print(json.dumps({name: res["models"][name]}), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # each model's results kept if a later one is cut
        Path(args.out).write_text(json.dumps(res, indent=1))
    res["all_equal_with_a_differing_baseline"] = bool(ok)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
