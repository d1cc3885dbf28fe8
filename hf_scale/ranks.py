"""Rank, world size, barriers and errors across ranks: the one place hf_scale asks them.

Collectives follow the process group (``rank_world``: ``(0, 1)`` without one); log output may
come before the group exists, so :func:`rank` falls back to what the launcher set
(:func:`hf_scale.distributed.launcher_rank`). Every helper is a no-op in one process.

Usage::

    rank, world = rank_world()
    bad = gather([f for f in my_share(files) if not ok(f)])   # every rank's failures, on every rank
    raise_together(error)                                     # one rank failed: all ranks raise
"""

from __future__ import annotations

import errno as errno_codes
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from .errors import HfScaleCheckpointError


def group_started() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    if group_started():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank() -> int:
    """This process's global rank: the process group's, else the launcher's variables'."""
    if group_started():
        return dist.get_rank()
    from .distributed import launcher_rank

    return launcher_rank()


def barrier() -> None:
    if group_started() and dist.get_world_size() > 1:
        dist.barrier()


def my_share(items: Sequence) -> list:
    """The items this rank handles when work is dealt round-robin (all of them in one process)."""
    r, world = rank_world()
    return list(items[r::world])


def gather(items: list) -> list:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    world = rank_world()[1]
    if world == 1:
        return list(items)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


def raise_together(error: BaseException | None) -> None:
    """Collective: if any rank passes an error, every rank raises.

    The rank that failed re-raises its own exception; the others raise an ``OSError`` with the
    same errno (so callers can tell a full disk on any rank) or an ``HfScaleCheckpointError``
    naming the failing rank. Call it where a rank would otherwise wait at a barrier forever.
    """
    report = [] if error is None else [(rank(), type(error).__name__, str(error), getattr(error, "errno", None))]
    failures = gather(report)
    if error is not None:
        raise error
    if failures:
        who, kind, message, code = failures[0]
        if code is not None and code in errno_codes.errorcode:
            raise OSError(code, f"on rank {who}: {message}")
        raise HfScaleCheckpointError(f"rank {who} failed: {kind}: {message}")


def run_together(fn, *args, only_rank0: bool = False):
    """``fn(*args)`` on every rank (or rank 0 only); a failure anywhere raises on every rank."""
    result, error = None, None
    if not only_rank0 or rank_world()[0] == 0:
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error = e
    raise_together(error)
    return result


@contextmanager
def rank0_first() -> Iterator[None]:
    """Run the body on rank 0, then on the others (which then hit rank 0's caches)."""
    r, world = rank_world()
    if world > 1 and r != 0:
        dist.barrier()
    try:
        yield
    finally:
        if world > 1 and r == 0:
            dist.barrier()


def share_from_rank0(fn, *args):
    """Collective: ``fn(*args)`` on rank 0 only, its result on every rank. A failure on rank 0 is
    raised on every rank with the same message (an :mod:`hf_scale.errors` class keeps its class),
    so a decision that must be identical everywhere (the auto-planner's) is made once."""
    if rank_world()[1] == 1:
        return fn(*args)
    box: list[Any] = [None]
    error = None
    if rank_world()[0] == 0:
        try:
            box[0] = ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error, box[0] = e, ("error", type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0][0] == "ok":
        return box[0][1]
    from . import errors

    kind = getattr(errors, box[0][1], None)
    if isinstance(kind, type) and issubclass(kind, errors.HfScaleError):
        raise kind(box[0][2])
    raise errors.HfScaleError(f"rank 0 failed: {box[0][1]}: {box[0][2]}")
