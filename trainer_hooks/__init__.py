"""Trainer-side integrations (Megatron-Core), thin edges over ``aligned_mamba``; the modules:
docs/design.md, "Layout"."""
