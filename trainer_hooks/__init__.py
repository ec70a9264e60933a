"""Trainer-side integrations (Megatron-Core). Thin edges over ``aligned_mamba``; none ships yet."""
