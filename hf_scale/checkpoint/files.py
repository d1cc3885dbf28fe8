"""Checkpoint folders on disk, shared by save, training state and export: a folder is written
as ``.<name>.partial`` and swapped into place when every rank is done; the free space is
checked before the first byte; shards are hashed by all ranks in parallel.

Usage::

    with staged_folder("out/model", needed_bytes=n) as tmp:   # collective
        ...every rank writes into tmp (failures raised on all ranks: ranks.run_together)
    digests = share_digests(folder, names)                     # {name: sha256}, on every rank
    atomic_write_text(root / "latest", "step_00000100\n")      # a small file, never torn
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import HfScaleCheckpointError
from ..ranks import barrier, gather, my_share, rank_world, run_together

CHECKSUMS_FILE = "checksums.sha256"


@contextmanager
def staged_folder(final: str | Path, *, needed_bytes: int) -> Iterator[Path]:
    """Collective: an empty ``.<name>.partial`` beside ``final`` to fill, swapped into place.

    Rank 0 first checks that the disk has ``needed_bytes`` free (else
    :class:`HfScaleCheckpointError` naming needed and free bytes). When the body raises (on
    every rank: write steps go through ``ranks.run_together``), the partial folder is removed,
    ``final`` is untouched, and a full disk (``ENOSPC``) becomes the same clear error.
    """
    final = Path(final).resolve()
    tmp = final.parent / f".{final.name}.partial"
    run_together(_fresh, tmp, final, needed_bytes, only_rank0=True)
    try:
        yield tmp
        barrier()
        run_together(swap_into_place, tmp, final, only_rank0=True)
    except BaseException as e:
        if rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise no_space(final, needed_bytes, free_bytes(final.parent)) from e
        raise


def _fresh(tmp: Path, final: Path, needed: int) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash
    free = free_bytes(final.parent)
    if free < needed:
        raise no_space(final, needed, free)
    tmp.mkdir(parents=True)


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (or its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def no_space(final: Path, needed: int, free: int) -> HfScaleCheckpointError:
    return HfScaleCheckpointError(
        f"no space left for {final}: the save needs {_size(needed)} ({needed:,} bytes), the disk "
        f"of {final.parent} has {_size(free)} ({free:,} bytes) free. Free some space (e.g. lower "
        "checkpoint.keep_last) or save elsewhere; nothing was left behind and any previous "
        "checkpoint is unchanged."
    )


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def swap_into_place(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``; the old folder is removed only once the new one is there."""
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    try:
        tmp.rename(final)
    except OSError:
        if old.exists() and not final.exists():
            old.rename(final)  # the previous folder stays where it was
        raise
    shutil.rmtree(old, ignore_errors=True)


def share_digests(folder: Path, names: list[str]) -> dict[str, str]:
    """``{name: sha256}`` of ``folder/name`` for every name, on every rank; each rank hashes
    its round-robin share (:func:`hf_scale.ranks.my_share`), the results are all-gathered."""
    mine = run_together(lambda: [(n, sha256_file(folder / n)) for n in my_share(names)])
    return dict(gather(mine))


def mismatched(folder: Path, names: list[str], expected: dict[str, str]) -> list[str]:
    """The names (of those listed in ``expected``) whose sha256 differs, hashed in parallel."""
    listed = [n for n in names if n in expected]
    return sorted(n for n, digest in share_digests(folder, listed).items() if digest != expected[n])


def read_checksums(folder: Path) -> dict[str, str]:
    """``{shard file name: sha256}`` from ``folder/checksums.sha256`` (empty when absent)."""
    listed = folder / CHECKSUMS_FILE
    if not listed.exists():
        return {}
    return {name: digest for digest, name in (line.split("  ", 1) for line in listed.read_text().splitlines() if line)}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: written in full to ``.<name>.tmp`` beside it,
    flushed to disk, renamed over the old file (``os.replace``) and the folder entry flushed. A
    crash at any point leaves the old content or the new, never a torn file (a stale temporary
    file is overwritten next time)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (a rename) to disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
