"""Sampler-side integrations (vLLM plugin, Ray actors). Thin edges over ``aligned_mamba``; none ships yet."""
