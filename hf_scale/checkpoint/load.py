"""Slice-wise load of a Hub-format safetensors folder into a parallel layout.

The model is built with its parameters on the meta device (buffers real, so computed buffers
such as rotary frequencies keep their values), parallelized, then each rank takes only the byte
ranges of the parameter slices it owns: on the CPU as copy-on-write views of the mapped files
(nothing read until used, as transformers' own load does), otherwise read with ``pread``. Peak
memory stays near one rank's shard instead of the whole model.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..api import get_state, parallelize, resolve_parallel_config
from ..config import ParallelConfig
from ..errors import HfScaleCheckpointError
from ..ranks import rank0_first, run_together, share_from_rank0
from .boxes import Box, local_boxes
from .files import CHECKSUMS_FILE, mismatched, read_checksums
from .pieces import Piece, piece_boxes
from .safetensors_io import checkpoint_layout, reshard_all
from .shard_layout import DTYPES_BY_NAME, INDEX_FILE, SINGLE_FILE, contiguous_runs, read_header
from .stages import tie_aliases

HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.sha256"]


def from_pretrained(
    name_or_path: str | os.PathLike,
    parallel: ParallelConfig | Mapping[str, Any] | str | None = None,
    *,
    auto_class=None,
    dtype: torch.dtype = torch.float32,
    plan=None,
    verify_checksums: bool = False,
    revision: str | None = None,
    adapter=None,
    adapter_seed: int = 0,
    quantize: str | None = None,
) -> nn.Module:
    """Load a pretrained model straight into a parallel layout; call it on every rank.

    ``name_or_path`` is a local folder or a Hub repo id (downloaded through huggingface_hub's
    cache, safetensors only). ``auto_class`` defaults to the class named in the config's
    ``architectures``.

    Each rank takes only its slices of the files. On the CPU they stay mapped copy-on-write
    from the files, as in transformers' own load: pages are read when first used, writes
    (training) never reach the files. Do not overwrite the loaded files in place while the model
    lives (``hf_scale.save_pretrained`` into the same folder is safe: it writes a new folder
    and swaps it in).

    Every shard's size is checked against its header (a truncated or partly copied file is an
    error). ``verify_checksums=True`` also hashes every shard against ``checksums.sha256``
    (each rank its share of the files) before loading: a full read of the checkpoint, off by
    default as in transformers. A check that fails on one rank (a shard only its pipeline stage
    reads, a bad copy on its node) fails on every rank, before any rank returns.

    ``adapter`` trains or uses a peft LoRA adapter on the base: a peft adapter folder (read
    slice-wise like the base) or a ``LoraConfig`` / its fields as a dict (a new adapter,
    initialised as peft does, the same on every rank, from ``adapter_seed``). The result is a ``PeftModel`` in the
    layout; its base weights keep ``dtype``, its adapters fp32 (peft's default).

    ``quantize="nf4"`` (QLoRA, with ``adapter``): the base Linear weights LoRA targets are held
    in torchao's NF4 (4.13 bits a parameter); each rank quantizes only the slice it holds, as the
    whole tensor would be (:mod:`hf_scale.checkpoint.quantized`). Under fsdp, zero2, hsdp, ddp.

    Usage::

        model = hf_scale.from_pretrained("out/", parallel={"strategy": "fsdp"})
        model = hf_scale.from_pretrained(base, {"strategy": "fsdp", "tp": 2},
                                         adapter={"r": 16, "target_modules": "all-linear"})
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    folder = _resolve(name_or_path, revision)
    config = AutoConfig.from_pretrained(folder)
    cls = auto_class or _model_class(config)
    # No weight init: on meta parameters it does nothing, slowly (a second for SmolLM2)
    with init_empty_weights(include_buffers=False), no_init_weights():
        build = getattr(cls, "_from_config", None) or cls.from_config  # model class / Auto class
        model = build(config, dtype=dtype)
    _init_computed_buffers(model)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # meta construction gives tied modules separate parameters
    adapter_folder = None
    if adapter is not None:
        from .adapters import attach_adapter

        model, adapter_folder = attach_adapter(model, adapter, seed=adapter_seed)
    parallel = resolve_parallel_config(model, parallel, quantize)  # "auto": the planner's choice (on meta)
    if quantize is not None:
        from ..distributed import init_distributed
        from ..model_plans.quantize import check_quantize
        from .quantized import place_nf4, shard_parts

        check_quantize(quantize, parallel, adapter)
        place_nf4(model, shard_parts(parallel, init_distributed().world_size), parallel.tp, plan)
    # parameters split (or pipeline stages pruned): parallelize on meta, read this rank's slices
    sharded = parallel.sharded or parallel.tp > 1 or parallel.pp > 1
    if sharded:
        model = parallelize(model, parallel, plan=plan)
        device = torch.device("cpu") if parallel.cpu_offload else get_state(model).env.device
    else:
        device = _device(parallel)
    _load_weights(model, folder, device, verify_checksums, adapter_folder if adapter is not None else False)
    if sharded and get_state(model).dims is None and device.type != "cpu":
        model.to(device)  # one process on a GPU: FSDP never moved it; buffers are still on the CPU
    elif sharded and adapter_folder is None and adapter is not None and device.type != "cpu":
        _move_plain_parameters(model, device)  # a new adapter's factors tp left whole, on the CPU
    if not sharded:
        model = parallelize(model, parallel, plan=plan)
    return model


@torch.no_grad()
def _move_plain_parameters(model: nn.Module, device: torch.device) -> None:
    """Parameters that are neither DTensors nor on ``device`` (initialised on the CPU before the
    layout was applied, and not sharded by it) moved to ``device``."""
    for param in model.parameters():
        if not isinstance(param, DTensor) and param.device != device:
            param.data = param.data.to(device)


def _init_computed_buffers(model: nn.Module) -> None:
    """Run the model's own init on the modules that hold computed buffers and no parameters
    (rotary frequencies, position ids): their values come from the config, not the checkpoint."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if init and module._non_persistent_buffers_set and not any(True for _ in module.parameters(recurse=False)):
            with torch.no_grad():
                init(module)


def _resolve(name_or_path, revision) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_path).startswith((".", "/")):
        raise HfScaleCheckpointError(f"{str(name_or_path)!r} is not a checkpoint folder.")
    from huggingface_hub import snapshot_download

    with rank0_first():  # one download; the other ranks read the shared cache
        return Path(snapshot_download(str(name_or_path), revision=revision, allow_patterns=HUB_PATTERNS))


def _model_class(config):
    import transformers

    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModel


def _device(parallel: ParallelConfig) -> torch.device:
    """This rank's device for a model parallelized after loading (ddp, one process). The process
    group starts here, as parallelize would start it, so that the load's checks are collective."""
    from ..distributed import init_distributed

    return init_distributed(parallel.timeout_seconds).device


def _load_weights(model: nn.Module, folder: Path, device: torch.device, verify_checksums: bool,
                  adapter_folder: Path | None | bool = False) -> None:
    """Collective: this rank's blocks of ``folder`` into ``model``, every check of the files
    included. Ranks read different files (pipeline stages) or copies (a disk per node), so a
    failure on any rank is raised on every rank (:func:`hf_scale.ranks.run_together`: one small
    all-gather) before any rank goes on to a collective it would wait in for ever. A peft model
    (``adapter_folder`` not False) reads its base from ``folder`` and its adapter from
    ``adapter_folder`` (None: a new adapter, already initialised)."""
    if verify_checksums:  # hashing is collective (each rank its share): every rank must reach it
        _verify_checksums(folder, run_together(weight_map_of, folder))
    if adapter_folder is False:
        run_together(lambda: assign_from_files(model, folder, weight_map_of(folder), device))
        return

    def read() -> None:
        from ..model_plans.adapters import adapter_host
        from .adapters import adapter_load_names, adapter_weight_map, check_adapter_config

        base_map = weight_map_of(folder)
        adapter_map = None
        if adapter_folder is not None:
            check_adapter_config(model, adapter_folder)
            adapter_map = adapter_weight_map(adapter_folder)
        names = adapter_load_names(model, base_map, adapter_map)
        return assign_from_files(adapter_host(model), folder, {**base_map, **(adapter_map or {})}, device, names)

    pending = run_together(read)
    if pending:  # NF4 weights: each rank quantizes its blocks, with each weight's mean agreed
        from ..host_memory import trim_heap
        from ..model_plans.adapters import adapter_host
        from .quantized import quantize_loaded

        quantize_loaded(adapter_host(model), pending)
        trim_heap()  # the slices and codes it made and freed stay resident otherwise (hf_scale.host_memory)


def weight_map_of(folder: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file, with every file checked to lie inside ``folder``."""
    if (folder / INDEX_FILE).exists():
        names = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    elif (folder / SINGLE_FILE).exists():
        names = {k: SINGLE_FILE for k in read_header(folder / SINGLE_FILE)[1]}
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
    """Collective: every shard hashed (each rank its share), the same verdict on every rank. The
    expected sums are rank 0's (a node whose copy lacks the file still hashes its share)."""
    expected = share_from_rank0(read_checksums, folder)
    if not expected:
        return
    bad = mismatched(folder, sorted({p.name for p in weight_map.values()}), expected)  # hashed in parallel
    if bad:
        raise HfScaleCheckpointError(
            f"shard(s) {bad} in {folder} do not match {CHECKSUMS_FILE}: the files are corrupt or "
            "truncated. Re-copy or re-save the checkpoint."
        )


@torch.no_grad()
def assign_from_files(model: nn.Module, folder: Path, weight_map: dict[str, Path], device: torch.device,
                      names: dict[str, str] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Give each meta parameter (sharded or not) its local block of the files, as transformers does.

    On the CPU an FSDP shard in the checkpoint's dtype is one contiguous byte range: it becomes a
    private (copy-on-write) memory map of those bytes of its file, so nothing is read or copied
    now, and pages count in RSS only once used. Any other block (another dtype, a device, a
    tensor-parallel slice, an unaligned offset) is read with ``pread`` into new memory. The new
    tensors are put in place with ``load_state_dict(assign=True)``, whose FSDP hook takes them as
    the sharded storage. Real buffers keep their values; tied parameters are tied again. Not
    collective: from_pretrained calls it through :func:`hf_scale.ranks.run_together`.
    ``names`` (state key -> checkpoint name) restricts and renames what is read (an adapter
    model: base weights from the base's files, adapters from the adapter's file). Returns the
    NF4 placeholders' blocks, read in the compute dtype and encoded at once (their 4-bit codes
    and block absmax: :func:`hf_scale.quantize.nf4.encode_rows`, so that a rank never holds more
    than one block in the compute dtype), set aside for
    :func:`hf_scale.checkpoint.quantized.quantize_loaded` (state key -> (encoded, placeholder)).
    """
    from ..model_plans import find_tied_parameters
    from ..quantize.nf4 import encode_rows, is_nf4

    ties = find_tied_parameters(model)
    new, pending = {}, {}
    blocks = list(_blocks(model, folder, weight_map, names))
    maps_left = map_budget(len(blocks))
    for key, target, reads, local_shape in blocks:
        if not target.is_meta:  # a real buffer saved with the model: read into it
            local = target.to_local() if isinstance(target, DTensor) else target.data
            if local.numel():
                for path, start, dtype, shape, boxes in reads:
                    _read_block(path, start, dtype, shape, local, boxes)
            continue
        local = None
        if maps_left > 0 and len(reads) == 1 and len(reads[0][4]) == 1:
            path, start, dtype, shape, boxes = reads[0]
            local = _mapped_block(path, start, dtype, shape, local_shape, boxes[0].offset, target.dtype, device)
            maps_left -= local is not None
        if local is None:
            local = torch.empty(local_shape, dtype=target.dtype)
            if local.numel():
                for path, start, dtype, shape, boxes in reads:
                    _read_block(path, start, dtype, shape, local, boxes)
            local = local.to(device)
        if is_nf4(target):  # its codes now, the slice freed: the scalers wait for the agreed mean
            pending[key] = (encode_rows(local), target)
            del local
            continue
        if isinstance(target, DTensor):
            local = DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                       shape=target.shape, stride=target.stride())
        new[key] = local
    model.load_state_dict(new, strict=False, assign=True)
    for target, source in ties:
        owner, _, attr = target.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(source))
    left = [name for name, p in model.named_parameters(remove_duplicate=False)
            if p.is_meta and name not in pending]
    if left:
        raise HfScaleCheckpointError(f"{folder} left {left[:5]} of {type(model).__name__} unset (on the meta device).")
    return pending


def map_budget(wanted: int) -> int:
    """How many blocks may be memory-mapped: each map keeps a file descriptor open (Python's
    mmap duplicates it) for the parameter's lifetime. The soft open-file limit is raised toward
    the hard one when that is needed (often 1024 -> 524288); past half of it, blocks are read."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * wanted + 256:
        target = 2 * wanted + 256 if hard == resource.RLIM_INFINITY else min(hard, 2 * wanted + 256)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
            soft = max(soft, target)
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else min(wanted, soft // 2)


def _mapped_block(path: Path, start: int, dtype, global_shape, local_shape, offset, want, device):
    """The block as a tensor over a copy-on-write map of its own bytes of ``path`` (not of the
    whole file: pages of other ranks' slices never enter this rank's memory), or None where it
    cannot be one."""
    runs = list(contiguous_runs(tuple(local_shape), offset, global_shape))
    if device.type != "cpu" or dtype != want or len(runs) != 1 or not runs[0][2]:
        return None
    first, nbytes = start + runs[0][0] * dtype.itemsize, runs[0][2] * dtype.itemsize
    if first % dtype.itemsize:
        return None
    page = first - first % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as fh:  # MAP_PRIVATE: writes to the parameters never reach the file
        mapped = mmap.mmap(fh.fileno(), first + nbytes - page, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=page)
    return torch.frombuffer(mapped, dtype=dtype, count=runs[0][2], offset=first - page).view(local_shape)


@torch.no_grad()
def load_owned_slices(model: nn.Module, folder: Path, weight_map: dict[str, Path],
                      names: dict[str, str] | None = None) -> None:
    """Read each parameter's local block straight from the files into its existing memory
    (resuming a model that trains: the optimizer holds its parameters). Not collective: call it
    through :func:`hf_scale.ranks.run_together`, so that a failure on one rank fails them all.

    Plain ``pread`` at the offsets the safetensors header gives (an FSDP shard is one
    contiguous byte range), with no intermediate copy when dtypes match.
    """
    reshard_all(model)
    for _key, target, reads, _shape in _blocks(model, folder, weight_map, names):
        local = target.to_local() if isinstance(target, DTensor) else target.data
        if local.numel():
            for path, start, dtype, shape, boxes in reads:
                _read_block(path, start, dtype, shape, local, boxes)


def _blocks(model: nn.Module, folder: Path, weight_map: dict[str, Path], names: dict[str, str] | None = None):
    """``(state key, tensor, reads, local shape)`` of every tensor to load (those ``names``
    lists, when given), checked against the checkpoint's header; each read is ``(file, byte
    offset of its data, file dtype, its shape in the file, boxes of the local block)``. A packed
    tensor-parallel slice (fused q;k;v) is several boxes; a fused weight that the checkpoint
    holds in slices (transformers 5's experts: one tensor per expert) is several reads."""
    from ..model_plans import find_tied_parameters

    state = model.state_dict(keep_vars=True)
    tied = {target for target, _ in find_tied_parameters(model)}
    aliases = tie_aliases(model)  # under pp, a head on another rank than its embedding: read the source
    if names is not None:
        state = {key: state[key] for key in names if key in state}
        layout = {key: [Piece(names[key], tuple((0, n, True) for n in state[key].shape))] for key in state}
    elif all(key in weight_map or key in tied or key in aliases for key in state):
        layout = {key: [Piece(key, tuple((0, n, True) for n in t.shape))] for key, t in state.items()}
    else:  # transformers' renames and slices between module and checkpoint names (a second, slow)
        layout = checkpoint_layout(model, dict(state))
    headers: dict[Path, tuple[int, dict]] = {}
    for key, target in state.items():
        if isinstance(target, DTensor):
            boxes = local_boxes(target)
            shape = _local_shape(target, boxes)
        else:
            shape = tuple(target.shape)
            boxes = [Box(tuple(slice(0, n) for n in shape), (0,) * target.dim(), shape)]
        reads = []
        for piece in layout[key]:
            name = piece.name
            if name not in weight_map and key not in tied and aliases.get(key) in weight_map:
                name = aliases[key]  # a tie target held apart from its source (pipeline stages)
            if name not in weight_map:
                if key in tied:
                    break
                raise HfScaleCheckpointError(f"{folder} has no tensor {name!r}, which {type(model).__name__} needs.")
            path = weight_map[name]
            if path not in headers:
                headers[path] = read_header(path)
            data_start, entries = headers[path]
            entry = entries[name]
            if tuple(entry["shape"]) != piece.shape:
                raise HfScaleCheckpointError(
                    f"{name!r} in {path.name} has shape {entry['shape']}, the model expects "
                    f"{list(piece.shape)}: the checkpoint is for another configuration."
                )
            dtype = DTYPES_BY_NAME[entry["dtype"]]
            if dtype.is_floating_point != target.dtype.is_floating_point:
                raise HfScaleCheckpointError(
                    f"{name!r} in {path.name} is {entry['dtype']}, the model's is {target.dtype}: "
                    "float and integer tensors do not convert; the checkpoint is for another model."
                )
            whole = len(layout[key]) == 1 and piece.whole(target.shape)
            reads.append((path, data_start + entry["data_offsets"][0], dtype, piece.shape,
                          boxes if whole else piece_boxes(boxes, piece)))
        else:
            yield key, target, reads, shape


def _local_shape(target: DTensor, boxes: list[Box]) -> tuple[int, ...]:
    """The local tensor's shape, from its boxes (each dim ends where its last box ends)."""
    if not boxes:  # this rank holds nothing (an uneven shard past the end)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        return tuple(compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)[0])
    return tuple(max(b.local[d].stop for b in boxes) for d in range(target.dim()))


def _read_block(path: Path, start: int, dtype: torch.dtype, global_shape, local: torch.Tensor, boxes) -> None:
    """Read every box of ``local``'s block from the file into it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for box in boxes:
            part = local[box.local]
            direct = part.dtype == dtype and part.device.type == "cpu" and part.is_contiguous()
            buffer = part if direct else torch.empty(box.shape, dtype=dtype)
            _read_box(fd, path, start, dtype, global_shape, buffer, box)
            if not direct:
                part.copy_(buffer)
    finally:
        os.close(fd)


def _read_box(fd: int, path: Path, start: int, dtype: torch.dtype, global_shape, buffer: torch.Tensor, box) -> None:
    raw = buffer.view(-1).view(torch.uint8).numpy()
    size = dtype.itemsize
    for g_start, l_start, length in contiguous_runs(box.shape, box.offset, global_shape):
        view = memoryview(raw[l_start * size : (l_start + length) * size])
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], start + g_start * size + done)
            if got <= 0:
                raise HfScaleCheckpointError(f"cannot read shard {path.name}: unexpected end of file.")
            done += got


def load_adapter(model: nn.Module, folder: str | os.PathLike) -> None:
    """Collective: read the adapter in ``folder`` into ``model``'s adapter (a ``PeftModel``,
    parallelized or not) in place, each rank its own slices; a failure raises on every rank."""
    from ..model_plans.adapters import adapter_host
    from .adapters import adapter_keys, adapter_weight_map, check_adapter_config, check_adapter_keys
    from .stages import pipelined

    folder = Path(folder)

    def read() -> None:
        weight_map = adapter_weight_map(folder)
        check_adapter_config(model, folder)
        keys = adapter_keys(model)
        check_adapter_keys(keys, weight_map, folder, whole=not pipelined(model))
        load_owned_slices(adapter_host(model), folder, weight_map, keys)

    run_together(read)
