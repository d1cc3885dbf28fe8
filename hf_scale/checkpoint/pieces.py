"""Checkpoint tensors that are slices of a model tensor: transformers 5's fused experts.

transformers 5 holds a MoE layer's experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``) and
writes many models' checkpoints in their Hub layout, one tensor per expert and projection
(``experts.3.gate_proj.weight`` ``[I, H]``), by its save-time weight conversion (chunk, then
split the expert list). Each such checkpoint tensor is a box of the model tensor, one expert
index dropped: a :class:`Piece`. Save writes each rank's part of every piece; load reads the
pieces that overlap each rank's block.

The pieces are found by running transformers' own conversion on meta probes and reading where
each output lies in its probe (a view: storage offset and strides), so any conversion made of
chunks, splits and renames is followed without naming a model; one that computes new values
(a merge, a transpose or a permutation on save) is refused, as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..errors import HfScaleCheckpointError
from .boxes import Box


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``name``: per model-tensor dim ``(start, stop, kept)``; a dim not kept
    is one index, dropped from the checkpoint tensor's shape."""

    name: str
    region: tuple[tuple[int, int, bool], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b, kept in self.region if kept)

    def whole(self, shape) -> bool:
        return all(kept and a == 0 and b == n for (a, b, kept), n in zip(self.region, shape))


def checkpoint_pieces(model, state: dict, conversion) -> dict[str, list[Piece]]:
    """Model key -> its checkpoint pieces (a rename: one whole piece), from ``conversion``
    (transformers' ``revert_weight_conversion``) applied to meta probes of ``state``."""
    probes = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    by_id = {id(v): k for k, v in probes.items()}
    with _views_kept():
        reverted = conversion(model, dict(probes))
    out: dict[str, list[Piece]] = {k: [] for k in state}
    for name, v in reverted.items():
        key = by_id.get(id(v))
        if key is not None:
            out[key].append(Piece(name, tuple((0, n, True) for n in v.shape)))
            continue
        key = by_id.get(id(v._base)) if getattr(v, "_base", None) is not None else None
        region = _region(probes[key], v) if key is not None else None
        if region is None:
            raise HfScaleCheckpointError(
                f"{type(model).__name__}'s checkpoint format computes {name!r} on save (transformers "
                "weight conversion: a merge or a transpose, not a slice of one model tensor); "
                "hf_scale's parallel save writes renamed or sliced weights only. Gather the model "
                "and use transformers' save_pretrained for this model."
            )
        out[key].append(Piece(name, region))
    for key, pieces in out.items():
        covered = sum(_numel(p.shape) for p in pieces)
        if covered != _numel(tuple(state[key].shape)):
            raise HfScaleCheckpointError(
                f"{type(model).__name__}: transformers' save conversion writes {covered} of the "
                f"{_numel(tuple(state[key].shape))} values of {key!r}; hf_scale's parallel save needs "
                "each weight written once, whole. Gather the model and use transformers' save_pretrained."
            )
    return out


def piece_boxes(boxes: list[Box], piece: Piece) -> list[Box]:
    """The parts of a block (``boxes``, in model-tensor coordinates) inside ``piece``, as boxes
    of the checkpoint tensor: local slices (an int on a dropped dim), offset and shape in the
    piece's coordinates."""
    out = []
    for box in boxes:
        local, offset, shape = [], [], []
        for d, (a, b, kept) in enumerate(piece.region):
            lo, hi = max(a, box.offset[d]), min(b, box.offset[d] + box.shape[d])
            if lo >= hi:
                break
            start = box.local[d].start + lo - box.offset[d]
            if kept:
                local.append(slice(start, start + hi - lo))
                offset.append(lo - a)
                shape.append(hi - lo)
            else:
                local.append(start)
        else:
            out.append(Box(tuple(local), tuple(offset), tuple(shape)))
    return out


def _region(probe: torch.Tensor, view: torch.Tensor):
    """Where ``view`` lies in contiguous ``probe``: per probe dim ``(start, stop, kept)``, or
    None when it is not a box in the probe's dim order."""
    strides = probe.stride()
    rest, coords = view.storage_offset() - probe.storage_offset(), []
    for s in strides:
        coords.append(rest // s)
        rest %= s
    kept_dims, d = {}, 0
    for size, stride in zip(view.shape, view.stride()):
        while d < probe.dim() and not (strides[d] == stride and (probe.shape[d] > 1 or size == 1)):
            d += 1
        if d == probe.dim():
            return None
        kept_dims[d] = size
        d += 1
    region = tuple((c, c + kept_dims.get(i, 1), i in kept_dims) for i, c in enumerate(coords))
    if any(b > n for (_, b, _), n in zip(region, probe.shape)) or tuple(b - a for a, b, k in region if k) != tuple(view.shape):
        return None
    return region


@contextlib.contextmanager
def _views_kept():
    """``contiguous()`` of a meta tensor returns it as it is while probing: transformers' chunk
    copies its outputs, which would hide where they came from (a meta copy costs nothing and
    carries no values, so only the provenance changes)."""
    original = torch.Tensor.contiguous

    def contiguous(self, *args, **kwargs):
        return self if self.is_meta else original(self, *args, **kwargs)

    torch.Tensor.contiguous = contiguous
    try:
        yield
    finally:
        torch.Tensor.contiguous = original


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
