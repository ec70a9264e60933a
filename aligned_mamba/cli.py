"""The ``aligned-mamba`` command.

    aligned-mamba check [--model tiny|DIR] [--engine reference|vllm] [--trainer reference|megatron]
                        [--backend auto|torch|triton] [--prompt-len 600] [--gen-len 300]
                        [--requests 4] [--max-batch-tokens N] [--dtype bfloat16|float32]
                        [--seed 0] [--json PATH]

Exit status: 0 when every exact-replay case has zero differing logits rows, 1 when one does,
2 for input the command refuses (one line on stderr saying what and why).

Other subcommands come from packages through the ``aligned_mamba.commands`` entry points (``rl``,
in rollout/, needs Ray), so the core imports none of their dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .errors import EXIT_BAD_INPUT, EXIT_MISMATCH, EXIT_OK, AlignedMambaError
from .integrations import COMMAND_GROUP


def build_contract(config: Any, spec: str | None, backend: str, dtype: str | None, state_dtype: str | None) -> Any:
    """A named/YAML contract (flags given explicitly override its fields), else the checkpoint's."""
    from .contract import Contract
    from .models import contract_for

    overrides: dict[str, Any] = {"backend": backend}
    if dtype is not None:
        overrides["model_dtype"] = dtype
    if state_dtype is not None:
        overrides["state_dtype"] = state_dtype
    if spec:
        return Contract.from_yaml(spec, **overrides)
    return contract_for(config, backend=backend, model_dtype=dtype, state_dtype=state_dtype or "float32")


def _progress(start: float):
    def show(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return show


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def print_table(result: dict[str, Any]) -> None:
    c = result["contract"]
    m = result["model"]
    print(f"contract {c['fingerprint']}: chunk_size={c['chunk_size']} state={c['state_dtype']} "
          f"backend={c['backend']} dtype={c['model_dtype']}")
    print(f"model: {m['layers']} layers, {m['heads']} heads x {m['head_dim']}, groups {m['n_groups']}, "
          f"state {m['state_size']}, vocab {m['vocab']}; replay state {m['replay_bytes_per_sequence'] / 2**20:.2f} "
          f"MiB per sequence")
    head = f"{'case':<27} {'replay':<6} {'rows':>6} {'differ':>7} {'first':>6} {'max|d|':>9}  map (x: rows differ)"
    print(head)
    print("-" * len(head))
    for case in result["cases"]:
        print(f"{case['name']:<27} {'on' if case['exact_replay'] else 'off':<6} {case['rows']:>6} "
              f"{case['mismatched_rows']:>7} {_fmt(case['first_mismatch']):>6} {_fmt(case['max_abs_diff']):>9}  "
              f"{case['mismatch_map'][:40]}")
    a = result["accuracy"]
    print(f"accuracy vs fp64 reference (scan outputs, layers {a['layers']}, {a['tokens']} tokens, {a['dtype']}): "
          f"chunked scan {a['chunked_scan']:.3e}, recurrent update {a['recurrent_update']:.3e}, "
          f"{a['dtype']} rounding floor {a['rounding_floor']:.3e} (mean |err| / mean |ref|)")
    verdict = "OK: every exact-replay case is bit-identical" if result["ok"] else "FAIL: exact-replay rows differ"
    print(f"{verdict} ({result['timing']['total_s']:.1f}s)")


def cmd_check(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    show = _progress(start)
    import torch

    from .check import run_check
    from .contract import check_compatible
    from .integrations import EngineSpec, build_trainer, engine_factory
    from .models import load_source
    from .ops.backend import choose_backend

    torch.manual_seed(args.seed)
    for name in ("prompt_len", "gen_len", "requests"):
        if getattr(args, name) < 1:
            raise AlignedMambaError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise AlignedMambaError("--max-batch-tokens must be >= 1")
    backend = choose_backend(args.backend)
    engine_factory(args.engine)  # an engine that is not installed is refused before anything runs
    show(f"loading model {args.model!r}")
    config, tensors = load_source(args.model, args.dtype)
    trainer_c = build_contract(config, args.trainer_contract or args.contract, backend, args.dtype, args.state_dtype)
    sampler_c = build_contract(config, args.sampler_contract or args.contract, backend, args.dtype, args.state_dtype)
    check_compatible(trainer_c, sampler_c)  # refuse before a single logit is computed
    jobs = args.jobs if args.jobs is not None else (min(2, os.cpu_count() or 1) if backend == "torch" else 1)
    if jobs < 1:
        raise AlignedMambaError("--jobs must be >= 1")
    if jobs > 1:
        torch.set_num_threads(1)  # one thread per process: the workers take the other cores
    if args.trainer != "reference":
        show(f"building the {args.trainer} trainer")
    trainer = build_trainer(args.trainer, config=config, tensors=tensors, contract=trainer_c)
    from .models import build_model
    from .train import PolicyTrainer

    # the model of the accuracy line: the reference trainer's own, else one built from the same weights
    reference = trainer.model() if isinstance(trainer, PolicyTrainer) else build_model(config, tensors, trainer_c)
    longest = args.prompt_len + args.gen_len
    spec = EngineSpec(model=args.model, contract=sampler_c.to_dict(), dtype=args.dtype,
                      max_model_len=max(longest + 16, 256), max_num_seqs=args.requests,
                      max_batch_tokens=max(args.prompt_len * args.requests, args.max_batch_tokens or 0, 256))
    result = run_check(trainer, args.engine, spec, reference=reference, prompt_len=args.prompt_len,
                       gen_len=args.gen_len, requests=args.requests, max_batch_tokens=args.max_batch_tokens,
                       seed=args.seed, jobs=jobs, progress=show)
    result["engine"], result["trainer"] = args.engine, args.trainer
    result["timing"]["wall_s"] = round(time.perf_counter() - start, 3)
    result["environment"] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                             "device": "cpu" if backend == "torch" else torch.cuda.get_device_name()}
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        show(f"wrote {args.json}")
    return EXIT_OK if result["ok"] else EXIT_MISMATCH


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aligned-mamba", description="Bitwise train/inference alignment for Mamba2.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="sample, score, and compare logits rows bit for bit")
    c.add_argument("--model", default="tiny", help="'tiny' (the embedded default) or a Hugging Face Mamba2 directory")
    c.add_argument("--engine", default="reference", choices=["reference", "vllm"],
                   help="the sampler engine (vllm: a real vLLM engine with the exact-replay plugin; extra 'vllm')")
    c.add_argument("--trainer", default="reference", choices=["reference", "megatron"],
                   help="the trainer forward (megatron: Megatron-Core's MambaModel with the hook; extra 'megatron')")
    c.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    c.add_argument("--prompt-len", type=int, default=600)
    c.add_argument("--gen-len", type=int, default=300)
    c.add_argument("--requests", type=int, default=4)
    c.add_argument("--max-batch-tokens", type=int, default=None,
                   help="token budget per engine step for the chunked-prefill cases (default 100)")
    c.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="model dtype (default: the checkpoint's; bfloat16 for tiny)")
    c.add_argument("--state-dtype", default=None, help="SSM state dtype; only float32 can promise bits")
    c.add_argument("--contract", default=None, help="contract name (configs/contracts) or YAML path, both sides")
    c.add_argument("--trainer-contract", default=None, help="contract for the trainer side only")
    c.add_argument("--sampler-contract", default=None, help="contract for the sampler side only")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--jobs", type=int, default=None,
                   help="sampler worker processes (default: 2 on a multi-core CPU with the torch backend, else 1); "
                        "the trainer scores in the main process")
    c.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    c.set_defaults(func=cmd_check)
    add_plugin_commands(sub)
    return p


def add_plugin_commands(sub: Any) -> None:
    """Subcommands registered under ``aligned_mamba.commands``: each entry point names an object with
    ``help``, ``description``, ``add_arguments(parser)`` and ``run(args) -> int``. Loaded with
    importlib directly rather than ``check.load_plugin``, which would import torch just to parse flags;
    one that fails to import still appears, and says why when run."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        if ep.name in sub.choices:
            continue
        try:
            cmd = ep.load()
        except ImportError as e:
            why = f"command {ep.name!r} could not be imported ({e})"
            sub.add_parser(ep.name, help=f"(unavailable: {why})").set_defaults(func=_unavailable(why))
            continue
        c = sub.add_parser(ep.name, help=cmd.help, description=getattr(cmd, "description", None))
        cmd.add_arguments(c)
        c.set_defaults(func=cmd.run)


def _unavailable(why: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise AlignedMambaError(why)

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (AlignedMambaError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"aligned-mamba: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
