"""Sampler-side integrations, thin edges over ``aligned_mamba``: the vLLM plugin and its models
(``vllm_plugin``, ``vllm_model``), a real vLLM engine behind the core's engine protocol (``vllm_runner``,
``vllm_engine``: ``check`` / ``rl --engine vllm``), and ``aligned-mamba rl``, the RL loop on Ray (``rl``, ``actors``).
"""
