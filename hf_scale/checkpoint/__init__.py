"""Checkpoints in the Hub's own format, written in parallel by every rank."""

from .safetensors_io import save_pretrained

__all__ = ["save_pretrained"]
