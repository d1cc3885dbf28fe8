"""Where every tensor of a checkpoint goes: shard files, byte offsets, and which rank writes what.

Pure bookkeeping, identical on every rank (no collective): given the tensors' names, shapes and
dtypes it lays out Hub-format safetensors files (``model-0000k-of-0000n.safetensors``), each
with its JSON header, so that every rank can write its own bytes into place with ``pwrite``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import HfScaleCheckpointError

# safetensors dtype names
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ShardFile:
    """One safetensors file: its tensors and where each one's bytes start in the file."""

    name: str
    tensors: list[TensorSpec] = field(default_factory=list)
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # absolute byte offset in the file
    size: int = 0

    def finalize(self) -> None:
        entries, begin = {"__metadata__": {"format": "pt"}}, 0
        for t in self.tensors:
            entries[t.name] = {
                "dtype": SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [begin, begin + t.nbytes],
            }
            begin += t.nbytes
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # safetensors aligns the data to 8 bytes
        self.header = struct.pack("<Q", len(header)) + header
        data_start = len(self.header)
        for name, entry in entries.items():
            if name != "__metadata__":
                self.offsets[name] = data_start + entry["data_offsets"][0]
        self.size = data_start + begin


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"500MB"`` / an int -> bytes (decimal units, as transformers reads them);
    ``"auto"`` is resolved by :func:`plan_files`, not here."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), flags=re.I)
    if not match:
        raise HfScaleCheckpointError(
            f"max_shard_size={size!r} is not a size: use bytes (an int), e.g. '5GB', '500MB', or 'auto'."
        )
    number, unit = float(match.group(1)), match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(number * base**power)


AUTO_SHARD_CAP = 5 * 10**9  # transformers' usual largest shard
AUTO_SHARD_FLOOR = 100 * 10**6  # below this a file hashes in ~0.1 s: not worth another file


def auto_shard_size(tensors: list[TensorSpec], ranks: int) -> int:
    """``max_shard_size="auto"``: the smallest limit that packs the tensors into as many files as
    there are ranks (each rank then hashes its own files in parallel after writing: the sha256 of
    one file cannot be split), files of at least ~100 MB and at most 5 GB (a larger tensor
    alone in its file).

    SmolLM2-135M (538 MB fp32) saved from 2 ranks: two files of ~270 MB, not one of 538 MB."""
    total = sum(t.nbytes for t in tensors)
    want = max(1, min(ranks, total // AUTO_SHARD_FLOOR), len(_pack(tensors, AUTO_SHARD_CAP)))
    low, high = max((t.nbytes for t in tensors), default=1), max(total, 1)
    while low < high:  # greedy packing needs fewer files as the limit grows: bisect the limit
        mid = (low + high) // 2
        if len(_pack(tensors, mid)) <= want:
            high = mid
        else:
            low = mid + 1
    return low


def plan_files(tensors: list[TensorSpec], max_shard_size: int | str, ranks: int = 1) -> list[ShardFile]:
    """Pack tensors, in order, into files of at most ``max_shard_size`` bytes (a larger tensor
    gets a file of its own; ``"auto"``: :func:`auto_shard_size` for ``ranks`` writers), named as
    transformers names them."""
    limit = auto_shard_size(tensors, ranks) if max_shard_size == "auto" else parse_size(max_shard_size)
    files = _pack(tensors, limit)
    n = len(files)
    for k, f in enumerate(files, start=1):
        f.name = SINGLE_FILE if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        f.finalize()
    return files


def _pack(tensors: list[TensorSpec], limit: int) -> list[ShardFile]:
    files: list[ShardFile] = [ShardFile("")]
    used = 0
    for t in tensors:
        if files[-1].tensors and used + t.nbytes > limit:
            files.append(ShardFile(""))
            used = 0
        files[-1].tensors.append(t)
        used += t.nbytes
    return files


def index_json(files: list[ShardFile]) -> dict:
    """The ``model.safetensors.index.json`` content transformers reads."""
    return {
        "metadata": {"total_size": sum(t.nbytes for f in files for t in f.tensors)},
        "weight_map": {t.name: f.name for f in files for t in f.tensors},
    }


def contiguous_runs(local_shape, global_offset, global_shape):
    """Yield ``(element_offset_in_global, element_offset_in_local, length)`` of the contiguous
    row-major runs that a local block (``local_shape`` at ``global_offset``) occupies.

    Shard(0) blocks are a single run; blocks split on later dims are one run per leading index.
    """
    ndim = len(global_shape)
    if ndim == 0:
        yield 0, 0, 1
        return
    k = ndim - 1  # first dim from which the block spans whole trailing dims
    while k > 0 and tuple(local_shape[k:]) == tuple(global_shape[k:]):
        k -= 1
    run = math.prod(local_shape[k:])
    strides = [math.prod(global_shape[i + 1 :]) for i in range(ndim)]
    lead = local_shape[:k]
    if run == 0 or any(s == 0 for s in lead):
        return
    for local_index, lead_index in enumerate(_product(lead)):
        start = sum((global_offset[i] + lead_index[i]) * strides[i] for i in range(k))
        start += global_offset[k] * strides[k]
        yield start, local_index * run, run


def _product(shape):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _product(shape[1:]):
            yield (i, *rest)


def read_header(path: Path) -> tuple[int, dict]:
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
