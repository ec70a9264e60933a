"""Sampler-side integrations: thin edges over ``aligned_mamba``.

- ``vllm_plugin`` / ``vllm_model``: the vLLM plugin (``ALIGNED_MAMBA_EXACT_REPLAY=1``) that runs
  Mamba2ForCausalLM on the core's layers with their replay state in vLLM's Mamba cache.
- ``vllm_runner`` / ``vllm_engine``: a real in-process vLLM engine driven through a ``Scenario``, as
  the core's engine protocol (``aligned-mamba check --engine vllm``, ``aligned-mamba rl --engine vllm``).
- ``rl`` / ``actors``: ``aligned-mamba rl``, the RL loop on Ray (rollout workers, trainer, checker).
"""
