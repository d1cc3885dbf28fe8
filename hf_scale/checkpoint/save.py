"""``save_pretrained``: the model's checkpoint, whichever kind it is -- a whole model in the
Hub's format (:func:`hf_scale.checkpoint.safetensors_io.save_model`), or a peft model's adapter
in peft's format (:func:`hf_scale.checkpoint.adapters.save_adapter`)."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from .adapters import is_adapter_model, save_adapter
from .safetensors_io import save_model


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_size: int | str = "auto",
    checksums: bool = True,
) -> Path:
    """Save ``model`` (parallelized or not) as transformers or peft would, writing from every
    rank; call it on every rank.

    A transformers model: the Hub format (``model*.safetensors`` + index, ``config.json``,
    ``generation_config.json``, the tokenizer, ``checksums.sha256``), see :func:`save_model` for
    ``max_shard_size`` and the checks. A ``PeftModel``: its active adapter as peft saves it
    (``adapter_config.json`` + ``adapter_model.safetensors``, every rank writing its slices into
    the one file peft reads; the base is not written: training does not change it).

    Usage::

        hf_scale.save_pretrained(model, "out/", tokenizer=tokenizer, max_shard_size="2GB")
    """
    if is_adapter_model(model):
        return save_adapter(model, save_directory, tokenizer=tokenizer, checksums=checksums)
    return save_model(model, save_directory, tokenizer=tokenizer, max_shard_size=max_shard_size,
                      checksums=checksums)
