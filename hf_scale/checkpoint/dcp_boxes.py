"""Hand DCP (``torch.distributed.checkpoint``) the true layout of every DTensor in a state.

DCP places a DTensor's local block by torch's single offset
(``compute_local_shape_and_global_offset``). For a packed tensor-parallel parameter (fused
q;k;v sharded with ``_StridedShard``), and for FSDP2 over one, that offset is wrong: rank r's
block is several boxes of the global tensor (see :mod:`.boxes`). Such a tensor is given to DCP
as a ``ShardedTensor`` with one local shard per box, each shard a view of (or, when the box is
not contiguous in memory, a copy from) the local tensor. DCP stores and reshards boxes by their
global offsets, so the state saved from one layout loads into any other; replicas write the
same boxes, which DCP keeps once. Every other tensor is passed through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .boxes import is_one_box, layout_boxes


def checkpointable(state: Any) -> tuple[Any, Callable[[], None]]:
    """``state`` with every multi-box DTensor replaced by a ShardedTensor of its boxes (in new
    containers; ``state`` is not changed), and a function to call after ``dcp.load`` into the
    result: it copies boxes that could not be views back into the DTensors, and the values DCP
    loads by replacing them (floats, ints: the param groups' lr) back into ``state``."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    boxed = _walk(state, copies)

    def copy_back() -> None:
        for part, copy in copies:
            part.copy_(copy)
        _merge(state, boxed)

    return boxed, copy_back


def _merge(target: Any, loaded: Any) -> None:
    """Put what DCP loaded into ``loaded``'s containers back into ``target``'s, leaving
    target's tensors (filled in place) where they are."""
    keys = target.keys() if isinstance(target, dict) else range(len(target))
    for k in keys:
        old, new = target[k], loaded[k]
        if isinstance(old, list) and not any(isinstance(x, (dict, list, torch.Tensor)) for x in old):
            target[k] = new  # a list of plain values (a param group's names): the saved one, whole
        elif isinstance(old, (dict, list)):
            _merge(old, new)
        elif not isinstance(old, torch.Tensor):
            target[k] = new


def _walk(value: Any, copies) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v, copies) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, copies) for v in value]
    if isinstance(value, DTensor) and not is_one_box(value):
        return _sharded(value, copies)
    return value


def _sharded(t: DTensor, copies):
    """A ShardedTensor whose local shards are this rank's boxes of ``t``. Its global metadata
    lists the boxes of this rank's replica group (the ranks that share its coordinate on every
    Replicate mesh dim): they cover the tensor once, as ShardedTensor requires."""
    import itertools

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )
    from torch.distributed.tensor import Replicate

    mesh, placements = t.device_mesh, t.placements
    mine = mesh.get_coordinate()
    local = t.to_local()
    device = local.device
    suffix = device.type + (f":{device.index}" if device.index is not None else "")
    ranges = [[mine[i]] if isinstance(p, Replicate) else range(mesh.size(i)) for i, p in enumerate(placements)]
    everyone, shards = [], []
    for coord in itertools.product(*ranges):
        rank = int(mesh.mesh[coord].item())
        for box in layout_boxes(tuple(t.shape), tuple(mesh.shape), list(coord), placements):
            meta = ShardMetadata(list(box.offset), list(box.shape), f"rank:{rank}/{suffix}")
            everyone.append(meta)
            if list(coord) == list(mine):
                part = local[box.local]
                if not part.is_contiguous():
                    copy = part.contiguous()
                    copies.append((part, copy))
                    part = copy
                shards.append(Shard(part, meta))
    properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(everyone, torch.Size(t.shape), properties))
