"""The ``aligned-mamba`` command.

    aligned-mamba check [--model tiny|DIR] [--engine reference|vllm] [--trainer reference|megatron]
                        [--backend auto|torch|triton] [--prompt-len 600] [--gen-len 300]
                        [--requests 4] [--max-batch-tokens N] [--dtype bfloat16|float32]
                        [--seed 0] [--json PATH] [--trainer-tp K [--trainer-sp]] [--sampler-tp M]
                        [--row-parallel-slices S]

Exit status (one meaning each, one line on stderr saying what and why for 2, 3 and 4): 0 every
exact-replay case has zero differing logits rows; 1 rows differ; 2 input or settings refused;
3 the run failed (out of memory, a dead worker process, an unreachable cluster, a diverged training
step); 4 no row differed but the baseline did not differ either, so these sizes could not have shown
a mismatch; 130 interrupted (SIGINT); 143 terminated (SIGTERM: the report is closed, the worker
processes are ended). ``--json PATH`` (a regular file or a new path) is checked before any work,
rewritten after each case and closed with a ``status`` ("ok", "mismatch", "no-control", "refused",
"failed", "interrupted", "terminated").

Diagnostics go through the ``logging`` logger "aligned_mamba" (the command prints them on stderr);
the results table is printed on stdout.

Other subcommands come from packages through the ``aligned_mamba.commands`` entry points (``rl``,
in rollout/, needs Ray), so the core imports none of their dependencies.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from . import processes
from .errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_NO_CONTROL,
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_TERMINATED,
    AlignedMambaError,
    RuntimeFailure,
    Terminated,
)
from .integrations import COMMAND_GROUP
from .report import JsonReport

log = logging.getLogger("aligned_mamba")

# the Python package each extra's engine or trainer needs, and the extra that installs it
_EXTRA_NEEDS = {"vllm": ("vllm", "vllm"), "megatron": ("megatron.core", "megatron")}


def build_contract(config: Any, spec: str | None, backend: str, dtype: str | None, state_dtype: str | None,
                   *, backend_flag: str = "auto", row_parallel_slices: int | None = None) -> Any:
    """A named/YAML contract, else the checkpoint's. A flag given explicitly that contradicts the
    contract file is refused (one line naming both), never silently applied; the file's backend
    is checked against what this machine can run (``backend``, resolved from ``backend_flag``).
    ``row_parallel_slices``: the --row-parallel-slices flag (the checkpoint's contract takes it; a
    file that states another is refused)."""
    import dataclasses

    from .contract import Contract
    from .models import contract_for

    if not spec:
        c = contract_for(config, backend=backend, model_dtype=dtype, state_dtype=state_dtype or "float32")
        return c if row_parallel_slices is None else dataclasses.replace(c, row_parallel_slices=row_parallel_slices)
    from_file = Contract.from_yaml(spec)
    if row_parallel_slices is not None and row_parallel_slices != from_file.row_parallel_slices:
        if from_file.row_parallel_slices != 1:
            raise AlignedMambaError(f"--row-parallel-slices {row_parallel_slices} contradicts contract {spec}'s "
                                    f"row_parallel_slices: {from_file.row_parallel_slices} (drop the flag or edit "
                                    "the file)")
        from_file = dataclasses.replace(from_file, row_parallel_slices=row_parallel_slices)
    flags = {"backend": None if backend_flag == "auto" else backend, "model_dtype": dtype, "state_dtype": state_dtype}
    from .contract import normalize_dtype

    for name in ("model_dtype", "state_dtype"):  # aliases (fp32, bf16) name the same dtype as the file's
        if flags[name] is not None:
            flags[name] = normalize_dtype(flags[name])
    for name, flag in flags.items():
        if flag is not None and flag != getattr(from_file, name):
            raise AlignedMambaError(f"--{name.replace('_', '-').replace('model-', '')} {flag} contradicts contract "
                                    f"{spec}'s {name}: {getattr(from_file, name)} (drop the flag or edit the file)")
    if backend_flag == "auto" and from_file.backend != backend:
        from .ops.backend import choose_backend

        choose_backend(from_file.backend)  # refuses a backend this machine cannot run, in one line
    return from_file


def _progress(start: float):
    def show(msg: str) -> None:
        log.info("[%6.1fs] %s", time.perf_counter() - start, msg)

    return show


# -- signals: SIGTERM is handled like SIGINT, and the processes a command started are ended -----------------------

def _stop_tracker() -> None:
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_pid", None) is not None and hasattr(tracker, "_stop"):
        try:
            tracker._stop()  # closes its pipe: it unlinks what leaked and exits
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


_terminating = False


def install_sigterm(end_now: bool = True) -> None:
    """SIGTERM raises ``Terminated`` in the main thread (unwound like Ctrl-C: the report closed as
    "terminated", the exit status 143). ``end_now``: end the child processes first, so that code
    waiting on them (a process pool's shutdown) returns; ``rl`` passes False and lets Ray shut its
    own processes down. Ray's ``init`` installs its own handler: ``rl`` calls this again after it."""
    if not threading_main():
        return

    def handler(signum: int, frame: Any) -> None:
        global _terminating
        if _terminating:
            return
        _terminating = True
        if end_now:
            processes.end_children()
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, handler)


def _terminated() -> int:
    processes.end_children()
    _stop_tracker()
    log.error("aligned-mamba: terminated (SIGTERM); worker processes ended")
    return EXIT_TERMINATED


def terminating() -> bool:
    """Whether SIGTERM arrived. ``Terminated`` raised while C code runs a Python callback surfaces as a
    ``SystemError`` (or another wrapper) instead; callers that catch exceptions consult this too."""
    return _terminating


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _logprob_cell(case: dict[str, Any]) -> str:
    """"differing/compared" reported logprobs of the sampled tokens, or "-" where none were reported."""
    n = case.get("logprob_tokens", 0)
    return f"{case['mismatched_logprobs']}/{n}" if n else "-"


def print_table(result: dict[str, Any]) -> None:
    c = result["contract"]
    m = result["model"]
    print(f"contract {c['fingerprint']}: chunk_size={c['chunk_size']} state={c['state_dtype']} "
          f"backend={c['backend']} dtype={c['model_dtype']}")
    print(f"model: {m['layers']} layers, {m['heads']} heads x {m['head_dim']}, groups {m['n_groups']}, "
          f"state {m['state_size']}, vocab {m['vocab']}; replay state {m['replay_bytes_per_sequence'] / 2**20:.2f} "
          f"MiB per sequence")
    if "pattern" in m:  # a hybrid: the heads above are its Mamba2 layers'
        moe = f", E MoE of {m['experts']} experts, {m['experts_per_token']} per token" if "experts" in m else ""
        print(f"layers: {m['pattern']} (M Mamba2, * attention of {m['attention_heads']} query / {m['kv_heads']} "
              f"key-value heads x {m['attention_head_dim']}, - MLP{moe})")
    if "tp_control" in result:
        tc = result["tp_control"]
        print(f"tensor parallel: trainer TP {result.get('trainer_tp')}, sampler TP {result.get('sampler_tp')}, "
              f"row_parallel_slices {c.get('row_parallel_slices', 1)}; stock TP {tc['degree']} (partials "
              f"all-reduced) differs from stock TP 1 in {tc['stock_mismatched_rows']} of {tc['rows']} rows")
    if "trainer_hardware" in result:
        print(f"hardware: {result['trainer_hardware']} (the class the bits belong to)")
    head = (f"{'case':<27} {'replay':<6} {'rows':>6} {'differ':>7} {'first':>6} {'max|d|':>9} {'logprobs':>8}  "
            "map (x: rows differ)")
    print(head)
    print("-" * len(head))
    for case in result["cases"]:
        print(f"{case['name']:<27} {'on' if case['exact_replay'] else 'off':<6} {case['rows']:>6} "
              f"{case['mismatched_rows']:>7} {_fmt(case['first_mismatch']):>6} {_fmt(case['max_abs_diff']):>9} "
              f"{_logprob_cell(case):>8}  {case['mismatch_map'][:40]}")
    for case in result["cases"]:
        if "baseline_engine" in case:
            print(f"{case['name']}: on the {case['baseline_engine']}")
    a = result["accuracy"]
    print(f"accuracy vs fp64 reference (scan outputs, layers {a['layers']}, {a['tokens']} tokens, {a['dtype']}): "
          f"chunked scan {a['chunked_scan']:.3e}, recurrent update {a['recurrent_update']:.3e}, "
          f"{a['dtype']} rounding floor {a['rounding_floor']:.3e} (mean |err| / mean |ref|)")
    if not result["ok"]:
        verdict = "FAIL: exact-replay rows or reported logprobs differ"
    elif result["control"]["could_fail"]:
        verdict = "OK: every exact-replay case is bit-identical"
    else:  # a check whose control agreed too proves nothing: it must not read as OK
        verdict = f"NO CONTROL: every row agreed, but so did the baseline: {result['control']['why']}"
    print(f"{verdict} ({result['timing']['total_s']:.1f}s)")


def cmd_check(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    show = _progress(start)
    report = JsonReport(args.json)  # a path that cannot be written is refused before any work
    try:
        return _check(args, start, show, report)
    except KeyboardInterrupt:
        report.close("interrupted", strict=False)
        raise
    except Terminated:
        report.close("terminated", strict=False)
        raise
    except BaseException as e:
        report.close(*status_of(e), strict=False)
        raise
    finally:
        while _TP_TRAINERS:  # the trainer's rank processes end with the command
            _TP_TRAINERS.pop().close()


_TP_TRAINERS: list[Any] = []  # the tensor-parallel trainer of a running check (closed when it ends)


def _check(args: argparse.Namespace, start: float, show: Any, report: JsonReport) -> int:
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
    if args.jobs is not None and args.jobs < 1:
        raise AlignedMambaError("--jobs must be >= 1")
    backend = choose_backend(args.backend)
    for flag, name in (("--engine", args.engine), ("--trainer", args.trainer)):
        require_extra(flag, name)
    engine_factory(args.engine)  # an engine that is not installed is refused before anything runs
    show(f"loading model {args.model!r}")
    config, tensors = load_source(args.model, args.dtype)
    contracts = [build_contract(config, side or args.contract, backend, args.dtype, args.state_dtype,
                                backend_flag=args.backend, row_parallel_slices=args.row_parallel_slices)
                 for side in (args.trainer_contract, args.sampler_contract)]
    trainer_c, sampler_c = contracts
    check_compatible(trainer_c, sampler_c)  # refuse before a single logit is computed
    from .integrations import check_parallel

    check_parallel(config, trainer=args.trainer, trainer_tp=args.trainer_tp, trainer_sp=args.trainer_sp,
                   trainer_contract=trainer_c, engine=args.engine, sampler_tp=args.sampler_tp,
                   sampler_contract=sampler_c)
    stored = getattr(config, "dtype", None)
    if args.dtype is None and stored is not None and sampler_c.model_dtype != stored:
        # a contract file's dtype would cast the checkpoint: only an explicit --dtype asks for that
        raise AlignedMambaError(f"the contract's model_dtype {sampler_c.model_dtype} is not the checkpoint's stored "
                                f"{stored}: pass --dtype {sampler_c.model_dtype} to compute in it from these weights")
    backend = sampler_c.backend
    jobs = args.jobs if args.jobs is not None else (min(2, os.cpu_count() or 1) if backend == "torch" else 1)
    if args.sampler_tp > 1 and args.jobs is None:
        jobs = 1  # the engine's ranks are processes already
    if backend == "torch":
        _check_memory(config, sampler_c, args, jobs)
    if jobs > 1:
        torch.set_num_threads(1)  # one thread per process: the workers take the other cores
    if args.trainer != "reference" or args.trainer_tp > 1:
        show(f"building the {args.trainer} trainer" + (f" at TP {args.trainer_tp}" if args.trainer_tp != 1 else "")
             + (" with sequence parallelism" if args.trainer_sp else ""))
    # at TP > 1 the trainer starts its own rank processes (tp_reference.TPTrainer, trainer_hooks.megatron.tp)
    trainer = build_trainer(args.trainer, config=config, tensors=tensors, contract=trainer_c, tp=args.trainer_tp,
                            sequence_parallel=args.trainer_sp)
    if args.trainer_tp > 1:
        _TP_TRAINERS.append(trainer)
    from .models import build_model
    from .train import PolicyTrainer

    # the model of the accuracy line: the reference trainer's own, else one built from the same weights
    reference = trainer.model() if isinstance(trainer, PolicyTrainer) else build_model(config, tensors, trainer_c)
    longest = args.prompt_len + args.gen_len
    spec = EngineSpec(model=args.model, contract=sampler_c.to_dict(), dtype=args.dtype,
                      max_model_len=max(longest + 16, 256), max_num_seqs=args.requests,
                      max_batch_tokens=max(args.prompt_len * args.requests, args.max_batch_tokens or 0, 256),
                      tp=args.sampler_tp)
    from .hardware import hardware_class

    device = "cpu" if backend == "torch" else "cuda"
    here = {"engine": args.engine, "trainer": args.trainer, "trainer_tp": args.trainer_tp,
            "trainer_sp": args.trainer_sp, "sampler_tp": args.sampler_tp, "hardware": hardware_class(device).to_dict(),
            "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                            "device": "cpu" if backend == "torch" else torch.cuda.get_device_name()}}
    report.update(here)
    result = run_check(trainer, args.engine, spec, reference=reference, prompt_len=args.prompt_len,
                       gen_len=args.gen_len, requests=args.requests, max_batch_tokens=args.max_batch_tokens,
                       seed=args.seed, jobs=jobs, progress=show, on_case=lambda r: report.update({**r, **here}),
                       allow_cross_hardware=args.allow_cross_hardware)
    result.update(here)
    could_fail = result["control"]["could_fail"]
    if max(args.trainer_tp, args.sampler_tp) > 1:
        from .check import make_prompts
        from .tp_reference import tp_control

        degree = max(args.trainer_tp, args.sampler_tp)
        show(f"tensor-parallel control: stock row-parallel sums at TP {degree} against TP 1")
        prompts = make_prompts(reference.shape.vocab_size, args.prompt_len, args.requests, args.seed)
        result["tp_control"] = tp_control(config, tensors, trainer_c, degree,
                                          [torch.tensor(p, dtype=torch.int64) for p in prompts])
        could_fail = could_fail and result["tp_control"]["could_fail"]
        tc = result["tp_control"]
        show(f"tensor-parallel control: stock TP {degree} differed from stock TP 1 in {tc['stock_mismatched_rows']} "
             f"of {tc['rows']} rows")
    result["timing"]["wall_s"] = round(time.perf_counter() - start, 3)
    print_table(result)
    report.update(result)
    status = "mismatch" if not result["ok"] else "ok" if could_fail else "no-control"
    report.close(status)
    if args.json:
        show(f"wrote {args.json}")
    return {"ok": EXIT_OK, "mismatch": EXIT_MISMATCH, "no-control": EXIT_NO_CONTROL}[status]


def require_extra(flag: str, name: str) -> None:
    """Refuse (one line, with the install command) an engine or trainer whose extra is not installed."""
    import importlib.util

    if name not in _EXTRA_NEEDS:
        return
    module, extra = _EXTRA_NEEDS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise AlignedMambaError(f"{flag} {name} needs the {extra!r} extra ({module} is not installed): "
                                f"pip install 'aligned-mamba[{extra}]' (from a checkout: pip install -e '.[{extra}]')")


def _check_memory(config: Any, contract: Any, args: argparse.Namespace, jobs: int) -> None:
    """Refuse a torch-backend run whose estimated peak (memory.py) exceeds the available memory."""
    from .memory import RUNTIME_BYTES, check_fits, forward_bytes_per_token
    from .models import describe

    m = describe(config)
    if "heads" not in m:  # a family without Mamba2 mixers: no estimate of its scan
        return
    per_token = forward_bytes_per_token(hidden=m["hidden_size"], heads=m["heads"], head_dim=m["head_dim"],
                                        groups=m["n_groups"], state=m["state_size"], chunk=contract.chunk_size,
                                        vocab=m["vocab"], dtype_bytes=2 if contract.model_dtype == "bfloat16" else 4)
    trainer_tokens = args.requests * (args.prompt_len + args.gen_len)
    sampler_tokens = args.requests * args.prompt_len  # a decode case prefills every prompt in one step
    # run_scenarios starts one engine per distinct spec (exact replay on, off), never more than that
    # however many --jobs: more workers would have nothing to run
    from .check import CASES

    specs = len({case.exact_replay for case in CASES})
    engines = min(max(1, jobs), specs) if args.engine == "reference" else 0  # vLLM's workers budget their own
    need = (1 + engines) * RUNTIME_BYTES + per_token * (trainer_tokens + engines * sampler_tokens)
    check_fits(need, f"check of {args.requests} x ({args.prompt_len}+{args.gen_len}) tokens",
               "lower --prompt-len, --gen-len or --requests" + (" (or --jobs 1)" if engines > 1 else ""))


def seed_type(text: str) -> int:
    """--seed: an integer in [0, 2**63 - 1] (torch's generators take a 64-bit seed)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed {text!r}: not an integer") from None
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"--seed {text}: outside 0..2**63-1")
    return v


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help with each flag's default; a flag without a default says nothing about one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .report import package_commit

    p = argparse.ArgumentParser(prog="aligned-mamba", description="Bitwise train/inference alignment for Mamba2.",
                                formatter_class=_Help)
    commit = package_commit()
    p.add_argument("--version", action="version",
                   version=f"aligned-mamba {__version__}{f' (commit {commit})' if commit else ''}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="sample, score, and compare logits rows bit for bit", formatter_class=_Help)
    c.add_argument("--model", default="tiny", help="'tiny' (the embedded default) or a Hugging Face Mamba2 directory")
    c.add_argument("--engine", default="reference", choices=["reference", "vllm"],
                   help="the sampler engine (vllm: a real vLLM engine with the exact-replay plugin; extra 'vllm')")
    c.add_argument("--trainer", default="reference", choices=["reference", "megatron"],
                   help="the trainer forward (megatron: Megatron-Core's MambaModel with the hook; extra 'megatron')")
    c.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"],
                   help="kernels: triton on a GPU, torch on the CPU; auto picks triton where CUDA is available")
    c.add_argument("--prompt-len", type=int, default=600,
                   help="longest prompt; the others are 37 tokens shorter each (at least 1)")
    c.add_argument("--gen-len", type=int, default=300, help="tokens generated per request")
    c.add_argument("--requests", type=int, default=4, help="requests per case")
    c.add_argument("--max-batch-tokens", type=int, default=None,
                   help="token budget per engine step for the chunked-prefill cases (default: 100, or 101 where "
                        "100 is a multiple of the chunk size)")
    c.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="model dtype (default: the checkpoint's; bfloat16 for tiny)")
    c.add_argument("--state-dtype", default=None,
                   help="SSM state dtype (default float32, the only one that can promise bits; fp32 is accepted "
                        "as its alias)")
    c.add_argument("--contract", default=None, help="contract name (configs/contracts) or YAML path, both sides")
    c.add_argument("--trainer-contract", default=None, help="contract for the trainer side only")
    c.add_argument("--sampler-contract", default=None, help="contract for the sampler side only")
    c.add_argument("--seed", type=seed_type, default=0, help="seed of the prompts and of sampling (0..2**63-1)")
    c.add_argument("--trainer-tp", type=int, default=1, metavar="K",
                   help="the trainer's tensor-parallel degree (a power of two dividing the contract's "
                        "row_parallel_slices; ranks are gloo processes on the CPU; reference or megatron)")
    c.add_argument("--trainer-sp", action="store_true",
                   help="the megatron trainer with Megatron's sequence parallelism over its --trainer-tp ranks")
    c.add_argument("--sampler-tp", type=int, default=1, metavar="M",
                   help="the sampler engine's tensor-parallel degree (as --trainer-tp)")
    c.add_argument("--row-parallel-slices", type=int, default=None, metavar="S",
                   help="the contract's row_parallel_slices (default: the contract's, 1 for a checkpoint's): "
                        "every TP degree dividing S gives the same bits; S = 1 is the plain linear layer")
    c.add_argument("--jobs", type=int, default=None,
                   help="sampler worker processes (default: 2 on a multi-core CPU with the torch backend, else 1); "
                        "the trainer scores in the main process")
    c.add_argument("--json", default=None, metavar="PATH",
                   help="write the results as JSON to a regular file or a new path (checked first, rewritten "
                        "atomically after each case, closed with a status)")
    c.add_argument("--allow-cross-hardware", action="store_true",
                   help="compare rows computed on different hardware classes (bits are not promised to agree)")
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
        c = sub.add_parser(ep.name, help=cmd.help, description=getattr(cmd, "description", None),
                           formatter_class=_Help)
        cmd.add_arguments(c)
        c.set_defaults(func=cmd.run)


def _unavailable(why: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise AlignedMambaError(why)

    return run


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def status_of(e: BaseException) -> tuple[str, str]:
    """(report status, one-line reason) of an exception that ends a command (see ``exit_status``)."""
    code, why = exit_status(e)
    return ("refused" if code == EXIT_BAD_INPUT else "failed"), why


def exit_status(e: BaseException) -> tuple[int, str]:
    """The exit status and one-line reason for an exception that ends a command: 2 for refused
    input (``AlignedMambaError``, ``ValueError``), 3 for a failed run (``RuntimeFailure``, out of
    memory, a worker process that died, an OS error during the run, anything unexpected)."""
    from concurrent.futures.process import BrokenProcessPool

    if isinstance(e, RuntimeFailure):
        return EXIT_RUNTIME, _one_line(e)
    if isinstance(e, (AlignedMambaError, ValueError)):
        return EXIT_BAD_INPUT, _one_line(e)
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return EXIT_RUNTIME, f"out of memory: {_one_line(e)}"
    if isinstance(e, BrokenProcessPool):
        return EXIT_RUNTIME, "a sampler worker process died (killed, e.g. out of memory)"
    return EXIT_RUNTIME, f"{type(e).__name__}: {_one_line(e)} (ALIGNED_MAMBA_TRACEBACK=1 shows where)"


class _Stderr(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test's capture, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must not end the command
            self.handleError(record)


def setup_logging() -> None:
    """The command's stderr handler for the "aligned_mamba" logger (messages as they are), unless
    the embedding program configured one."""
    if not log.handlers:
        h = _Stderr()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


commanding = False  # main() runs: the command owns the process's signals


def main(argv: list[str] | None = None) -> int:
    global _terminating, commanding
    args = build_parser().parse_args(argv)
    setup_logging()
    _terminating = False
    previous = signal.getsignal(signal.SIGTERM) if threading_main() else None
    install_sigterm()
    commanding = True
    try:
        return args.func(args)
    except KeyboardInterrupt:
        processes.end_children()
        _stop_tracker()
        log.error("aligned-mamba: interrupted")
        return EXIT_INTERRUPTED
    except Terminated:
        return _terminated()
    except Exception as e:  # noqa: BLE001 - every failure leaves with one line and a status that means one thing
        if terminating():  # SIGTERM's exception, wrapped by the C code it interrupted
            return _terminated()
        code, why = exit_status(e)
        if os.environ.get("ALIGNED_MAMBA_TRACEBACK"):
            traceback.print_exc()
        kind = "error" if code == EXIT_BAD_INPUT else "runtime failure"
        log.error("aligned-mamba: %s: %s", kind, why)
        return code
    finally:
        commanding = False
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)  # a caller of main() (a test, a wrapper) gets its own back


if __name__ == "__main__":
    # run as the imported module, not as __main__: rollout.rl reads this module's state (who owns SIGTERM)
    from aligned_mamba.cli import main as _main

    sys.exit(_main())
