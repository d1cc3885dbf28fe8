"""Slice-wise load of a Hub-format safetensors folder into a parallel layout.

The model is built with its parameters on the meta device (buffers real, so computed buffers
such as rotary frequencies keep their values), parallelized, then each rank allocates and
reads only the byte ranges of the parameter slices it owns, straight into their memory: peak
memory stays near one rank's shard instead of the whole model.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..api import get_state, parallelize
from ..config import ParallelConfig, as_parallel_config
from ..errors import HfScaleCheckpointError
from .layout import DTYPES_BY_NAME, INDEX_FILE, SINGLE_FILE, contiguous_runs
from .safetensors_io import (
    CHECKSUMS_FILE,
    checkpoint_names,
    read_checksums,
    reshard_all,
    sha256_file,
)

HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.sha256"]


def from_pretrained(
    name_or_path: str | os.PathLike,
    parallel: ParallelConfig | Mapping[str, Any] | None = None,
    *,
    auto_class=None,
    dtype: torch.dtype = torch.float32,
    plan=None,
    verify_checksums: bool = True,
    revision: str | None = None,
) -> nn.Module:
    """Load a pretrained model straight into a parallel layout; call it on every rank.

    ``name_or_path`` is a local folder or a Hub repo id (downloaded through huggingface_hub's
    cache, safetensors only). ``auto_class`` defaults to the class named in the config's
    ``architectures``. Shards listed in ``checksums.sha256`` are verified first (each rank
    hashes its share of the files).

    Usage::

        model = hf_scale.from_pretrained("out/", parallel={"strategy": "fsdp"})
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    folder = _resolve(name_or_path, revision)
    config = AutoConfig.from_pretrained(folder)
    cls = auto_class or _model_class(config)
    with init_empty_weights(include_buffers=False):
        build = getattr(cls, "_from_config", None) or cls.from_config  # model class / Auto class
        model = build(config, dtype=dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # meta construction gives tied modules separate parameters
    weight_map = weight_map_of(folder)
    parallel = as_parallel_config(parallel)
    sharded = parallel.sharded
    if sharded:
        model = parallelize(model, parallel, plan=plan)
        device = get_state(model).env.device
    else:
        device = _device()
    if verify_checksums:
        _verify_checksums(folder, weight_map)
    _materialize(model, device)
    load_owned_slices(model, folder, weight_map)
    if not sharded:
        model = parallelize(model, parallel, plan=plan)
    return model


def _resolve(name_or_path, revision) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/")):
        raise HfScaleCheckpointError(f"{str(name_or_path)!r} is not a checkpoint folder.")
    from huggingface_hub import snapshot_download

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:  # one download; the other ranks read the shared cache
        snapshot_download(str(name_or_path), revision=revision, allow_patterns=HUB_PATTERNS)
    if dist.is_initialized():
        dist.barrier()
    return Path(snapshot_download(str(name_or_path), revision=revision, allow_patterns=HUB_PATTERNS))


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModel


def _device() -> torch.device:
    from ..distributed import read_env

    return read_env().device


def weight_map_of(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file, with every file checked to lie inside ``folder``."""
    if (folder / INDEX_FILE).exists():
        names = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    elif (folder / SINGLE_FILE).exists():
        names = {k: SINGLE_FILE for k in _read_header(folder / SINGLE_FILE)[1]}
    else:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" It holds pickle weights ({', '.join(pickles)}): convert them with "
                "hf_scale.checkpoint.convert_pickle_checkpoint, which loads with weights_only=True."
                if pickles else "")
        raise HfScaleCheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}.{hint}")
    # Checked on the path as written, not resolved: the huggingface_hub cache makes every file
    # of a snapshot a symlink into the repo's blobs/ folder.
    root = Path(os.path.abspath(folder))
    out = {}
    for tensor, file in names.items():
        path = Path(os.path.abspath(folder / file))
        if root not in path.parents:
            raise HfScaleCheckpointError(
                f"{INDEX_FILE} maps {tensor!r} to {file!r}, outside the checkpoint folder {folder}."
            )
        if not path.is_file():
            raise HfScaleCheckpointError(f"shard {file!r} (holding {tensor!r}) is missing from {folder}.")
        out[tensor] = path
    return out


def _verify_checksums(folder: Path, weight_map: dict[str, Path]) -> None:
    expected = read_checksums(folder)
    if not expected:
        return
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    files = sorted({p.name for p in weight_map.values()})
    bad = [f for i, f in enumerate(files) if i % world == rank and f in expected and sha256_file(folder / f) != expected[f]]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, bad)
        bad = sorted(f for part in gathered for f in part)
    if bad:
        raise HfScaleCheckpointError(
            f"shard(s) {bad} in {folder} do not match {CHECKSUMS_FILE}: the files are corrupt or "
            "truncated. Re-copy or re-save the checkpoint."
        )


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters on ``device``; keep the real buffers' values and the ties
    (``to_empty`` gives every module its own new parameter)."""
    from ..plans import find_tied_parameters

    ties = find_tied_parameters(model)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    for target, source in ties:
        owner, _, attr = target.rpartition(".")
        module = model.get_submodule(owner)
        if getattr(module, attr) is not model.get_parameter(source):
            setattr(module, attr, model.get_parameter(source))


@torch.no_grad()
def load_owned_slices(model: nn.Module, folder: Path, weight_map: dict[str, Path]) -> None:
    """Read each parameter's local block straight from the files into its memory.

    Plain ``pread`` at the offsets the safetensors header gives (an FSDP shard is one
    contiguous byte range): no memory map, so the pages read never count against this rank's
    memory, and no intermediate copy when dtypes match.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    reshard_all(model)
    state = model.state_dict(keep_vars=True)
    names = checkpoint_names(model, {k: v for k, v in state.items()})
    headers: dict[Path, tuple[int, dict]] = {}
    for key, target in state.items():
        name = names[key]
        if name not in weight_map:
            if _is_tied_copy(model, key):
                continue
            raise HfScaleCheckpointError(f"{folder} has no tensor {name!r}, which {type(model).__name__} needs.")
        path = weight_map[name]
        if path not in headers:
            headers[path] = _read_header(path)
        data_start, entries = headers[path]
        entry = entries[name]
        if tuple(entry["shape"]) != tuple(target.shape):
            raise HfScaleCheckpointError(
                f"{name!r} in {path.name} has shape {entry['shape']}, the model expects "
                f"{list(target.shape)}: the checkpoint is for another configuration."
            )
        if isinstance(target, DTensor):
            local = target.to_local()
            _, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        else:
            local, offset = target.data, (0,) * target.dim()
        dtype = DTYPES_BY_NAME[entry["dtype"]]
        if dtype.is_floating_point != target.dtype.is_floating_point:
            raise HfScaleCheckpointError(
                f"{name!r} in {path.name} is {entry['dtype']}, the model's is {target.dtype}: "
                "float and integer tensors do not convert; the checkpoint is for another model."
            )
        if local.numel():
            _read_block(path, data_start + entry["data_offsets"][0], dtype, tuple(target.shape), local, offset)


def _read_header(path: Path) -> tuple[int, dict]:
    """(byte offset where the data starts, header entries) of a safetensors file, checked
    against the file's size so a truncated shard is an error, not garbage."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        try:
            entries = json.loads(fh.read(length)) if 0 < length <= size - 8 else None
        except ValueError:
            entries = None
    if not entries:
        raise HfScaleCheckpointError(f"cannot read shard {path.name}: not a safetensors file (or truncated).")
    entries.pop("__metadata__", None)
    needed = 8 + length + max((e["data_offsets"][1] for e in entries.values()), default=0)
    if size < needed:
        raise HfScaleCheckpointError(
            f"cannot read shard {path.name}: truncated ({size} bytes, its header needs {needed})."
        )
    return 8 + length, entries


def _read_block(path: Path, start: int, dtype: torch.dtype, global_shape, local: torch.Tensor, offset) -> None:
    direct = local.dtype == dtype and local.device.type == "cpu" and local.is_contiguous()
    buffer = local if direct else torch.empty(local.shape, dtype=dtype)
    raw = buffer.view(-1).view(torch.uint8).numpy()
    size = dtype.itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        for g_start, l_start, length in contiguous_runs(tuple(local.shape), offset, global_shape):
            view = memoryview(raw[l_start * size : (l_start + length) * size])
            done = 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], start + g_start * size + done)
                if got <= 0:
                    raise HfScaleCheckpointError(f"cannot read shard {path.name}: unexpected end of file.")
                done += got
    finally:
        os.close(fd)
    if not direct:
        local.copy_(buffer)


def _is_tied_copy(model: nn.Module, key: str) -> bool:
    from ..plans import find_tied_parameters

    return any(target == key for target, _ in find_tied_parameters(model))
