"""Checkpoints in the Hub's own format, written in parallel by every rank."""

from .convert import convert_pickle_checkpoint
from .load import from_pretrained
from .safetensors_io import save_pretrained

__all__ = ["convert_pickle_checkpoint", "from_pretrained", "save_pretrained"]
