"""Parallel save of a (parallelized) model as a Hub-format safetensors folder.

Every rank writes the bytes it holds straight into their place in the shard files: an FSDP
shard of a parameter is a contiguous byte range of that parameter in the file (a
tensor-parallel slice, a few ranges), so no rank gathers a parameter, let alone the model.
Replicas (HSDP replica groups, DDP ranks) write nothing twice: only replica coordinate 0
writes a sharded parameter, and each replicated tensor has one owner rank, chosen to balance
bytes. The folder is written under a temporary name and renamed into place once every rank
has finished, so a crash mid-save leaves any previous folder intact.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import HfScaleCheckpointError
from ..model_plans import find_tied_parameters
from ..ranks import rank_world, run_together
from .boxes import Box, local_boxes
from .files import CHECKSUMS_FILE, share_digests, staged_folder
from .pieces import Piece, checkpoint_pieces, piece_boxes
from .shard_layout import INDEX_FILE, ShardFile, TensorSpec, contiguous_runs, index_json, plan_files
from .stages import global_specs, owners, pipelined, tie_aliases


def save_model(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_size: int | str = "auto",
    checksums: bool = True,
) -> Path:
    """Save ``model`` (parallelized or not) as transformers does, writing from every rank.

    Call it on every rank. The folder holds ``model.safetensors`` or
    ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``, ``config.json``,
    ``generation_config.json`` (for generative models), the tokenizer when given, and
    ``checksums.sha256`` (sha256 of every shard, ``sha256sum -c`` format; each rank hashes its
    share of the files after writing; ``checksums=False`` skips that read-back).
    ``max_shard_size="auto"`` (the default) makes as many files as ranks, of 100 MB to 5 GB
    each, so the ranks hash in parallel; give a size (``"5GB"``, bytes) for transformers'
    packing. Tied weights are written once, under the name transformers keeps; names follow the
    checkpoint format transformers expects (e.g. GPT-NeoX's ``embed_out``). Loads with
    ``AutoModel*.from_pretrained``.

    The free space is checked first; a save that does not fit (or fails) raises
    :class:`HfScaleCheckpointError`, removes what it wrote and leaves a previous folder as it was.

    Usage::

        hf_scale.save_pretrained(model, "out/", tokenizer=tokenizer, max_shard_size="2GB")
    """
    plan = plan_save(model, max_shard_size)
    final = Path(save_directory).resolve()
    with staged_folder(final, needed_bytes=plan.nbytes) as tmp:
        write_model_folder(model, tmp, plan, tokenizer=tokenizer, checksums=checksums)
    return final


@dataclass
class SavePlan:
    """What a save writes: the checkpoint's tensors, its files, and the owner of each
    replicated tensor (identical on every rank)."""

    state: dict[str, torch.Tensor]
    files: list[ShardFile]
    owners: dict[str, int]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


def plan_save(model: nn.Module, max_shard_size: int | str = "auto",
              state: dict[str, torch.Tensor] | None = None) -> SavePlan:
    """What to write, identical on every rank. Under pipeline parallel each rank holds only its
    stages' tensors: their names, shapes and dtypes are all-gathered (one collective), and each
    whole tensor is owned by one of the ranks holding it. ``state`` (checkpoint key -> tensor)
    defaults to the whole model's; an adapter save passes its own."""
    state = _checkpoint_state_dict(model) if state is None else state
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    world = rank_world()[1]
    if not pipelined(model):
        return SavePlan(state, plan_files(specs, max_shard_size, world), _owners(state, world))
    specs, holders = global_specs(model, specs, {n for n, t in state.items() if _sharded(t)})
    return SavePlan(state, plan_files(specs, max_shard_size, world), owners(specs, holders))


def write_model_folder(model: nn.Module, folder: Path, plan: SavePlan, *, tokenizer=None, checksums=True) -> None:
    """Collective: fill ``folder`` (created if needed) with the model's files, every rank
    writing its bytes; a failure on any rank (e.g. a full disk) raises on every rank."""
    digests = write_tensor_files(folder, plan, checksums=checksums)
    run_together(_write_metadata, model, folder, plan.files, digests, tokenizer, only_rank0=True)


def write_tensor_files(folder: Path, plan: SavePlan, *, checksums: bool = True) -> dict[str, str]:
    """Collective: the plan's safetensors files in ``folder``, every rank writing its bytes;
    returns ``{file: sha256}`` on every rank (empty without ``checksums``)."""
    rank = rank_world()[0]
    run_together(_create_files, folder, plan.files, only_rank0=True)
    run_together(lambda: [_write_my_bytes(folder / f.name, f, plan.state, plan.owners, rank) for f in plan.files])
    return share_digests(folder, [f.name for f in plan.files]) if checksums else {}


def write_checksums(folder: Path, files: list[ShardFile], digests: dict[str, str]) -> None:
    """``checksums.sha256`` (``sha256sum -c`` format) for ``files``."""
    if digests:
        (folder / CHECKSUMS_FILE).write_text("".join(f"{digests[f.name]}  {f.name}\n" for f in files))


def _create_files(folder: Path, files: list[ShardFile]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        _create(folder / f.name, f)


def reshard_all(model: nn.Module) -> None:
    """Put every FSDP unit back to its sharded parameters. After a forward without backward
    (evaluation) a unit may still hold gathered compute-dtype copies; the sharded fp32
    parameters are the ones to save or load into. (Under pipeline parallel the FSDP roots are
    the stage wrappers, outside ``model``; the schedule leaves them resharded after each step.)"""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with tied copies dropped and keys renamed to the checkpoint format."""
    reshard_all(model)
    state = model.state_dict()
    for target, _source in find_tied_parameters(model):
        state.pop(target, None)
    if pipelined(model):  # the head is its own parameter on the last stage: the source is saved
        for target in tie_aliases(model):
            state.pop(target, None)
    out = {}
    for key, pieces in checkpoint_layout(model, state).items():
        t = state[key]
        for piece in pieces:
            out[piece.name] = t if piece.whole(t.shape) and len(pieces) == 1 else SlicedTensor(t, piece)
    return out


class SlicedTensor:
    """A checkpoint tensor that is a box of a model tensor (one expert's projection of a fused
    experts weight): what a save plan needs of a tensor (shape, dtype, size) and its source."""

    def __init__(self, source: torch.Tensor, piece: Piece):
        self.source, self.piece = source, piece
        self.shape, self.dtype = torch.Size(piece.shape), source.dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.source.element_size()


def checkpoint_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, list[Piece]]:
    """Module key -> its checkpoint tensors (:class:`Piece`): one whole piece under its
    checkpoint name for a rename, the slices transformers' save conversion writes for a fused
    weight (transformers 5's experts: one tensor per expert and projection)."""
    try:
        names = checkpoint_names(model, state)
    except HfScaleCheckpointError:
        from transformers.modeling_utils import revert_weight_conversion

        def conversion(module, probes):
            with _own_classes(module):
                return revert_weight_conversion(module, probes)

        return checkpoint_pieces(model, state, conversion)
    return {k: [Piece(names[k], tuple((0, n, True) for n in v.shape))] for k, v in state.items()}


def checkpoint_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Module key -> checkpoint key, from transformers' own save-time conversion (renames only)."""
    try:
        from transformers.modeling_utils import revert_weight_conversion
    except ImportError:  # older transformers: names are the module names
        return {k: k for k in state}
    probes = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    by_id = {id(v): k for k, v in probes.items()}
    with _own_classes(model):
        reverted = revert_weight_conversion(model, dict(probes))
    names = {by_id[id(v)]: k for k, v in reverted.items() if id(v) in by_id}
    if len(names) != len(state):
        raise HfScaleCheckpointError(
            f"{type(model).__name__}'s checkpoint format merges or splits weights on save "
            "(transformers weight conversion); hf_scale's parallel save writes renamed weights "
            "only. Gather the model and use transformers' save_pretrained for this model."
        )
    return names


@contextlib.contextmanager
def _own_classes(model: nn.Module):
    """transformers finds a model's weight conversions by its class name ("GPTNeoXForCausalLM":
    embed_out <-> lm_head); FSDP2 renames the class ("FSDPGPTNeoXForCausalLM"). For the lookup,
    every FSDP-wrapped module wears its own class again."""
    from transformers import PreTrainedModel

    swapped = []
    for module in model.modules():
        own = model_class(module) if isinstance(module, PreTrainedModel) else type(module)
        if own is not type(module):
            swapped.append((module, type(module)))
            module.__class__ = own
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _owners(state: dict[str, torch.Tensor], world: int) -> dict[str, int]:
    """Owner rank of each replicated (non-sharded) tensor, balancing bytes across ranks."""
    load = [0] * world
    owners = {}
    for name, t in sorted(state.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
        if _sharded(t):
            continue
        owner = min(range(world), key=load.__getitem__)
        owners[name] = owner
        load[owner] += t.numel() * t.element_size()
    return owners


def _sharded(t: torch.Tensor) -> bool:
    """A DTensor split over some mesh dim: its placements say which rank writes which bytes."""
    if isinstance(t, SlicedTensor):
        return _sharded(t.source)
    return isinstance(t, DTensor) and any(isinstance(p, (Shard, _StridedShard)) for p in t.placements)


def _create(path: Path, f: ShardFile) -> None:
    with open(path, "wb") as fh:
        fh.write(f.header)
        fh.truncate(f.size)


def _local_block(name: str, t: torch.Tensor, owners: dict[str, int], rank: int):
    """(local tensor, its boxes) this rank writes for ``t``, or None. A tensor-parallel slice
    of a packed weight (fused q;k;v) is several boxes of the global tensor; a slice of a fused
    weight, this rank's boxes of the source inside the slice."""
    if isinstance(t, SlicedTensor):
        block = _local_block(name, t.source, owners, rank)
        return None if block is None else (block[0], piece_boxes(block[1], t.piece))
    if isinstance(t, DTensor) and name not in owners:
        coords = t.device_mesh.get_coordinate()
        for dim, placement in enumerate(t.placements):
            if isinstance(placement, Replicate) and coords[dim] != 0:
                return None  # another replica group writes it
        return t.to_local(), local_boxes(t)
    if owners.get(name) != rank:
        return None
    local = t.full_tensor() if isinstance(t, DTensor) else t
    return local, [Box(tuple(slice(0, n) for n in local.shape), (0,) * local.dim(), tuple(local.shape))]


def _write_my_bytes(path: Path, f: ShardFile, state, owners, rank: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        for spec in f.tensors:
            if spec.name not in state:  # another pipeline stage's tensor
                continue
            block = _local_block(spec.name, state[spec.name], owners, rank)
            if block is None:
                continue
            local, boxes = block
            local = local.detach().to("cpu")
            for box in boxes:
                _write_box(fd, path, local[box.local], box, spec, f.offsets[spec.name])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_box(fd: int, path: Path, part: torch.Tensor, box: Box, spec: TensorSpec, base: int) -> None:
    data = part.contiguous().reshape(-1).view(torch.uint8).numpy()
    size = spec.dtype.itemsize
    for g_start, l_start, length in contiguous_runs(box.shape, box.offset, spec.shape):
        view = memoryview(data[l_start * size : (l_start + length) * size])
        done = 0
        while done < len(view):  # a short write is retried; a full disk raises ENOSPC
            wrote = os.pwrite(fd, view[done:], base + g_start * size + done)
            if wrote == 0:  # never loop forever on a device that accepts nothing
                raise OSError(errno.ENOSPC, f"{path}: the disk accepted no more bytes")
            done += wrote


def model_class(model: nn.Module) -> type:
    """The model's own class, behind the FSDP / DDP classes torch derives from it."""
    return next(c for c in type(model).__mro__ if not c.__module__.startswith("torch."))


def _write_metadata(model, folder: Path, files: list[ShardFile], digests: dict, tokenizer) -> None:
    if len(files) > 1:
        (folder / INDEX_FILE).write_text(json.dumps(index_json(files), indent=2, sort_keys=True) + "\n")
    config = getattr(model, "config", None)
    if config is not None:
        config.architectures = [model_class(model).__name__]  # as transformers records it
        config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_checksums(folder, files, digests)
