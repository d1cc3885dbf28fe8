"""The process group: read the launcher's environment, check it, start ``torch.distributed``.

torchrun sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; ``mpirun`` (Open MPI, also under
``accelerate``'s multi-CPU mode) sets ``OMPI_COMM_WORLD_*``, and MPICH / Intel MPI (and
``srun --mpi=pmi2``) set ``PMI_RANK`` / ``PMI_SIZE``: this is the one module that reads them. CUDA + NCCL when this
process can see a GPU, CPU + gloo otherwise. Nothing here knows about models;
:func:`hf_scale.parallelize` calls :func:`init_distributed` before building the mesh, and every
process hf_scale starts ends with :func:`shutdown_distributed`.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import HfScaleConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# (launcher, rank, size, local rank candidates, local size candidates), read when RANK is absent.
# srun's PMI sets no MPI local rank: its tasks read SLURM_LOCALID, and their count on this node
# from SLURM_STEP_TASKS_PER_NODE (read last, so a hydra mpiexec's own variables win).
MPI_VARS = (
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE",
     ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "SLURM_LOCALID"),
     ("MPI_LOCALNRANKS", "PALS_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE")),
)
# Set by hf_scale.layout_search.simulate only: "fake" runs this process as one rank of a simulated
# world (torch's fake process group, no communication); the device is chosen as on a real run.
BACKEND_VAR = "HF_SCALE_BACKEND"
# Every variable that makes a process a worker of some launcher (tests clear them all).
LAUNCHER_VARS = TORCHRUN_VARS + ("LOCAL_WORLD_SIZE", BACKEND_VAR) + tuple(
    v for _, r, s, lr, ls in MPI_VARS for v in (r, s, *lr, *ls)
)


def mpi_ranks(env: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """``(launcher, {"RANK": .., "WORLD_SIZE": .., "LOCAL_RANK": .., "LOCAL_WORLD_SIZE": ..})``
    from an MPI launcher's variables, when torchrun's ``RANK`` is absent; else None.

    Without a local rank variable the processes are taken to share one node. Under ``srun``'s
    PMI the local rank is ``SLURM_LOCALID``, the local size this node's entry of
    ``SLURM_STEP_TASKS_PER_NODE``.
    """
    if "RANK" in env:
        return None
    for launcher, rank, size, local_ranks, local_sizes in MPI_VARS:
        if rank in env and size in env:
            local_rank = next((env[v] for v in local_ranks if v in env), env[rank])
            size_var = next((v for v in local_sizes if v in env), size)
            local_size = slurm_tasks_on_node(env) if size_var == "SLURM_STEP_TASKS_PER_NODE" else env[size_var]
            return launcher, {"RANK": env[rank], "WORLD_SIZE": env[size],
                              "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_size}
    return None


def slurm_tasks_on_node(env: Mapping[str, str]) -> str:
    """This node's task count from ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2),3"``: 4, 4, 3 tasks on
    the step's nodes, indexed by ``SLURM_NODEID``); the value as given when it is unreadable, so
    :func:`read_env` names it in its error."""
    value = env["SLURM_STEP_TASKS_PER_NODE"]
    counts = []
    for part in value.split(","):
        count, _, repeat = part.strip().partition("(x")
        if not count.isdigit() or not (repeat == "" or repeat[:-1].isdigit() and repeat.endswith(")")):
            return value
        counts += [count] * (int(repeat[:-1]) if repeat else 1)
    node = env.get("SLURM_NODEID", "0")
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else counts[0]


def launched_worker(environ: Mapping[str, str] | None = None) -> bool:
    """True in a worker process that torchrun or mpirun started (it trains; it launches nothing)."""
    env = os.environ if environ is None else environ
    return all(v in env for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) or mpi_ranks(env) is not None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """The global rank the launcher gave this process (0 when none did, or it is unreadable)."""
    env = os.environ if environ is None else environ
    mpi = mpi_ranks(env)
    value = mpi[1]["RANK"] if mpi else env.get("RANK", "0")
    try:
        return int(value or 0)
    except ValueError:
        return 0


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: ranks, sizes and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    simulated: bool = False  # one rank of a simulated world: torch's fake process group

    @property
    def backend(self) -> str:
        if self.simulated:
            return "fake"
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read and check the launcher's variables (torchrun's, else mpirun's); world size 1 when
    none are set.

    Raises :class:`HfScaleConfigError` before any collective when the variables are partial
    or inconsistent (``RANK`` without ``WORLD_SIZE``, a rank outside the world, no
    ``MASTER_ADDR`` under mpirun, ...).
    """
    env = os.environ if environ is None else environ
    mpi = mpi_ranks(env)
    launcher = "torchrun"
    if mpi is not None:
        launcher, ranks = mpi
        env = {**env, **ranks}
    present = [v for v in TORCHRUN_VARS if v in env]
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(env.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count() or world)))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    elif not set(present) - {"MASTER_ADDR", "MASTER_PORT"} or (  # an exported port alone: one process
        present == ["LOCAL_RANK"] and env["LOCAL_RANK"] == "0") or (mpi is not None and env["WORLD_SIZE"] == "1"
    ):
        world, rank, local_rank, local_world = 1, 0, 0, 1
    else:
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing and mpi is not None:
            raise HfScaleConfigError(
                f"{launcher} set this process's rank, but {', '.join(missing)} missing: the "
                "processes meet at MASTER_ADDR:MASTER_PORT (rank 0's host and a free port). Set "
                "them for every process, e.g. `mpirun -x MASTER_ADDR=<host of rank 0> -x "
                "MASTER_PORT=29500 ...`."
            )
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
            raise HfScaleConfigError(f"{launcher} variable is not an integer: {e}") from None
        if world < 1 or not 0 <= rank < world:
            raise HfScaleConfigError(
                f"RANK={rank} is outside WORLD_SIZE={world} ({launcher}): ranks run 0..WORLD_SIZE-1."
            )
        if not 0 <= local_rank < local_world:
            raise HfScaleConfigError(
                f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world} ({launcher})."
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
    return DistEnv(rank, world, local_rank, local_world, device, _simulated(env))


def _simulated(env: Mapping[str, str]) -> bool:
    """Whether ``HF_SCALE_BACKEND`` asks for the fake process group (set by ``simulate`` only)."""
    value = env.get(BACKEND_VAR)
    if value in (None, ""):
        return False
    if value != "fake":
        raise HfScaleConfigError(
            f"{BACKEND_VAR}={value!r}: the only value is 'fake' (a simulated world, set by "
            "hf_scale.layout_search.simulate); unset it for a real run."
        )
    return True


def init_distributed(timeout_seconds: int = 1800) -> DistEnv:
    """Start the default process group if a launcher asked for one and it is not started yet.

    Returns the :class:`DistEnv`. In one process (no launcher variables) no group is made.
    A gloo group started here is also shut down at interpreter exit (``atexit``) when the script
    did not call :func:`shutdown_distributed` itself: left to interpreter teardown, a finished
    worker aborted about once in a hundred runs. Not for NCCL: destroying a group whose
    collective hung (an exception on the way out) can block, and NCCL's own exit path warns.
    """
    env = read_env()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.world_size > 1 and not dist.is_initialized():
        _import_world_readers()
        timeout = datetime.timedelta(seconds=timeout_seconds)
        dist.init_process_group(
            backend=env.backend,
            store=_fake_store() if env.simulated else _attempt_store(env, timeout),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            device_id=env.device if env.device.type == "cuda" and not env.simulated else None,
        )
        if env.backend == "gloo" and not _EXIT_HOOK:
            _EXIT_HOOK.append(atexit.register(shutdown_distributed))
    return env


_EXIT_HOOK: list = []  # shutdown_distributed once registered with atexit (once per process)


def _fake_store():
    """The store of torch's fake process group (registers the ``fake`` backend on import)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _import_world_readers() -> None:
    """Import, before the default group exists, the torch modules that read it at import.

    ``ZeroRedundancyOptimizer``'s module and ``ShardedGradScaler`` take ``dist.group.WORLD`` as
    a default argument. Imported after ``init_process_group`` they keep the group itself, which
    then outlives :func:`shutdown_distributed` (threads, sockets) into interpreter teardown;
    imported first they keep ``None``, which means the same group to every collective.
    """
    import torch.distributed.fsdp.sharded_grad_scaler
    import torch.distributed.optim  # noqa: F401


def _attempt_store(env: DistEnv, timeout: datetime.timedelta):
    """The torchrun rendezvous store, under a prefix unique to this restart attempt.

    torchrun keeps its store across ``--max-restarts`` attempts, and the process group
    publishes its addresses under the same keys each time: restarted gloo workers then read a
    dead worker's address and fail to connect (seen with torch 2.13). A per-attempt prefix
    gives every attempt clean keys.
    """
    # rank and world given: under mpirun RANK / WORLD_SIZE are not in the environment
    store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hf_scale/attempt{attempt}", store)


def shutdown_distributed() -> None:
    """Destroy every process group and let them go now, while the interpreter is whole.

    ``destroy_process_group`` unregisters the groups, but DTensor's sharding caches keep the
    device meshes, and through them the groups with their threads and sockets, alive until
    interpreter teardown. Torn down there, as the peers exit, a worker that had finished its
    job could abort ("terminate called without an active exception": seen once in about a
    hundred 2-process runs on gloo). The caches are cleared first, and the groups' threads
    stop here. Call it once per process at the end, after the last collective.
    """
    if not dist.is_initialized():
        return
    _clear_dtensor_caches()
    dist.destroy_process_group()
    gc.collect()


def _clear_dtensor_caches() -> None:
    """Empty the DTensor caches that hold device meshes (each one that this torch has)."""
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without these: nothing to clear
        return
    _clear_sharding_prop_cache()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
