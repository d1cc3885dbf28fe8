"""Merge a trained LoRA adapter into its base model and write a plain Hub-format model.

The result loads with plain ``AutoModelForCausalLM.from_pretrained`` and holds what peft's
``merge_and_unload()`` gives: each targeted weight becomes ``W + scale * B @ A``. The merge runs
in one process with peft itself (the base is memory-mapped from its safetensors; the update is
rank r, cheap next to reading the base), then the model is written by :func:`save_pretrained`.

Usage::

    merge_adapter("ckpt/latest", "out/merged")                 # base from adapter_config.json
    merge_adapter("out/adapter", "out/merged", base="path/to/base", dtype=torch.bfloat16)
    merge_adapter("ckpt/latest", "out/merged", dequantize=True)  # QLoRA: into the NF4 base it saw
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import HfScaleCheckpointError
from .adapters import ADAPTER_CONFIG, adapter_weight_map


def adapter_folder(path: str | os.PathLike) -> Path:
    """The adapter folder ``path`` names: itself, or a training checkpoint's ``model/``
    (``step_*`` or ``<root>/latest``) when that holds an adapter."""
    from .training_state import resolve_checkpoint

    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file():
        try:
            folder = resolve_checkpoint(path) / "model"
        except HfScaleCheckpointError:
            pass
    adapter_weight_map(folder)  # one clear error for anything else
    return folder


def merge_adapter(adapter: str | os.PathLike, out: str | os.PathLike, *, base: str | None = None,
                  dtype: torch.dtype | None = None, tokenizer=None, dequantize: bool = False) -> Path:
    """Write ``base`` with the adapter of ``adapter`` merged into ``out`` (a Hub-format model).

    ``base`` (a folder or a Hub id) defaults to the adapter config's ``base_model_name_or_path``;
    ``dtype`` to the base checkpoint's. ``dequantize`` (a QLoRA adapter): merge into the base the
    adapter was trained against, its NF4 weights quantized and dequantized again (torchtune's
    choice; the default, peft's, merges into the full-precision base, which the adapter never saw:
    the merged model then differs from the trained one by the quantization error). Call it in one
    process.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .save import save_pretrained

    folder = adapter_folder(adapter)
    source = base or read_base(folder)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", use_safetensors=True)
    if dequantize:
        from .quantized import dequantized_base

        dequantized_base(model, folder)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return save_pretrained(merged, out, tokenizer=tokenizer)


def read_base(folder: Path) -> str:
    """The adapter's base model, from its config; a clear error when it names none."""
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise HfScaleCheckpointError(
            f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path: give the base model "
            "(--base NAME_OR_FOLDER, or base=...)."
        )
    return base
