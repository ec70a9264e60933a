"""Train a Mamba2 ``MambaModel`` with Megatron-Core and the aligned-mamba hook, then check its bits.

    python examples/megatron_train.py --aligned-mamba --steps 3 --save /tmp/am_ckpt

Megatron-Core's own classes build the model (``TransformerConfig``, ``MambaModel``, a ``ModuleSpec``);
the lines marked ``HOOK`` are all a training script adds. After training, the script scores a few
sequences with the Megatron model (``trainer_hooks.megatron.token_logprobs``, the loss side's
logprobs) and with the sampler's model (``aligned_mamba.load_model`` of the exported Hugging Face
checkpoint, what the vLLM plugin runs) and compares them with ``torch.equal``. Without
``--aligned-mamba`` the same comparison shows Megatron's stock forward differing. ``--save DIR``
keeps the checkpoint for ``examples/vllm_rollout.py --model DIR``.

Runs on the CPU (one gloo rank) or one GPU. ``trainer_hooks.megatron.cpu`` stands in for what the machine lacks
(mamba_ssm, Transformer Engine, CUDA); a job with those and its own ``torch.distributed`` setup
skips it.

In Megatron-LM's ``pretrain_mamba.py``: chain the hook's flags onto the script's own
``extra_args_provider`` (``lambda p: hook.add_arguments(add_extra_args(p))``), call
``hook.apply_from_args(get_args())`` in the model builder before ``MambaModel(...)``, pass
``--transformer-impl local`` and build the stack from ``hook.aligned_mamba_stack_spec(contract)``
(a spec object; ``--spec`` takes a module and the name of an object in it). With ``--sequence-parallel``
this spec is the one that builds: Megatron's torch norms refuse sequence parallelism.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch

import aligned_mamba
from aligned_mamba.contract import Contract
from aligned_mamba.models.mamba2 import Mamba2Config, save_checkpoint
from trainer_hooks import megatron as hook
from trainer_hooks.megatron import cpu as megatron_cpu
from trainer_hooks.megatron.weights import megatron_to_hf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=300, help="tokens per sequence (above the chunk size)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save", metavar="DIR", help="write the trained model as a Hugging Face Mamba2 checkpoint")
    hook.add_arguments(p)  # HOOK: --aligned-mamba, --aligned-mamba-contract
    return p.parse_args(argv)


def mamba2_config(args: argparse.Namespace, contract: Contract) -> Mamba2Config:
    """The Hugging Face config of the model trained here (the sampler loads the exported checkpoint)."""
    return Mamba2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_heads=2 * args.hidden // 64, head_dim=64, state_size=128, n_groups=1,
                        chunk_size=contract.chunk_size, dtype=contract.model_dtype)


def build(args: argparse.Namespace, hf: Mamba2Config, contract: Contract) -> torch.nn.Module:
    """Megatron-Core's MambaModel of ``hf``'s shape, in the contract's dtype."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, contract.model_dtype)
    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=1,
        mamba_num_heads=hf.num_heads, mamba_head_dim=hf.head_dim, mamba_state_dim=hf.state_size,
        mamba_num_groups=hf.n_groups, normalization="RMSNorm", layernorm_epsilon=hf.layer_norm_epsilon,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, fp32_residual_connection=hf.residual_in_fp32,
        use_cpu_initialization=not torch.cuda.is_available())
    if args.aligned_mamba:
        hook.apply_from_config(config, contract)  # HOOK: before the model is built
        spec = hook.aligned_mamba_stack_spec(contract, hf.layer_norm_epsilon)
    else:
        spec = hook.local_mamba_stack_spec(hf.layer_norm_epsilon)
        spec.submodules.mamba_layer.submodules.mixer.params["chunk_size"] = contract.chunk_size
    model = MambaModel(config, spec, vocab_size=hf.vocab_size, max_sequence_length=1 << 16,
                       position_embedding_type="none", share_embeddings_and_output_weights=False)
    return model.cuda() if torch.cuda.is_available() else model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    megatron_cpu.setup()  # stand-ins for mamba_ssm / TE / CUDA where missing
    megatron_cpu.init_single_process()  # one rank; a real job has its own torch.distributed setup
    contract = Contract.from_yaml(args.aligned_mamba_contract)
    hf = mamba2_config(args, contract)
    torch.manual_seed(0)
    model = build(args, hf, contract)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)

    for step in range(args.steps):
        tokens = torch.randint(0, hf.vocab_size, (args.batch, args.seq_len + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1], None, attention_mask=None)  # [b, s, V]
        # the loss reads the contract's logprobs: the bits the sampler reports for these tokens
        loss = -hook.token_logprobs(logits, tokens[:, 1:], sequence_first=False).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}", file=sys.stderr)

    model.eval()
    out = args.save or tempfile.mkdtemp(prefix="aligned_mamba_example_")
    dtype = getattr(torch, contract.model_dtype)
    fp32 = (".A_log", ".D", ".dt_bias")  # kept in float32, as the model computes with them
    tensors = {k: v.detach().cpu().to(torch.float32 if k.endswith(fp32) else dtype).contiguous()
               for k, v in megatron_to_hf(model.state_dict(), hf).items()}  # (stock's torch norms hold fp32)
    save_checkpoint(out, hf, tensors)
    sampler = aligned_mamba.load_model(out, contract)  # what the vLLM plugin runs for this checkpoint

    seqs = [torch.randint(0, hf.vocab_size, (n,), generator=gen) for n in (args.seq_len, args.seq_len // 3 + 7)]
    differ = total = 0
    with torch.no_grad():
        for seq in seqs:
            ids = seq.to(device)[None]
            trainer_lp = hook.token_logprobs(model(ids[:, :-1], None, attention_mask=None), ids[:, 1:],
                                             sequence_first=False)[0].cpu()
            sampler_lp = aligned_mamba.token_logprobs(sampler.forward([seq])[0][:-1], seq[1:], contract=contract)
            differ += int((trainer_lp != sampler_lp).sum())
            total += seq.numel() - 1
    state = "on" if args.aligned_mamba else "off"
    print(f"hook {state}: {differ} of {total} token logprobs differ between Megatron and the sampler's model"
          f"{' (checkpoint: ' + out + ')' if args.save else ''}")
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
