"""Merge a trained LoRA adapter into its base model and write a plain Hub-format model.

The result loads with plain ``AutoModelForCausalLM.from_pretrained`` and holds what peft's
``merge_and_unload()`` gives: each targeted weight becomes ``W + scale * B @ A``. The merge runs
in one process with peft itself (the base is memory-mapped from its safetensors; the update is
rank r, cheap next to reading the base), then the model is written by :func:`save_pretrained`.

Usage::

    merge_adapter("ckpt/latest", "out/merged")                 # base from adapter_config.json
    merge_adapter("out/adapter", "out/merged", base="zoo:smollm2", dtype=torch.bfloat16)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import HfScaleCheckpointError, HfScaleError
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
                  dtype: torch.dtype | None = None, tokenizer=None) -> Path:
    """Write ``base`` with the adapter of ``adapter`` merged into ``out`` (a Hub-format model).

    ``base`` defaults to the adapter config's ``base_model_name_or_path`` (a folder, a Hub id,
    or ``zoo:<name>``); ``dtype`` to the base checkpoint's. Call it in one process.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .safetensors_io import save_pretrained

    folder = adapter_folder(adapter)
    source = _base_source(base or json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path"))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", use_safetensors=True)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return save_pretrained(merged, out, tokenizer=tokenizer)


def _base_source(base: str | None) -> str:
    """A loadable base: ``zoo:<name>`` becomes its local folder; nothing is a clear error."""
    if not base:
        raise HfScaleCheckpointError(
            f"the adapter's {ADAPTER_CONFIG} names no base_model_name_or_path: give the base model "
            "(--base NAME_OR_FOLDER, or base=...)."
        )
    from ..zoo import HUB_IDS, is_zoo, zoo_source

    by_hub_id = {hub: name for name, hub in HUB_IDS.items()}
    if base in by_hub_id and not Path(base).exists():
        try:  # the zoo's copy of a model named by its Hub id (offline, as everything here)
            return str(zoo_source(by_hub_id[base])[0])
        except HfScaleError:  # its package is not installed: the Hub id it is
            return base
    return str(zoo_source(base)[0]) if is_zoo(base) else base
