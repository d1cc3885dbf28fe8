"""The helper processes the calibration measures in: fresh interpreters, clean of launchers.

:mod:`hf_scale.layout_search.calibrate` times gloo collectives between 2 and 4 local processes, and
every core computing at once, in helper processes. They start as
``python -m MODULE KIND RANK WORLD PORT ARG`` (the module calls :func:`serve` under its
``__main__`` guard), not with multiprocessing's spawn, so they work from any caller:

- under torchrun a worker's environment names torchrun's store
  (``TORCHELASTIC_USE_AGENT_STORE``, ``MASTER_PORT``, ``RANK``...): a helper that inherited it
  joined that store as a client and waited forever. Helpers get none of the launcher's
  variables, only their own group's;
- spawn re-imports the caller's ``__main__``: a training script without an
  ``if __name__ == "__main__"`` guard would run again inside every helper.

A helper that fails, or helpers that outlive their deadline, raise :class:`HfScaleError` naming
the measurement and the helper's last words, and every helper is killed.

Usage::

    [result] = run_helpers("hf_scale.layout_search.calibrate", "collectives", world=2, timeout=300,
                           what="the 2-process gloo measurement")
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from ..errors import HfScaleError


def helper_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This process's environment without any launcher's variables, with the helper group's own
    (``LOCAL_WORLD_SIZE`` included: the helpers are one node), one compute thread, and this
    hf_scale first on the path (the helpers run in an empty folder: no checkout there shadows it)."""
    from ..distributed import LAUNCHER_VARS

    drop = set(LAUNCHER_VARS) | {v for v in os.environ if v.startswith("TORCHELASTIC_")}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds hf_scale/
    path = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def run_helpers(module: str, kind: str, world: int, timeout: float, what: str, arg: float = 0.0) -> list[dict]:
    """Run ``world`` helpers of ``module``'s ``kind`` as one gloo group; every result a helper
    printed (rank order). Raises :class:`HfScaleError` when one exits non-zero or ``timeout``
    seconds pass."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hf_scale_calibration_") as tmp, contextlib.ExitStack() as files:
        logs = [files.enter_context(open(os.path.join(tmp, f"rank{r}.log"), "w+")) for r in range(world)]
        outs = [files.enter_context(open(os.path.join(tmp, f"rank{r}.json"), "w+")) for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", module, kind, str(r), str(world), str(port), repr(arg)],
                                  env=helper_env(r, world, port), stdin=subprocess.DEVNULL, stdout=outs[r],
                                  stderr=logs[r], cwd=tmp)
                 for r in range(world)]
        try:
            _wait(procs, logs, timeout, what)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        results = []
        for out in outs:
            out.seek(0)
            results += [json.loads(line) for line in out.read().splitlines() if line.strip()]
        return results


def _wait(procs: list[subprocess.Popen], logs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
        if not failed and all(code == 0 for code in codes):
            return
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if failed:
        r = failed[0]
        logs[r].seek(0)
        tail = " | ".join(logs[r].read().strip().splitlines()[-3:]) or "no output"
        reason = f"helper process {r} exited with code {procs[r].returncode} ({tail})"
    else:
        reason = f"no result within {timeout:.0f} s"
    raise HfScaleError(
        f"the planner's calibration of this machine failed: {what}: {reason}. Retry, or skip the "
        "measurement: give the layout (strategy fsdp, ddp, ...) instead of 'auto', or copy a "
        "calibration.json made on a machine like this one to $XDG_CACHE_HOME/hf_scale/ (default "
        "~/.cache/hf_scale/)."
    )


def serve(functions: dict) -> None:
    """A helper process's body (``sys.argv``: KIND RANK WORLD PORT ARG): join the helpers' gloo
    group, run ``functions[KIND](rank, world, arg)``, print its result (JSON) if not None."""
    import torch
    import torch.distributed as dist

    from ..distributed import shutdown_distributed

    kind, rank, world, port, arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = functions[kind](rank, world, arg)
    finally:
        shutdown_distributed()
    if result is not None:
        print(json.dumps(result), flush=True)
