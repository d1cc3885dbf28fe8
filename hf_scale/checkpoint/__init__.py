"""Checkpoints in the Hub's own format, written in parallel by every rank."""

from .convert import convert_pickle_checkpoint
from .export import export_checkpoint
from .load import from_pretrained, load_adapter
from .merge import merge_adapter
from .save import save_pretrained
from .training_state import load_state, save_state

__all__ = [
    "convert_pickle_checkpoint", "export_checkpoint", "from_pretrained", "load_adapter", "load_state", "merge_adapter",
    "save_pretrained", "save_state",
]
