"""Start a job's workers with torchrun: the command line ``hf-scale finetune`` runs.

``torchrun`` (``python -m torch.distributed.run``) is the launcher on one machine and many; this
module only turns a :class:`LaunchConfig` into its arguments and checks them first, so a
mistake fails here with one message instead of in every worker.

Usage::

    argv = torchrun_argv(job.launch, ["-m", "hf_scale.cli", "finetune", "configs/quickstart.yaml"])
    subprocess.call(argv)
"""

from __future__ import annotations

import os
import sys

import torch

from .errors import HfScaleConfigError
from .train.config import LaunchConfig

UNDER_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def under_torchrun(environ=None) -> bool:
    """True inside a worker that torchrun (or an equivalent launcher) started."""
    env = os.environ if environ is None else environ
    return all(v in env for v in UNDER_TORCHRUN)


def max_local_processes() -> tuple[int, str]:
    """How many workers this machine can run, and what limits it (GPUs, else CPU cores)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU(s)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores, "CPU core(s) and no GPU"


def check_launch(launch: LaunchConfig) -> None:
    """Refuse layouts this machine or torchrun cannot start, naming the value and the fix."""
    limit, what = max_local_processes()
    if launch.nproc_per_node > limit:
        raise HfScaleConfigError(
            f"launch.nproc_per_node={launch.nproc_per_node}, but this machine has {limit} {what}: "
            f"start at most {limit} processes per node (--launch.nproc_per_node {limit})."
        )
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise HfScaleConfigError(
            f"launch.nnodes={launch.nnodes} needs launch.rdzv_endpoint (host:port of node 0, "
            "reachable from every node), e.g. --launch.rdzv_endpoint 10.0.0.1:29400."
        )
    if launch.rdzv_endpoint and ":" not in launch.rdzv_endpoint:
        raise HfScaleConfigError(
            f"launch.rdzv_endpoint={launch.rdzv_endpoint!r}: expected host:port, e.g. 127.0.0.1:29400."
        )
    if not 0 <= launch.node_rank < launch.nnodes:
        raise HfScaleConfigError(
            f"launch.node_rank={launch.node_rank} is outside 0..{launch.nnodes - 1} (launch.nnodes={launch.nnodes})."
        )


def torchrun_argv(launch: LaunchConfig, worker: list[str]) -> list[str]:
    """``python -m torch.distributed.run <options> <worker...>`` for this launch config."""
    check_launch(launch)
    argv = [sys.executable, "-m", "torch.distributed.run",
            f"--nproc-per-node={launch.nproc_per_node}", f"--nnodes={launch.nnodes}",
            f"--max-restarts={launch.max_restarts}"]
    if launch.nnodes == 1 and not launch.rdzv_endpoint:
        argv.append("--standalone")  # a private rendezvous on a free local port
    elif launch.rdzv_backend == "static":
        host, port = launch.rdzv_endpoint.rsplit(":", 1)
        argv += [f"--node-rank={launch.node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={launch.rdzv_endpoint}", f"--rdzv-id={launch.rdzv_id}"]
    return argv + worker
