"""Export a training checkpoint (``save_state``) as a clean Hub folder, on 1..N processes."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from ..errors import HfScaleCheckpointError
from ..log import log_rank0
from ..ranks import my_share, run_together
from .files import CHECKSUMS_FILE, mismatched, read_checksums, staged_folder
from .training_state import resolve_checkpoint


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, tokenizer=None) -> Path:
    """Copy the Hub-format model of ``checkpoint`` (a ``step_*`` folder or ``<root>/latest``)
    to ``out``, verifying every shard's sha256 on the way; optimizer and RNG state stay behind.

    A training checkpoint already stores its model in the Hub format, written by all ranks,
    so exporting is a verified copy at any world size: under torchrun each rank copies its
    share of the files, then the copies are hashed in parallel (round-robin over ranks). Call on every rank (or in one process).
    """
    source = resolve_checkpoint(checkpoint) / "model"
    files = sorted(p.name for p in source.iterdir() if p.is_file())
    needed = sum((source / name).stat().st_size for name in files)
    with staged_folder(out, needed_bytes=needed) as tmp:
        run_together(lambda: [shutil.copy2(source / name, tmp / name) for name in my_share(files)])
        expected = read_checksums(source)
        if not expected:
            log_rank0(f"{source} has no {CHECKSUMS_FILE} (saved with checksums=False?): the exported "
                      "shards are copied but not verified", level=logging.WARNING)
        bad = mismatched(tmp, files, expected)
        if bad:
            raise HfScaleCheckpointError(f"{source}: {bad} do not match {CHECKSUMS_FILE}; not exported.")
        if tokenizer is not None:
            run_together(tokenizer.save_pretrained, tmp, only_rank0=True)
    return Path(out).resolve()
