"""Export a training checkpoint (``save_state``) as a clean Hub folder, on 1..N processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from ..errors import HfScaleCheckpointError
from .safetensors_io import CHECKSUMS_FILE, rank_world, read_checksums, sha256_file, swap_into_place
from .state import resolve_checkpoint


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, tokenizer=None) -> Path:
    """Copy the Hub-format model of ``checkpoint`` (a ``step_*`` folder or ``<root>/latest``)
    to ``out``, verifying every shard's sha256 on the way; optimizer and RNG state stay behind.

    A training checkpoint already stores its model in the Hub format, written by all ranks,
    so exporting is a verified copy at any world size: under torchrun each rank copies its
    share of the files. Call on every rank (or in one process).
    """
    source = resolve_checkpoint(checkpoint) / "model"
    rank, world = rank_world()
    final = Path(out).resolve()
    tmp = final.parent / f".{final.name}.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if world > 1:
        dist.barrier()
    expected = read_checksums(source)
    files = sorted(p.name for p in source.iterdir() if p.is_file())
    bad = []
    for i, name in enumerate(files):
        if i % world == rank:
            shutil.copy2(source / name, tmp / name)
            if name in expected and sha256_file(tmp / name) != expected[name]:
                bad.append(name)
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, bad)
        bad = [b for part in gathered for b in part]
    if bad:
        raise HfScaleCheckpointError(f"{source}: {bad} do not match {CHECKSUMS_FILE}; not exported.")
    if rank == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        swap_into_place(tmp, final)
    if world > 1:
        dist.barrier()
    return final
