"""Sampler-side integrations: thin edges over ``aligned_mamba``.

- ``vllm_plugin`` / ``vllm_model``: the vLLM plugin (``ALIGNED_MAMBA_EXACT_REPLAY=1``) that runs
  Mamba2ForCausalLM on the core's ops with the replay state in vLLM's Mamba cache.
- ``vllm_runner`` / ``vllm_check``: real vLLM engines driven through the check's schedules
  (``aligned-mamba check --engine vllm``).
"""
