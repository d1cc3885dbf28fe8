"""The process group: read the torchrun environment, check it, start ``torch.distributed``.

CUDA + NCCL when this process can see a GPU, CPU + gloo otherwise. Nothing here knows about
models; :func:`hf_scale.parallelize` calls :func:`init_distributed` before building the mesh.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import HfScaleConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: ranks, sizes and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def read_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Read and check the torchrun variables; world size 1 when none are set.

    Raises :class:`HfScaleConfigError` before any collective when the variables are partial
    or inconsistent (``RANK`` without ``WORLD_SIZE``, a rank outside the world, ...).
    """
    env = os.environ if environ is None else environ
    present = [v for v in TORCHRUN_VARS if v in env]
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(env.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count() or world)))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    elif not present or (present == ["LOCAL_RANK"] and env["LOCAL_RANK"] == "0"):
        world, rank, local_rank, local_world = 1, 0, 0, 1
    else:
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise HfScaleConfigError(
                f"incomplete torchrun environment: {', '.join(present)} set but "
                f"{', '.join(missing)} missing. Launch with `torchrun --nproc_per_node N "
                "script.py`, or unset these variables to run in one process."
            )
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank = int(env["LOCAL_RANK"])
            local_world = int(env.get("LOCAL_WORLD_SIZE", world))
            int(env["MASTER_PORT"])
        except ValueError as e:
            raise HfScaleConfigError(f"torchrun variable is not an integer: {e}") from None
        if world < 1 or not 0 <= rank < world:
            raise HfScaleConfigError(
                f"RANK={rank} is outside WORLD_SIZE={world}: ranks run 0..WORLD_SIZE-1."
            )
        if not 0 <= local_rank < local_world:
            raise HfScaleConfigError(
                f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}."
            )
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise HfScaleConfigError(
                f"LOCAL_RANK={local_rank} but this node has {count} GPU(s): start at most "
                f"{count} processes per node (--nproc_per_node {count})."
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistEnv(rank, world, local_rank, local_world, device)


def init_distributed(timeout_seconds: int = 1800) -> DistEnv:
    """Start the default process group if torchrun asked for one and it is not started yet.

    Returns the :class:`DistEnv`. In one process (no torchrun variables) no group is made.
    """
    env = read_env()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_seconds)
        dist.init_process_group(
            backend=env.backend,
            store=_attempt_store(timeout),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=env.device if env.device.type == "cuda" else None,
        )
    return env


def _attempt_store(timeout: datetime.timedelta):
    """The torchrun rendezvous store, under a prefix unique to this restart attempt.

    torchrun keeps its store across ``--max-restarts`` attempts, and the process group
    publishes its addresses under the same keys each time: restarted gloo workers then read a
    dead worker's address and fail to connect (seen with torch 2.13). A per-attempt prefix
    gives every attempt clean keys.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hf_scale/attempt{attempt}", store)
