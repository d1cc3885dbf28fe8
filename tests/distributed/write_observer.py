"""Observe the bytes a rank really writes into safetensors shards, and check that all ranks
together wrote each shard's tensor data exactly once.

The save writes tensor data with ``os.pwrite`` (the header is written before, by one rank), so
wrapping ``os.pwrite`` in a rank records every write as (file name, offset, bytes written), taken
from the file descriptor and the return value: what reached the file, not what the code under
test meant to write.

Usage::

    with observed_pwrites() as writes:                 # in each rank
        hf_scale.save_pretrained(model, folder)
    per_rank = check_written_once(folder, [w0, w1])    # in the test, with every rank's writes
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Iterator

Write = tuple[str, int, int]  # (shard file name, offset, bytes written)


@contextlib.contextmanager
def observed_pwrites() -> Iterator[list[Write]]:
    """Record every ``os.pwrite`` into a ``*.safetensors`` file made inside the block."""
    writes: list[Write] = []
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        written = real(fd, data, offset)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name.endswith(".safetensors"):
            writes.append((name, offset, written))
        return written

    os.pwrite = pwrite
    try:
        yield writes
    finally:
        os.pwrite = real


def check_written_once(folder: str | os.PathLike, writes_per_rank: list[list[Write]]) -> list[int]:
    """Every shard's data region (after its header) was written exactly once by the ranks
    together: no byte twice, none left out, nothing written past the end or into another
    file. Returns the bytes each rank wrote."""
    folder = Path(folder)
    shards = {p.name: p for p in folder.glob("*.safetensors")}
    assert shards, f"no shard in {folder}"
    for rank, writes in enumerate(writes_per_rank):
        stray = {name for name, _, _ in writes} - set(shards)
        assert not stray, f"rank {rank} wrote {stray}, which are not in {folder}"
    for name, path in sorted(shards.items()):
        with open(path, "rb") as fh:
            header_len = struct.unpack("<Q", fh.read(8))[0]
            json.loads(fh.read(header_len))  # the header is whole
        position, size = 8 + header_len, path.stat().st_size
        runs = sorted((off, off + n, rank) for rank, writes in enumerate(writes_per_rank)
                      for f, off, n in writes if f == name and n)
        for start, end, rank in runs:
            assert start >= position, f"{name}: bytes {start}..{min(end, position)} written twice (rank {rank})"
            assert start == position, f"{name}: bytes {position}..{start} never written"
            position = end
        assert position == size, f"{name}: bytes {position}..{size} never written (or past the end)"
    return [sum(n for _, _, n in writes) for writes in writes_per_rank]


def save_and_observe(cases: list[dict], root: str) -> list[dict]:
    """Rank function: parallelize each case (``id``, ``arch``, ``head``, ``config``, ``shard``),
    take one optimizer step, save it; return the folder and this rank's observed writes."""
    import torch  # noqa: F401 - the rank's torch, before hf_scale

    import hf_scale
    from tests.tiny_models import slice_batch, tiny_batch, tiny_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = []
    for case in cases:
        model = hf_scale.parallelize(tiny_model(case["arch"], case["head"]), case["config"])
        optimizer = hf_scale.build_optimizer(model, lr=1e-2)
        model(**slice_batch(tiny_batch(case["head"], 2 * world), rank, world)).loss.backward()
        optimizer.step()
        with observed_pwrites() as writes:
            folder = hf_scale.save_pretrained(model, os.path.join(root, case["id"]), max_shard_size=case["shard"])
        results.append({"folder": str(folder), "writes": writes})
    return results
