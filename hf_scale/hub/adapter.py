"""PEFT adapter folders, as ``PeftModel.save_pretrained`` writes them: recognised, checked, described.

An adapter folder holds ``adapter_config.json`` (``peft_type``, ``base_model_name_or_path``,
``r``, ``lora_alpha``, ``target_modules``, ``task_type``, ...) and ``adapter_model.safetensors``,
and no ``config.json``: the base model's weights are not in it. The push checks it with
:func:`check_adapter` instead of the model checks, and its card (``hub/card.py``) takes the base
model, the Hub task and the peft conventions (``library_name: peft``, the tags
``base_model:adapter:<base>``, ``lora``, ``transformers``, as ``PeftModel.create_or_update_model_card``
writes them) from here.

Usage::

    config = read_adapter_config(folder)      # None: not an adapter folder
    base_model_of(config), adapter_tags(config, base)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..checkpoint.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ..checkpoint.shard_layout import read_header
from ..errors import HfScaleCheckpointError

# peft's task_type -> the head suffix of card.HEADS (which gives the pipeline tag and Auto class)
TASK_HEADS = {
    "CAUSAL_LM": "ForCausalLM",
    "SEQ_CLS": "ForSequenceClassification",
    "SEQ_2_SEQ_LM": "ForConditionalGeneration",
    "TOKEN_CLS": "ForTokenClassification",
}
# peft's save_pretrained writes huggingface_hub's default card, every section a placeholder
PEFT_PLACEHOLDERS = ("<!-- Provide a quick summary of what the model is/does. -->", "[More Information Needed]")


def read_adapter_config(folder: Path) -> dict[str, Any] | None:
    """``folder/adapter_config.json`` as a dict, or None when the folder has none (not an
    adapter). HfScaleCheckpointError when it is not a peft config (a JSON object with ``peft_type``)."""
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise HfScaleCheckpointError(f"{path} is not valid JSON ({e}): save the adapter again.") from None
    if not isinstance(config, dict) or not config.get("peft_type"):
        raise HfScaleCheckpointError(
            f"{path} has no peft_type, so it is not a PEFT adapter config: push the folder "
            "PeftModel.save_pretrained wrote."
        )
    return config


def check_adapter(folder: Path) -> None:
    """Raise HfScaleCheckpointError unless ``folder`` holds a readable config and safetensors weights."""
    read_adapter_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickle = (folder / "adapter_model.bin").is_file()
        hint = (" It holds adapter_model.bin (pickle): save with PeftModel.save_pretrained(folder, "
                "safe_serialization=True)." if pickle else "")
        raise HfScaleCheckpointError(f"{folder} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}.{hint}")
    read_header(weights)  # a truncated or foreign file is an error here, not on the Hub


def base_model_of(config: dict[str, Any]) -> str | None:
    """The base model the adapter was trained on (``base_model_name_or_path``, as it is: the
    fine-tuning job writes the Hub id of a ``zoo:`` model there; a local path is kept)."""
    return config.get("base_model_name_or_path") or None


def head_names(config: dict[str, Any]) -> list[str]:
    """Class-name suffixes for card.HEADS: from ``task_type``, else the base class peft recorded."""
    names = [TASK_HEADS.get(config.get("task_type") or "")]
    names.append((config.get("auto_mapping") or {}).get("base_model_class"))
    return [name for name in names if name]


def adapter_tags(config: dict[str, Any], base_model: str | None) -> list[str]:
    """peft's own card tags: ``base_model:adapter:<base>``, ``lora`` for LoRA, ``transformers``."""
    tags = [f"base_model:adapter:{base_model}"] if base_model else []
    return tags + (["lora"] if config["peft_type"] == "LORA" else []) + ["transformers"]


def template_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the card shows it: ``target_modules`` sorted (peft saves a set, in any order)."""
    targets = config.get("target_modules")
    return {**config, "target_modules": sorted(targets) if isinstance(targets, list) else targets}


def is_peft_placeholder(readme: Path) -> bool:
    """Whether ``readme`` is the unfilled card ``PeftModel.save_pretrained`` writes (safe to replace)."""
    text = readme.read_text(encoding="utf-8", errors="replace")
    return "library_name: peft" in text and all(marker in text for marker in PEFT_PLACEHOLDERS)
