"""Sampler-side integrations: the RL loop on Ray, and (in progress) the vLLM plugin.

- ``rollout.actors``: the rollout worker, trainer scorer and alignment checker as plain classes,
  and the two interfaces an engine (``Sampler``) or a trainer (``PolicyScorer``) implements to be
  selected by name (``aligned_mamba.rl_engines`` / ``aligned_mamba.rl_trainers`` entry points;
  "reference" is built in).
- ``rollout.rl``: the loop driver on Ray and the ``aligned-mamba rl`` subcommand (registered under
  ``aligned_mamba.commands``; the core never imports Ray).

Thin edges over ``aligned_mamba``: the bits are the core's, these modules only move them around.
"""
