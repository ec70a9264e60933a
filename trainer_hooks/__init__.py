"""Trainer-side integrations (Megatron-Core). Thin edges over ``aligned_mamba``.

- ``megatron_weights``: Megatron-Core MambaModel state dict <-> Hugging Face Mamba2 weights
  (TP=1), exact both ways: how a trainer exports weights to rollout workers.
The forward hook itself (``--aligned-mamba``) is not here yet.
"""
