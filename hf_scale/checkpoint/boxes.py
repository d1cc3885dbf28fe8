"""Which parts of a global tensor a rank holds: the boxes of a DTensor's local block.

torch's ``compute_local_shape_and_global_offset`` describes a rank's block by one offset. That
is wrong for a packed tensor-parallel parameter (fused q;k;v or gate;up sharded with
``_StridedShard(dim, split_factor=k)``): rank r holds rows ``[q_r; k_r; v_r]``, k separate
ranges of the global tensor. Saving or loading such a block at one offset writes or reads the
wrong rows. Here a block is a list of boxes, each a contiguous region in every tensor dim, so
save and load place every part where it belongs.

The layout is replayed per tensor dim as the list of global indices the rank holds, in local
order; runs of consecutive indices become the boxes. Placements apply in mesh-dim order, with
torch's chunking (``torch.chunk``: ceil-sized chunks, the last ones short or empty):

* ``Shard(d)``: chunk c of the dim's current indices;
* ``_StridedShard(d, sf)``: the indices cut into ``sf`` pieces, each cut into n chunks, chunk c
  of each piece, concatenated (torch's ``_StridedShard._split_tensor``);
* except FSDP2's marker: a ``_StridedShard(d, sf)`` on a data-parallel dim whose ``sf`` is the
  product of the later mesh dims that shard d. FSDP2 writes it when it shards the (already
  tensor-parallel) local tensor along d: the later dims apply first, then this one as a plain
  ``Shard(d)`` of what they left. For plain ``Shard`` tp placements that is the same as torch's
  left-to-right reading; for a packed tp placement it is the only correct one (measured with
  fully_shard over a ``_StridedShard(0, sf=3)`` weight on 2 x 2 ranks: torch's own
  ``full_tensor()`` of it is scrambled, the local rows follow this rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import HfScaleCheckpointError


@dataclass(frozen=True)
class Box:
    """A region of the global tensor held by one rank: ``local`` slices of its local tensor hold
    the global region at ``offset`` of ``shape``."""

    local: tuple[slice, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def local_boxes(t) -> list[Box]:
    """The boxes of DTensor ``t``'s local block on this rank (empty when it holds nothing)."""
    return layout_boxes(tuple(t.shape), tuple(t.device_mesh.shape), t.device_mesh.get_coordinate(), t.placements)


def layout_boxes(global_shape, mesh_shape, coordinate, placements) -> list[Box]:
    """The boxes that the rank at mesh ``coordinate`` holds of a tensor of ``global_shape``
    laid out by ``placements`` on a mesh of ``mesh_shape`` (pure; any coordinate)."""
    index = [list(range(n)) for n in global_shape]
    for mesh_dim in _order(placements, mesh_shape):
        placement, n, c = placements[mesh_dim], mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise HfScaleCheckpointError(
                f"placement {placement} on mesh dim {mesh_dim} is not one a checkpoint can place "
                "(Shard, _StridedShard, Replicate): redistribute the tensor first."
            )
        d = placement.dim % len(global_shape)
        if isinstance(placement, _StridedShard) and not _is_fsdp_marker(placements, mesh_shape, mesh_dim):
            pieces = _chunks(index[d], int(placement.split_factor))
            index[d] = [i for piece in pieces for i in _chunks(piece, n)[c]]
        else:
            index[d] = _chunks(index[d], n)[c]
    if any(not ix for ix in index):
        return []
    per_dim = [_runs(ix) for ix in index]
    boxes = []
    for combo in _product(per_dim):
        boxes.append(Box(
            local=tuple(slice(lo, lo + length) for lo, _, length in combo),
            offset=tuple(g for _, g, _ in combo),
            shape=tuple(length for _, _, length in combo),
        ))
    return boxes


def is_one_box(t) -> bool:
    """Whether torch's single-offset description of DTensor ``t``'s block is right on this rank
    (so torch's own checkpointing, DCP, places it correctly)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not any(isinstance(p, _StridedShard) for p in t.placements):
        return True  # plain Shard / Replicate: torch's reading and this one agree (unit-tested)
    boxes = local_boxes(t)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if not boxes:
        return math.prod(shape) == 0
    return len(boxes) == 1 and boxes[0].shape == tuple(shape) and boxes[0].offset == tuple(offset)


def _is_fsdp_marker(placements, mesh_shape, mesh_dim: int) -> bool:
    p = placements[mesh_dim]
    later = [mesh_shape[j] for j in range(mesh_dim + 1, len(placements))
             if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p.dim]
    return bool(later) and int(p.split_factor) == math.prod(later)


def _order(placements, mesh_shape) -> list[int]:
    """Mesh dims in the order their sharding happened: left to right, FSDP2's markers last
    (right to left among themselves)."""
    dims = range(len(placements))
    marker = [isinstance(placements[i], _StridedShard) and _is_fsdp_marker(placements, mesh_shape, i) for i in dims]
    return [i for i in dims if not marker[i]] + [i for i in reversed(dims) if marker[i]]


def _chunks(items: list[int], n: int) -> list[list[int]]:
    """``torch.chunk`` of a list into n parts (ceil-sized, trailing ones short or empty)."""
    size = -(-len(items) // n) if items else 0
    return [items[k * size : (k + 1) * size] for k in range(n)]


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices."""
    runs, start = [], 0
    for k in range(1, len(index) + 1):
        if k == len(index) or index[k] != index[k - 1] + 1:
            runs.append((start, index[start], k - start))
            start = k
    return runs


def _product(lists):
    if not lists:
        yield ()
        return
    for head in lists[0]:
        for rest in _product(lists[1:]):
            yield (head, *rest)
