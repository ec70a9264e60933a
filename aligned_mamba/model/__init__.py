"""Mamba2 model configuration and checkpoints (Hugging Face layout)."""

from aligned_mamba.model.checkpoint import expected_shapes, load_checkpoint, make_tiny, save_checkpoint
from aligned_mamba.model.config import Mamba2Config

__all__ = ["Mamba2Config", "expected_shapes", "load_checkpoint", "make_tiny", "save_checkpoint"]
