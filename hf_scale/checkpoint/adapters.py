"""Adapter checkpoints in peft's own format, written and read slice-wise in any layout.

A peft adapter folder is ``adapter_config.json`` + ``adapter_model.safetensors``, keys as
``get_peft_model_state_dict`` gives them (``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight``: the adapter's name dropped). ``PeftModel.from_pretrained(base, folder)`` reads
it, and peft (0.21) reads one file only: the adapter is always one safetensors file, into which
every rank writes the bytes of the slices it holds (adapters are small; the base model is never
gathered, nor written: it is unchanged by training).

The mapping between a model's state keys and the file's keys is peft's own: its
``get_peft_model_state_dict`` is run on shape-only stand-ins of the state (:func:`adapter_keys`),
so modules_to_save copies and any tuner follow peft's rules. The base weights of a peft model
are read from the base checkpoint under their names without the adapter wrappers
(``q_proj.base_layer.weight`` -> ``q_proj.weight``, :func:`base_keys`).

Usage::

    hf_scale.save_pretrained(peft_model, "out/adapter")      # every rank, any layout
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from ..errors import HfScaleCheckpointError, HfScaleConfigError
from ..model_plans.adapters import adapter_host, is_modules_to_save
from ..ranks import run_together
from .files import staged_folder
from .safetensors_io import plan_save, reshard_all, write_checksums, write_tensor_files
from .shard_layout import read_header
from .stages import pipelined

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_WRAPPER_PARTS = ("base_layer", "original_module")  # peft's wrappers around a base module


def is_adapter_model(model: nn.Module) -> bool:
    """A peft wrapper with a config for its adapter (``PeftModel``), whose checkpoint is the adapter."""
    return adapter_host(model) is not model and isinstance(getattr(model, "peft_config", None), dict)


def active_adapter(model: nn.Module) -> str:
    adapter = getattr(model, "active_adapter", "default")
    if not isinstance(adapter, str):
        raise HfScaleCheckpointError(
            f"{type(model).__name__} has several active adapters {list(adapter)}: save one at a time "
            "(model.set_adapter(name))."
        )
    return adapter


def adapter_keys(model: nn.Module) -> dict[str, str]:
    """State key of the model inside ``model`` (a ``PeftModel``; :func:`adapter_host`) -> key in
    its adapter file, for the active adapter, as ``get_peft_model_state_dict`` maps them
    (shape-only stand-ins: nothing is gathered)."""
    from peft.utils import get_peft_model_state_dict

    prefix = _host_prefix(model)
    state = model.state_dict(keep_vars=True)
    probes = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    by_id = {id(v): k for k, v in probes.items()}
    picked = get_peft_model_state_dict(model, state_dict=probes, adapter_name=active_adapter(model),
                                       save_embedding_layers=False)
    return {by_id[id(v)].removeprefix(prefix): key for key, v in picked.items()}


def base_keys(model: nn.Module, skip: set[str] = frozenset()) -> dict[str, str]:
    """State key of the model inside ``model`` -> the base checkpoint's key (its name without
    peft's wrappers: ``q_proj.base_layer.weight`` -> ``q_proj.weight``), for every key but the
    adapter layers' own tensors (LoRA factors: not in the base) and ``skip``. A modules_to_save
    copy starts as the base module: it reads the base weight too."""
    host = adapter_host(model)
    own = _adapter_only(host)
    out = {}
    for key in host.state_dict(keep_vars=True):
        if key in skip or key in own:
            continue
        parts, kept, i = key.split("."), [], 0
        while i < len(parts):
            if parts[i] in _WRAPPER_PARTS:
                i += 1
            elif parts[i] == "modules_to_save":
                i += 2  # modules_to_save.<adapter>
            else:
                kept.append(parts[i])
                i += 1
        out[key] = ".".join(kept)
    return out


def _host_prefix(model: nn.Module) -> str:
    host = adapter_host(model)
    name = next(name for name, m in model.named_modules() if m is host)
    return f"{name}." if name else ""


def _adapter_only(host: nn.Module) -> set[str]:
    """State keys of the adapter layers' own tensors (lora_A, lora_B, magnitudes, ...); a
    modules_to_save copy is not one of them (it starts as, and is read from, the base module)."""
    own = set()
    for name, module in host.named_modules():
        if is_modules_to_save(module):
            continue
        for attr in getattr(module, "adapter_layer_names", ()):
            part = getattr(module, attr, None)
            if isinstance(part, nn.Module):
                own.update(f"{name}.{attr}.{k}" for k in part.state_dict(keep_vars=True))
    return own


def save_adapter(model: nn.Module, save_directory: str | os.PathLike, *, tokenizer=None,
                 checksums: bool = True) -> Path:
    """Collective: ``model``'s active adapter as a peft folder (see the module docstring); a
    previous folder is replaced only once the new one is complete."""
    final = Path(save_directory).resolve()
    plan = adapter_save_plan(model)
    with staged_folder(final, needed_bytes=plan.nbytes + 65536) as tmp:
        write_adapter_folder(model, tmp, plan, tokenizer=tokenizer, checksums=checksums)
    return final


def adapter_save_plan(model: nn.Module):
    """The save plan of ``model``'s active adapter: one file, named as peft names it."""
    reshard_all(model)
    keys = adapter_keys(model)  # under pp, a stage may hold none: checked on the whole plan
    state = adapter_host(model).state_dict()
    tensors = {name: state[key] for key, name in keys.items()}
    plan = plan_save(model, 1 << 62, state=tensors)  # one file: what peft reads (identical on all ranks)
    if not any(f.tensors for f in plan.files):
        raise HfScaleCheckpointError(f"{type(model).__name__} holds no adapter weights to save.")
    plan.files[0].name = ADAPTER_WEIGHTS
    return plan


def write_adapter_folder(model: nn.Module, folder: Path, plan=None, *, tokenizer=None, checksums: bool = True) -> None:
    """Collective: fill ``folder`` with the adapter file (every rank its bytes) and config."""
    plan = plan or adapter_save_plan(model)
    digests = write_tensor_files(folder, plan, checksums=checksums)
    run_together(_write_adapter_metadata, model, folder, plan, digests, tokenizer, only_rank0=True)


def _write_adapter_metadata(model: nn.Module, folder: Path, plan, digests: dict, tokenizer) -> None:
    config = model.peft_config[active_adapter(model)]
    base = getattr(getattr(model, "config", None), "name_or_path", None)
    if base and not config.base_model_name_or_path:
        config.base_model_name_or_path = base
    training = config.inference_mode
    config.inference_mode = True  # as peft's own save writes it (loading for training sets it back)
    try:
        config.save_pretrained(folder)
    finally:
        config.inference_mode = training
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    from .quantized import write_quantization_record

    write_quantization_record(model, folder)
    write_checksums(folder, plan.files, digests)


def adapter_weight_map(folder: Path) -> dict[str, Path]:
    """File key -> file of an adapter folder (one safetensors file, as peft writes it)."""
    weights, config = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    if not config.is_file() or not weights.is_file():
        missing = [p.name for p in (config, weights) if not p.is_file()]
        hint = " (it holds adapter_model.bin: pickles are not read; re-save it with safetensors)" if (
            folder / "adapter_model.bin").exists() else ""
        raise HfScaleCheckpointError(f"{folder} is not a peft adapter folder: {missing} missing{hint}.")
    return {key: weights for key in read_header(weights)[1] if key != "__metadata__"}


def check_adapter_config(model: nn.Module, folder: Path) -> None:
    """The folder's adapter was made with the model's LoRA settings (type, rank, scaling: alpha
    and rsLoRA, DoRA): a mismatch is one clear error, not an adapter silently scaled otherwise
    (the targets are checked by key, shapes as the slices are read)."""
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    mine = model.peft_config[active_adapter(model)]
    for field in ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora"):
        want = getattr(mine, field, None)
        want = getattr(want, "value", want)
        if field in saved and saved[field] != want:
            raise HfScaleCheckpointError(
                f"the adapter in {folder} has {field}={saved[field]!r}, the model's adapter {field}={want!r}: "
                f"load it into a model made with its own config (hf_scale.from_pretrained(base, adapter="
                f"{str(folder)!r}) reads it from {ADAPTER_CONFIG})."
            )


def check_adapter_keys(keys: dict[str, str], weight_map: dict[str, Path], folder: Path, whole: bool = True) -> None:
    """Every adapter tensor of the model is in the file and (``whole``: this rank holds the
    whole model, not one pipeline stage) the file holds nothing else."""
    missing = sorted(set(keys.values()) - set(weight_map))
    extra = sorted(set(weight_map) - set(keys.values())) if whole else []
    if missing or extra:
        raise HfScaleCheckpointError(
            f"the adapter in {folder} does not fit this model: it lacks {missing[:4]} and holds "
            f"{extra[:4]} the model has no place for. It was trained on another base model or with other "
            "target_modules."
        )


def attach_adapter(model: nn.Module, adapter, *, seed: int = 0) -> tuple[nn.Module, Path | None]:
    """Wrap ``model`` (built on the meta device) in a ``PeftModel`` for ``adapter``: a peft
    adapter folder (returned, to be read after parallelize) or a ``LoraConfig`` / its fields as a
    mapping (a new adapter, initialised now, on the CPU, identically on every rank from
    ``seed``, as peft initialises it: its factors are small, and the base stays on meta)."""
    from peft import LoraConfig, PeftConfig, get_peft_model

    folder = None
    if isinstance(adapter, (str, os.PathLike)):
        folder = Path(adapter)
        adapter_weight_map(folder)  # a clear error for a folder that is not an adapter
        config = PeftConfig.from_pretrained(str(folder))
        config.inference_mode = False  # trained further, or merged: its factors are parameters
    elif isinstance(adapter, PeftConfig):
        config = adapter
    else:
        config = LoraConfig(**dict(adapter))
    if folder is None:
        _check_new_on_meta(config)
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft's message names the targets; say what the model has
        raise HfScaleConfigError(
            f"peft could not attach the adapter to {type(model).__name__}: {' '.join(str(e).split())[:400]} "
            f"Its Linear layers are named {_linear_names(model)}; set target_modules to some of them "
            "(or 'all-linear')."
        ) from None
    if folder is None:
        _init_new_adapter(peft_model, seed)
    return peft_model, folder


def _linear_names(model: nn.Module) -> list[str]:
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def _check_new_on_meta(config) -> None:
    """A new adapter is initialised while the base is still on the meta device (it is read after
    the layout is applied): initialisations that read the base weights cannot run there."""
    init = getattr(config, "init_lora_weights", True)
    if getattr(config, "use_dora", False) or isinstance(init, str) or type(config).__name__ != "LoraConfig":
        what = ("DoRA (its magnitudes are the base weights' norms)" if getattr(config, "use_dora", False)
                else f"init_lora_weights={init!r}" if isinstance(init, str) else type(config).__name__)
        raise HfScaleConfigError(
            f"a new adapter with {what} is computed from the base weights, which from_pretrained reads "
            "only after the layout is applied. Build it on the loaded model with peft "
            "(get_peft_model(AutoModelForCausalLM.from_pretrained(...), config)) and call hf_scale.parallelize, "
            "or start from a saved adapter folder."
        )


@torch.no_grad()
def _init_new_adapter(model: nn.Module, seed: int) -> None:
    """Give the adapter layers' own parameters (left on meta beside the meta base) real CPU
    storage and peft's initial values, the same on every rank from ``seed``: nn.Linear's own
    init (peft's ``init_lora_weights=False``), then peft's ``reset_lora_parameters``. A
    modules_to_save copy is left on meta: it is read from the base checkpoint like the original."""
    adapter = active_adapter(model)
    config = model.peft_config[adapter]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in adapter_host(model).modules():
            if is_modules_to_save(module):
                continue
            parts = [getattr(module, attr, None) for attr in getattr(module, "adapter_layer_names", ())]
            parts = [p for p in parts if isinstance(p, (nn.ModuleDict, nn.ParameterDict)) and adapter in p]
            if not parts:
                continue
            for part in parts:
                if isinstance(part, nn.ParameterDict):
                    old = part[adapter]
                    part[adapter] = nn.Parameter(torch.empty_like(old, device="cpu"), requires_grad=old.requires_grad)
                else:
                    part[adapter].to_empty(device="cpu")
                    if hasattr(part[adapter], "reset_parameters"):
                        part[adapter].reset_parameters()  # what peft's init_lora_weights=False keeps
            reset = getattr(module, "reset_lora_parameters", None)
            if reset is None:
                raise HfScaleConfigError(
                    f"{type(module).__name__}: hf_scale initialises new LoRA adapters on a model loaded "
                    "slice-wise; for another peft method, build it with peft and call hf_scale.parallelize."
                )
            reset(adapter, config.init_lora_weights)


def _base_ties(model: nn.Module) -> dict[str, str]:
    """Tied weights of the model inside ``model``, by their base checkpoint names."""
    from ..model_plans import find_tied_parameters

    host = adapter_host(model)
    strip = base_keys(model)
    return {strip.get(t, t): strip.get(s, s) for t, s in find_tied_parameters(host)}


def adapter_load_names(model: nn.Module, base_map: dict[str, Path], adapter_map: dict[str, Path] | None) -> dict[str, str]:
    """What a slice-wise load of a peft model reads: state key (of the model inside) -> name in
    the base checkpoint (transformers' renames applied where its files use them) or, with
    ``adapter_map``, in the adapter file."""
    from .safetensors_io import checkpoint_names

    keys = adapter_keys(model) if adapter_map is not None else {}
    names = base_keys(model, skip=set(keys))
    ties = _base_ties(model)  # a modules_to_save copy of a tied head reads the embedding
    names = {k: ties[n] if n not in base_map and ties.get(n) in base_map else n for k, n in names.items()}
    if any(name not in base_map for name in names.values()):
        host = adapter_host(model)
        state = host.state_dict(keep_vars=True)
        renamed = checkpoint_names(host, {names[k]: state[k] for k in names})
        names = {k: renamed[n] for k, n in names.items()}
    if adapter_map is not None:
        check_adapter_keys(keys, adapter_map, Path(next(iter(adapter_map.values()), ".")).parent,
                    whole=not pipelined(model))
    return {**names, **keys}
