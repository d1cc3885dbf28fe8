"""What the benchmark scripts share: RSS sampling, a free port, launching ranks and collecting
their JSON results with one failure reason per leg, running a command while sampling its process
tree (CPU seconds, RSS; the kernel's peak RSS at the end), tables with the ratios first, and writing a
table into the docs between section markers (``--write``, see ``scripts/write_doc.py``).

Usage::

    from bench_common import RssSampler, launch_ranks, markdown_table, add_write_arg, write_doc
    results, error = launch_ranks(cmd, out_dir, "leg", world=2, timeout=1800, env=env)
    run = run_sampled(cmd, log_path, timeout=900)   # CPU and RSS of the process tree as it runs
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_doc import write_section

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ measuring inside a rank


def rss_bytes() -> int:
    """This process's resident set size now (psutil)."""
    import psutil

    return psutil.Process().memory_info().rss


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, all cores)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


class RssSampler(threading.Thread):
    """Samples this process's RSS every ``interval`` seconds; :meth:`stop` returns the peak."""

    def __init__(self, interval: float = 0.005):
        import psutil

        super().__init__(daemon=True)
        self.process = psutil.Process()
        self.interval, self.done = interval, threading.Event()
        self.peak = self.process.memory_info().rss

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, self.process.memory_info().rss)


def ran_as(model, note: str) -> tuple[str, bool]:
    """What the prepared model really is, and whether it is a real FSDP run."""
    import torch
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        kind = "DDP (DistributedDataParallel wrapper)"
    elif n_dtensor:
        kind = f"FSDP2 ({units} fully_shard units, {n_dtensor}/{len(params)} params DTensor)"
    elif "replicate" in (_get_registry(model) or {}):
        kind = "DDP (composable replicate)"
    else:
        kind = f"{type(model).__name__}, plain params"
    return f"{kind}; {note}", n_dtensor == len(params) > 0


# ------------------------------------------------------------------ launching legs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def revision() -> str:
    """Where the measured hf_scale lives and its commit, with '+dirty:HASH' if hf_scale/ has
    changes (HASH of the diff, so two different edits read differently)."""
    import importlib.util

    root = str(Path(importlib.util.find_spec("hf_scale").origin).parent.parent)
    run = functools.partial(subprocess.run, capture_output=True, text=True)
    git = lambda *a: run(["git", "-C", root, *a]).stdout
    commit = git("rev-parse", "--short", "HEAD").strip() or "(no git)"
    changes = git("status", "--porcelain", "--", "hf_scale") + git("diff", "HEAD", "--", "hf_scale")
    digest = hashlib.sha1(changes.encode()).hexdigest()[:8]
    return f"{root} {commit}" + (f"+dirty:{digest}" if changes else "")


def failure_reason(log: str, returncode) -> str:
    """One line saying why a leg failed: the last ``...Error: ...`` line of its log, else the code."""
    # Python names an exception outside builtins with its module: hf_scale.errors.HfScaleConfigError
    pattern = r"^\s*(?:\[rank\d+\]:\s*)?(?:\w+\.)*(\w*(?:Error|Exception)\b:? .*)$"
    errors = re.findall(pattern, log, re.MULTILINE)
    reason = errors[-1].strip() if errors else f"exit code {returncode}"
    return "failed: " + (reason[:160] + "..." if len(reason) > 160 else reason)


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
               cwd: Path | None = None) -> str | None:
    """Run ``cmd`` (its own process group) with its output in ``log_path``: None when it exited 0,
    else one failure reason. On timeout the whole group is killed, so no rank is left behind."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timeout after {timeout:.0f}s"
    return None if code == 0 else failure_reason(log_path.read_text(errors="replace"), code)


class TreeRun:
    """What :func:`run_sampled` saw of a command's process tree: ``samples`` of (wall time,
    CPU seconds of the tree's live processes, summed RSS bytes, the whole machine's busy CPU
    seconds), ``peak_tree_rss`` (the largest sum), ``maxrss`` (the kernel's ``ru_maxrss`` of the
    command and the descendants it waited for: the peak RSS of its largest process, bytes) and
    ``error`` (None, or why it failed)."""

    def __init__(self):
        self.samples: list[tuple[float, float, int, float]] = []
        self.peak_tree_rss, self.maxrss, self.error = 0, 0, None

    def cpu_between(self, start: float, end: float) -> float:
        """CPU seconds the tree spent between two wall times (``time.time()``), interpolated
        between samples."""
        return cpu_at(self.samples, end) - cpu_at(self.samples, start)

    def others_between(self, start: float, end: float) -> float:
        """Cores that other processes kept busy between two wall times: the machine's busy CPU
        seconds less the tree's, over the wall time."""
        machine = cpu_at(self.samples, end, 3) - cpu_at(self.samples, start, 3)
        return max(machine - self.cpu_between(start, end), 0.0) / max(end - start, 1e-9)


def cpu_at(samples: list[tuple], when: float, field: int = 1) -> float:
    """A cumulative CPU-seconds field of the samples (1: the tree's, 3: the machine's) at wall
    time ``when``, linear between the samples around it."""
    if not samples:
        return 0.0
    if when <= samples[0][0]:
        return samples[0][field]
    for a, b in itertools.pairwise(samples):
        if a[0] <= when <= b[0]:
            return a[field] + (b[field] - a[field]) * ((when - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 1.0)
    return samples[-1][field]


def wait_for_quiet(max_wait: float, cores: float = 0.5, window: float = 5.0) -> tuple[float, float]:
    """Wait until other processes keep fewer than ``cores`` CPUs busy (measured over ``window``
    seconds; call it between legs, when this script runs nothing), at most ``max_wait``
    seconds. Returns (the busy cores last measured, the seconds waited)."""
    import psutil

    began = time.monotonic()
    while True:
        busy = psutil.cpu_percent(interval=window) / 100 * (os.cpu_count() or 1)
        waited = time.monotonic() - began
        if busy < cores or waited >= max_wait:
            return busy, waited


def _tree(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and summed RSS of ``pid`` and its live descendants."""
    import psutil

    cpu, rss = 0.0, 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return cpu, rss
    for proc in procs:
        try:
            with proc.oneshot():
                times, mem = proc.cpu_times(), proc.memory_info()
        except psutil.Error:
            continue
        cpu += times.user + times.system
        rss += mem.rss
    return cpu, rss


def run_sampled(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
                cwd: Path | None = None, interval: float = 0.25, on_sample=None) -> TreeRun:
    """:func:`run_logged`, sampling the command's process tree every ``interval`` seconds
    (psutil: CPU seconds, summed RSS) and reading the kernel's peak RSS of the tree's largest
    process when it ends (``os.wait4``). ``on_sample(now)`` is called after every sample (e.g.
    to note when a metrics file grows)."""
    run = TreeRun()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline, code = time.monotonic() + timeout, None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                proc.returncode = code  # reaped here: Popen must not wait for it again
                run.maxrss = usage.ru_maxrss * 1024  # KiB on Linux
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                _, _, usage = os.wait4(proc.pid, 0)
                proc.returncode, code = -signal.SIGKILL, f"timeout after {timeout:.0f}s"
                break
            now = time.time()
            cpu, rss = _tree(proc.pid)
            run.samples.append((now, cpu, rss, busy_cpu_seconds()))
            run.peak_tree_rss = max(run.peak_tree_rss, rss)
            if on_sample is not None:
                on_sample(now)
            time.sleep(interval)
    if code != 0:
        run.error = failure_reason(log_path.read_text(errors="replace"), code)
    return run


def torchrun(script: str, world: int, *args: str) -> list[str]:
    """The command that runs ``script`` on ``world`` local ranks, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args]


def launch_ranks(cmd: list[str], out_dir: Path, name: str, world: int, timeout: float,
                 env: dict | None = None) -> tuple[list[dict], str | None]:
    """Run ``cmd``, whose ranks each write ``out_dir/NAME.rankR.json`` with a ``status`` key
    (``"ok"`` or why not); return the ranks' results and None, or what there is and one reason.
    Results an earlier launch of ``name`` left are removed first: a rank that writes none fails."""
    paths = [out_dir / f"{name}.rank{r}.json" for r in range(world)]
    for path in paths:
        path.unlink(missing_ok=True)
    error = run_logged(cmd, out_dir / f"{name}.log", timeout, env)
    results = [json.loads(p.read_text()) for p in paths if p.exists()]
    status = next((r.get("status") for r in results if r.get("status") != "ok"), None)
    if status or error or len(results) < world:
        return results, status or error or f"failed: {world - len(results)} rank(s) wrote no result"
    return results, None


# ------------------------------------------------------------------ reporting


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; short rows (a failed leg: name and reason) are padded with empty cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(list(r) + [""] * (len(header) - len(r))) + " |" for r in rows]
    return "\n".join(lines)


def machine() -> str:
    """Date, CPU count, RAM and library versions, for the line under a written table."""
    import psutil
    import torch

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    ram = psutil.virtual_memory().total / 2**30
    return (f"{now}; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{ram:.0f} GiB RAM; torch {torch.__version__}; python {platform.python_version()}; "
            f"load average {os.getloadavg()[0]:.2f} at the end")


def command_line() -> str:
    """The command that ran this script, as a user would type it from the repository root."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return shlex.join(["python", script, *sys.argv[1:]])


def add_write_arg(parser, section: str) -> None:
    parser.add_argument("--write", metavar="DOC", help="replace the section between "
                        "<!-- bench:SECTION:start/end --> markers in DOC (e.g. docs/benchmarks.md) "
                        "with what this run printed")
    parser.add_argument("--section", default=section, help=f"the section to write (default {section})")


def write_doc(args, body: str, note: str = "") -> None:
    """With ``--write DOC``: put ``body`` (what the run printed) into DOC's section, under a line
    with the date, the machine and the exact command. Checked before the run by :func:`check_doc`."""
    if not args.write:
        return
    header = f"Written by `{command_line()}` on {machine()}." + (f" {note}" if note else "")
    write_section(args.write, args.section, f"{header}\n\n{body.strip()}\n")
    print(f"wrote section {args.section!r} of {args.write}")


def check_doc(args) -> None:
    """Fail before a long run, not after it, when ``--write``'s document lacks the markers."""
    if args.write:
        from write_doc import replace_section

        replace_section(Path(args.write).read_text(encoding="utf-8"), args.section, "")
