"""The one multi-process harness: run a function on N ranks of a CPU/gloo process group.

Each rank is a fresh process (spawn) with the variables torchrun would set, so the code under
test starts its process group exactly as under torchrun. Results come back pickled (tensors as
numpy arrays). A rank that raises fails the call with its traceback; ranks that do not finish
within ``timeout`` seconds (a hung collective) are killed and the call raises, so a hang fails
one test instead of CI.

The ranks of a world size are started once per test session and reused by every call with
torchrun's variables (a pool: spawning and importing torch + transformers costs 5-10 s per
group on 2 cores); each call still gets a new process group on a new port, torn down after it,
and the environment as it was. A call that fails or hangs ends its pool: the next call starts
fresh processes. Calls with their own ``env`` or ``launcher`` get fresh processes, as before.

Usage::

    results = run_ranks(my_module.worker, 2, case_list, timeout=300)   # one entry per rank
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_plain(value: Any) -> Any:
    """Tensors (DTensors gathered beforehand) -> numpy, recursively, so they pickle simply."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().float().numpy() if value.is_floating_point() else value.cpu().numpy()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(v) for v in value)
    return value


def torchrun_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives a worker on one node."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def mpirun_vars(rank: int, world: int, port: int) -> dict[str, str]:
    """What Open MPI's mpirun gives a process (plus the rendezvous address): no RANK."""
    return dict(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
                OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _child(fn, rank, world, port, args, env, results, launcher=torchrun_vars) -> None:
    from hf_scale.distributed import LAUNCHER_VARS, shutdown_distributed

    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)
    os.environ.update(env)
    os.environ.update(launcher(rank, world, port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        out = to_plain(fn(*args))
        pickle.dumps(out)  # here, reported; the queue pickles in a thread that drops the result
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        shutdown_distributed()


def _pool_child(rank, world, tasks, results) -> None:
    """A pooled rank: run each task (fn, port, args, the caller's environment) as :func:`_child`
    would, until None."""
    import warnings

    import torch

    import hf_scale.log

    torch.set_num_threads(1)
    filters, seed = list(warnings.filters), torch.initial_seed()  # as a fresh process has them
    while (task := tasks.get()) is not None:
        fn, port, args, environ = task
        # what a fresh process would start with: the caller's environment, the warning filters,
        # torch's initial seed and default dtype, no once-only log line said yet
        os.environ.clear()
        os.environ.update(environ)
        warnings.filters[:] = filters
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        hf_scale.log._said.clear()
        _child(fn, rank, world, port, args, {}, results)


class _Pool:
    """``world`` ranks started once, each with its own task queue; one shared result queue."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_pool_child, args=(r, world, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def close(self, kill: bool) -> None:
        for q, p in zip(self.tasks, self.procs):
            if not kill and p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=0.5 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


def close_pools() -> None:
    """End every pooled rank (the session's end; conftest calls it)."""
    while _POOLS:
        _POOLS.popitem()[1].close(kill=False)


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 600, env: dict | None = None,
    launcher: Callable[[int, int, int], dict] = torchrun_vars, fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's result, rank order.

    ``launcher(rank, world, port)`` gives each process its variables: torchrun's by default,
    :func:`mpirun_vars` to start the ranks as mpirun would. ``fresh``: new processes rather than
    the pool's (for code that reads the environment when first imported, e.g. the Hub's address)."""
    port = free_port()
    pool = None
    if not fresh and env is None and launcher is torchrun_vars:
        task = (fn, port, args, dict(os.environ))
        ForkingPickler.dumps(task)  # here, not in the queue's feeder thread (which drops what fails)
        pool = _POOLS.get(world_size) or _POOLS.setdefault(world_size, _Pool(world_size))
        results, procs = pool.results, pool.procs
        for q in pool.tasks:
            q.put(task)
    else:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, args, dict(env or {}), results, launcher),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                    "(a hung collective?); all ranks were killed"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead and all(p.exitcode not in (None, 0) for p in (procs[r] for r in dead)):
                    raise RuntimeError(f"ranks {dead} died with exit codes "
                                       f"{[procs[r].exitcode for r in dead]} before reporting")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = value
    finally:
        if pool is not None:
            if len(out) < world_size:  # a rank failed or hung: the others may wait in a collective
                _POOLS.pop(world_size, None)
                pool.close(kill=True)
        else:
            for p in procs:
                p.join(timeout=10 if len(out) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]


ROOT = Path(__file__).resolve().parents[1]


def merge_ranks(per_rank: list[list[dict]], same: tuple[str, ...] = ()) -> list[dict]:
    """Each case's results of every rank as one: rank 0's, or ``{"error": ...}`` naming each rank
    that reported an error (the *_checks runners catch a case's exception into its result so the
    group goes on: a test reading rank 0's alone never sees rank 1's) or whose ``same`` figures
    (global ones, e.g. all-reduced losses) differ from rank 0's by more than 1e-6 relative.
    ``per_rank``: ``run_ranks``' answer, a list of per-case results per rank. For checks whose
    rank 0 stands for all (global figures, parameters gathered whole); where the ranks hold
    different parts (pipeline stages, shards) the test must compare each rank's.

    What no result can show: a case that raises on one rank while another waits in a collective
    leaves the ranks out of step; the next case's collectives pair with the pending ones, and gloo
    aborts the process (SIGABRT, "Received data size doesn't match expected size") or the call
    times out: ``run_ranks`` then reports a dead or hung rank, not the case (measured with a
    rank-1-only raise at the start of a test_reward case: "ranks [1] died with exit codes [-6]")."""
    import numpy as np

    merged = []
    for results in zip(*per_rank, strict=True):
        problems = [f"rank {rank}: {r['error']}" for rank, r in enumerate(results) if "error" in r]
        if not problems:
            for rank, r in enumerate(results[1:], 1):
                for key in same:
                    if not np.allclose(r[key], results[0][key], rtol=1e-6, atol=0):
                        problems.append(f"rank {rank}: {key} {r[key]} but rank 0 {results[0][key]}")
        merged.append({"error": "\n".join(problems)} if problems else results[0])
    return merged


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a command under test: offline, one thread, no inherited launcher
    variables (torchrun's or mpirun's), then ``extra``."""
    from hf_scale.distributed import LAUNCHER_VARS

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in LAUNCHER_VARS:
        env.pop(var, None)
    return {**env, **(extra or {})}


def start_command(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own process group (so torchrun and its workers die together);
    ``env`` adds variables (e.g. SLURM's) to :func:`cli_env`."""
    return subprocess.Popen(argv, cwd=ROOT, env=cli_env(env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish_command(proc: subprocess.Popen, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    """Wait for ``proc``; kill its whole group and fail the test if it outlives ``timeout``."""
    shown = " ".join(proc.args[1:])
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shown} did not finish in {timeout} s:\n{out[-3000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"{shown} exited {proc.returncode}:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def run_cli(*args: str, script: str | None = None, timeout: float = 300, check: bool = True):
    """``python -m hf_scale.cli *args`` (or ``python <script> *args``); output merged in stdout."""
    entry = [script] if script else ["-m", "hf_scale.cli"]
    return finish_command(start_command([sys.executable, *entry, *args]), timeout, check)


def run_commands(argvs: list[list[str]], timeout: float = 300, check: bool = False,
                 at_once: int = 2) -> list[subprocess.CompletedProcess]:
    """Each of ``argvs`` as :func:`start_command` starts it, ``at_once`` at a time; their results
    in order (``check``: fail the test when one exits non-zero, as :func:`finish_command`). For
    commands that are mostly process starts and imports, one core each: on 2 cores two at a time
    take about half as long."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        return list(pool.map(lambda argv: finish_command(start_command(argv), timeout, check), argvs))


# A stand-in for this machine's planner calibration (hf_scale.layout_search.calibrate measures it in
# seconds with a 2-process gloo run; tests use fixed numbers of this machine's order instead).
STAND_IN_CALIBRATION = {"flops_fp32": 3e10, "flops_bf16": 1e9, "mem_bandwidth": 5e9,
                        "allreduce_bus_bytes_per_s": 5e8, "allreduce_latency_s": 4e-4, "threads": 1, "cpus": 2}


def stand_in_calibration(cache_home: Path) -> dict[str, str]:
    """Write :data:`STAND_IN_CALIBRATION` where ``cpu_device()`` reads it under
    ``XDG_CACHE_HOME=cache_home``; returns that variable for a command's environment."""
    import json

    from hf_scale.layout_search.machine import CALIBRATION_VERSION

    (cache_home / "hf_scale").mkdir(parents=True, exist_ok=True)
    (cache_home / "hf_scale" / "calibration.json").write_text(
        json.dumps({**STAND_IN_CALIBRATION, "version": CALIBRATION_VERSION}))
    return {"XDG_CACHE_HOME": str(cache_home)}
