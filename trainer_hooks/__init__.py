"""Trainer-side integrations (Megatron-Core). Thin edges over ``aligned_mamba``.

- ``megatron``: the ``--aligned-mamba`` hook, a package: Megatron-Core's Mamba2 (and hybrid Nemotron-H
  attention / MLP / MoE) forward on the core's layers and contract (``add_arguments``, ``apply_from_args``,
  ``apply_from_config``, ``install``, ``aligned_mamba_stack_spec``).
- ``megatron_weights``: Megatron-Core MambaModel state dict <-> Hugging Face Mamba2 / Nemotron-H weights (TP=1),
  exact both ways: how a trainer exports weights to rollout workers.
- ``megatron_shards``: a Megatron state dict split per tensor-parallel rank exactly as Megatron shards its
  modules, and merged back (every TP degree loads the same checkpoint).
- ``megatron_tp``: the Megatron trainer at tensor-parallel size k in k rank processes over gloo (scores,
  steps and exports; ``aligned-mamba check`` / ``rl`` ``--trainer-tp``).
- ``megatron_trainer``: the core's trainer protocol on a real MambaModel with the hook applied
  (``aligned-mamba check --trainer megatron``, ``aligned-mamba rl --trainer megatron``).
- ``megatron_cpu``: CPU-only shims (no CUDA, mamba_ssm or Transformer Engine) for the check and the tests;
  never applied by the hook itself.
"""
