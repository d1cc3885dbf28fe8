"""Start a job's workers with torchrun: the command line ``hf-scale finetune`` runs.

``torchrun`` (``python -m torch.distributed.run``) is the launcher on one machine and many; this
module only turns a :class:`LaunchConfig` into its arguments and checks them first, so a
mistake fails here with one message instead of in every worker. It runs as
``python -m hf_scale.torchrun``, which says a clear error found in the workers once. Under SLURM (``srun``, one
task per node) the node count, node rank and rendezvous host come from the srun step's
variables (:func:`resolve_launch`; an salloc shell or a batch script is no step, see
:func:`srun_step`); see ``scripts/slurm_finetune.sbatch``.

Usage::

    launch = resolve_launch(job.launch)
    argv = torchrun_argv(launch, ["-m", "hf_scale.cli", "finetune", "configs/quickstart.yaml"])
    subprocess.call(argv)
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import torch

from .distributed import launched_worker, mpi_ranks
from .errors import HfScaleConfigError
from .train.config import LaunchConfig

SLURM_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# Step ids from here up are Slurm's own steps (batch script, extern, interactive), never srun's.
SLURM_SPECIAL_STEPS = 0xFFFFFFF0


def srun_step(environ=None) -> tuple[int, int] | None:
    """``(tasks, nodes)`` of the ``srun`` job step this process is a task of; None outside one.

    ``srun`` gives its tasks ``SLURM_STEP_ID``, ``SLURM_STEP_NUM_TASKS`` and
    ``SLURM_STEP_NUM_NODES``. An ``salloc`` shell and ``sbatch``'s batch script also carry the
    allocation's ``SLURM_NNODES`` / ``SLURM_NTASKS`` / ``SLURM_NODEID`` / ``SLURM_PROCID``, but no
    srun started them: there those variables describe the allocation, not this process, and
    are never read as a layout (a job started there runs on this node, or under mpirun).
    """
    env = os.environ if environ is None else environ
    try:
        step = int(env["SLURM_STEP_ID"])
        tasks = int(env["SLURM_STEP_NUM_TASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
    except (KeyError, ValueError):
        return None
    return None if step >= SLURM_SPECIAL_STEPS else (tasks, nodes)


def under_torchrun(environ=None) -> bool:
    """True inside a worker that torchrun (or mpirun) started: it trains, it launches nothing.

    ``srun`` with one task per node may also set ``PMI_RANK`` (its pmi2 plugin: ``PMI_RANK`` =
    ``SLURM_PROCID``, ``PMI_SIZE`` = the step's tasks): those tasks are torchrun agents, not
    workers. Ranks that an mpiexec started inside an allocation are workers.
    """
    env = os.environ if environ is None else environ
    if mpi_ranks(env) is not None and _srun_task_per_node(env):
        return False
    return launched_worker(env)


def _srun_task_per_node(env) -> bool:
    step = srun_step(env)
    return (step is not None and step[0] == step[1] and env.get("PMI_RANK") == env.get("SLURM_PROCID")
            and env.get("PMI_SIZE") == str(step[0]))


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list -> host names, in order: ``"node[01-03,07],gpu1"`` ->
    ``["node01", "node02", "node03", "node07", "gpu1"]`` (zero padding kept; what
    ``scontrol show hostnames`` prints)."""
    hosts: list[str] = []
    items = re.findall(r"(?:[^,\[\]]|\[[^\[\]]*\])+", nodelist)
    if ",".join(items) != nodelist:  # an unclosed or stray bracket
        items = []
    for item in items:
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text + n for n in _expand_ranges(ranges, nodelist)] if ranges else [text]
            expanded = [e + c for e in expanded for c in choices]
        hosts += expanded
    if not hosts or any(not h or "[" in h or "]" in h for h in hosts):
        raise HfScaleConfigError(f"cannot read the SLURM node list {nodelist!r}: expected e.g. node[01-04,07].")
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise HfScaleConfigError(f"cannot read the SLURM node list {nodelist!r}: {part!r} is not N or N-M.")
        first, last = match.group(1), match.group(2) or match.group(1)
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def resolve_launch(launch: LaunchConfig, environ=None) -> LaunchConfig:
    """``launch`` with SLURM's layout filled in when ``srun`` started this process, one task on
    each of several nodes.

    Only inside an srun step (:func:`srun_step`): nodes from ``SLURM_STEP_NUM_NODES``, node
    rank from ``SLURM_PROCID`` (the task's rank, which with one task per node is the node's),
    the rendezvous on the first host of the step's node list at ``MASTER_PORT`` (default
    ``20000 + SLURM_JOB_ID % 10000``, the same on every node), static rendezvous. A recipe that
    sets ``launch.nnodes`` > 1 or ``launch.rdzv_endpoint`` keeps its own values. Outside a step
    (an salloc shell, sbatch's batch script) and in workers nothing changes. A step with more
    tasks than nodes is refused: every task would start its own torchrun.
    """
    env = os.environ if environ is None else environ
    step = srun_step(env)
    if step is None or under_torchrun(env):
        return launch
    tasks, nodes = step
    if tasks != nodes:
        raise HfScaleConfigError(
            f"srun started {tasks} tasks on {nodes} node(s) (SLURM_STEP_NUM_TASKS={tasks}, "
            f"SLURM_STEP_NUM_NODES={nodes}), and each would start its own torchrun: run one "
            "hf-scale finetune per node (srun --ntasks-per-node=1, as scripts/slurm_finetune.sbatch "
            "does); --launch.nproc_per_node sets the workers per node."
        )
    nodelist = next((env[v] for v in SLURM_NODELIST if v in env), None)
    node_rank = env.get("SLURM_PROCID", env.get("SLURM_NODEID"))
    if nodes == 1 or nodelist is None or node_rank is None or launch.nnodes > 1 or launch.rdzv_endpoint:
        return launch
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 10000)
    return dataclasses.replace(
        launch, nnodes=nodes, node_rank=int(node_rank),
        rdzv_endpoint=f"{expand_nodelist(nodelist)[0]}:{port}", rdzv_backend="static",
    )


CPU_PROCESSES_PER_CORE = 4


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def max_local_processes() -> tuple[int, str]:
    """How many workers this machine can run, and what limits it: one per GPU; without a GPU,
    gloo processes may share cores (tp=3 on a 2-core machine runs, slowly), up to
    ``CPU_PROCESSES_PER_CORE`` per core."""
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU(s)"
    cores = cpu_cores()
    return CPU_PROCESSES_PER_CORE * cores, f"slots ({cores} CPU core(s) x {CPU_PROCESSES_PER_CORE}, no GPU)"


def warn_if_oversubscribed(processes: int) -> None:
    """A warning when CPU processes outnumber the cores (they share them: each step is slower)."""
    if not torch.cuda.is_available() and processes > cpu_cores():
        import logging

        from .log import log_rank0

        log_rank0(f"{processes} processes share {cpu_cores()} CPU core(s): it runs, slowly.", level=logging.WARNING)


def check_local_processes(processes: int, name: str, flag: str) -> None:
    """Refuse more processes per node than this machine can run (``name``: the setting, ``flag``:
    how to set it); warn when CPU processes will share cores."""
    limit, what = max_local_processes()
    if processes > limit:
        raise HfScaleConfigError(
            f"{name}={processes}, but this machine has {limit} {what}: "
            f"start at most {limit} processes per node ({flag} {limit})."
        )
    warn_if_oversubscribed(processes)


def check_launch(launch: LaunchConfig) -> None:
    """Refuse layouts this machine or torchrun cannot start, naming the value and the fix."""
    check_local_processes(launch.nproc_per_node, "launch.nproc_per_node", "--launch.nproc_per_node")
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
    """``python -m hf_scale.torchrun <options> <worker...>`` for this launch config: torchrun,
    whose report of workers that stopped on a clear error is their one line (:mod:`hf_scale.torchrun`);
    ``argv[3:]`` are torchrun's arguments."""
    check_launch(launch)
    argv = [sys.executable, "-m", "hf_scale.torchrun",
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
