"""Sample rollouts with vLLM under exact replay and check the logprobs it reports against the trainer's.

    VLLM_CPU_KVCACHE_SPACE=1 python examples/vllm_rollout.py [--model DIR] [--temperature 0.7]

vLLM generates with ``SamplingParams(logprobs=0)`` under ``logprobs_mode="processed_logprobs"``, as
verl reads it; the plugin is switched on by ``additional_config={"aligned_mamba": {}}``. The trainer
side scores each prompt + completion in one pass (``aligned_mamba.load_model(DIR).forward``) and
takes ``aligned_mamba.token_logprobs`` at the sampled tokens and the same temperature; the two are
compared with ``torch.equal``. ``--stock`` runs vLLM without the plugin: the baseline that differs.
``DIR``: a Hugging Face Mamba2 or Nemotron-H checkpoint (default: the embedded tiny model, written to
a temporary directory; ``examples/megatron_train.py --save DIR`` writes one after training).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=200, help="tokens per prompt (the first is this long, "
                   "the others shorter, so that requests are unaligned)")
    p.add_argument("--max-tokens", type=int, default=120, help="sampled tokens per request")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-batch-tokens", type=int, default=64, help="vLLM's token budget per step (splits "
                   "prefills at odd offsets)")
    p.add_argument("--stock", action="store_true", help="run vLLM without the plugin (the baseline)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build asks for it
    import aligned_mamba

    model_dir = args.model
    if model_dir is None:
        from aligned_mamba.models.mamba2 import make_tiny, save_checkpoint

        model_dir = tempfile.mkdtemp(prefix="aligned_mamba_tiny_")
        save_checkpoint(model_dir, *make_tiny(0))
    trainer = aligned_mamba.load_model(model_dir)  # the checkpoint's contract: what the plugin runs by default
    vocab = trainer.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    lens = [max(2, args.prompt_len - 37 * i) for i in range(args.requests)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]

    from vllm import LLM, SamplingParams

    plugin = {} if args.stock else {"additional_config": {"aligned_mamba": {}}}
    llm = LLM(model=model_dir, enforce_eager=True, enable_prefix_caching=False, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs", max_num_batched_tokens=args.max_batch_tokens,
              max_model_len=args.prompt_len + args.max_tokens, long_prefill_token_threshold=0, **plugin)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, logprobs=0,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    differ = total = 0
    for prompt, out in zip(prompts, outs):
        done = out.outputs[0]
        sampled = list(done.token_ids)
        reported = torch.tensor([lp[t].logprob for lp, t in zip(done.logprobs, sampled)], dtype=torch.float32)
        seq = torch.tensor(prompt + sampled)
        logits = trainer.forward([seq])[0]  # the trainer's one pass over prompt + completion
        start = len(prompt)
        mine = aligned_mamba.token_logprobs(logits[start - 1:-1], seq[start:], args.temperature)
        differ += int((mine != reported).sum())
        total += len(sampled)
    side = "stock vLLM" if args.stock else "vLLM with exact replay"
    print(f"{side}: {differ} of {total} reported logprobs differ from the trainer's (T={args.temperature})")
    return 0 if differ == 0 else 1


if __name__ == "__main__":  # vLLM spawns its engine processes
    sys.exit(main())
