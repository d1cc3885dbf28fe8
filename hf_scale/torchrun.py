"""torchrun for hf-scale's commands: a worker's clear error is said once, without torchrun's report.

``python -m hf_scale.torchrun <torchrun options> -m hf_scale.cli finetune ...`` runs torchrun's
own agent (``torch.distributed.run``) in this process, with one addition. It makes a folder and
names it to the workers in ``HF_SCALE_ERROR_DIR``. A worker that stops on an
:class:`~hf_scale.errors.HfScaleError` writes its one line there (:func:`file_error`, one file
per rank and restart attempt) instead of printing it, and exits with status 2; a worker whose
own failure came after another rank had filed one (a collective whose peer left) exits 2
quietly (:func:`peer_filed_error`). When every failed worker is one of those, or one the agent
stopped after them (SIGTERM, then SIGKILL), this process prints the distinct lines, once each,
drops torchrun's failure report (the agent's "failed (exitcode ...)" and "Sending process ...
closing signal" lines, the ``ChildFailedError`` traceback) and exits with status 2.

Any other failure (an exception's traceback, a segfault, a signal from elsewhere) is reported
as torchrun reports it, with its exit status, after the lines of any rank that filed one.
The workers' output streams to this process's stdout / stderr as under plain torchrun.
Workers that plain ``torchrun`` started (no ``HF_SCALE_ERROR_DIR``) print their line each, as
before; across nodes each node's launcher says the lines of its own workers.

Usage::

    argv = torchrun_argv(job.launch, ["-m", "hf_scale.cli", "finetune", "recipe.yaml"])
    subprocess.call(argv)          # [python, -m, hf_scale.torchrun, --nproc-per-node=2, ...]
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ERROR_DIR_VAR = "HF_SCALE_ERROR_DIR"
EXIT_BAD_INPUT = 2  # a worker's status after an HfScaleError, and this launcher's then
# how the agent stops the workers that are still running once one has failed
STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)
# the agent's lines (torch.distributed.elastic.multiprocessing.api) that tell of workers failing
# and being stopped: held back until the failure is known to be a clear error or not
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
AGENT_FAILURE_LINES = ("failed (exitcode", "Sending process", "Closing process", "Unable to shutdown",
                       "Process %s did not exit")
_FILE = re.compile(r"rank(\d+)\.attempt(\d+)$")


# ------------------------------------------------------------------ in a worker


def error_line(command: str, error: BaseException) -> str:
    """What ``hf-scale <command>`` prints for a clear error."""
    return f"hf-scale {command}: error: {error}"


def _error_dir() -> Path | None:
    """The folder this worker's launcher reads errors from; None when no such launcher started it."""
    folder = os.environ.get(ERROR_DIR_VAR)
    return Path(folder) if folder and "RANK" in os.environ and Path(folder).is_dir() else None


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def file_error(line: str) -> bool:
    """Give ``line`` (the whole ``hf-scale <command>: error: ...`` line) to the launcher, which
    prints it once for all ranks; False when no hf_scale launcher started this worker (then
    the caller prints it). Written whole (a temporary file renamed into place), so a reader
    never sees half a line; writing it again is harmless."""
    folder = _error_dir()
    if folder is None:
        return False
    path = folder / f"rank{os.environ['RANK']}.attempt{_attempt()}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(line + "\n")
    os.replace(tmp, path)
    return True


@contextlib.contextmanager
def filing_errors(command: str) -> Iterator[None]:
    """File an :class:`~hf_scale.errors.HfScaleError` raised in the body (:func:`file_error`),
    then let it go on: wrap the part of a worker that runs before its process group closes, so
    the line is filed before the other ranks fail on the closed group and look for it."""
    from .errors import HfScaleError

    try:
        yield
    except HfScaleError as e:
        file_error(error_line(command, e))
        raise


def peer_filed_error() -> bool:
    """True when another rank of this attempt (on this node) has filed a clear error: this
    worker's own failure (a collective whose peer left) follows from it and need not be said."""
    folder = _error_dir()
    if folder is None:
        return False
    me = os.environ["RANK"]
    return any(m and m.group(1) != me and m.group(2) == _attempt()
               for m in (_FILE.match(p.name) for p in folder.iterdir()))


# ------------------------------------------------------------------ in the launcher


def filed_errors(folder: Path) -> dict[int, str]:
    """``{rank: line}`` of the last restart attempt that filed any."""
    found = {}
    for path in folder.iterdir():
        match = _FILE.match(path.name)
        if match:
            found[(int(match.group(2)), int(match.group(1)))] = path.read_text().strip()
    last = max((attempt for attempt, _ in found), default=None)
    return {rank: line for (attempt, rank), line in sorted(found.items()) if attempt == last}


def distinct(lines) -> list[str]:
    """``lines`` without repeats, in order."""
    return list(dict.fromkeys(lines))


def only_clear_errors(exitcodes: dict[int, int], filed: dict[int, str]) -> bool:
    """True when the workers failed on clear errors alone: some rank filed one, and every failed
    rank exited with :data:`EXIT_BAD_INPUT` (having filed one, or after a peer did) or was
    stopped by the agent."""
    return bool(filed) and all(code == EXIT_BAD_INPUT or code in STOPPED_BY_AGENT for code in exitcodes.values())


class _HeldLines(logging.Filter):
    """Holds the agent's failure lines back (see :data:`AGENT_FAILURE_LINES`); :meth:`release`
    logs them as they would have been, :meth:`drop` forgets them."""

    def __init__(self):
        super().__init__()
        self.logger = logging.getLogger(AGENT_LOGGER)
        self.held: list[logging.LogRecord] = []
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and str(record.msg).startswith(AGENT_FAILURE_LINES):
            self.held.append(record)
            return False
        return True

    def drop(self) -> None:
        self.held.clear()
        self.logger.removeFilter(self)

    def release(self) -> None:
        self.logger.removeFilter(self)
        for record in self.held:
            self.logger.handle(record)
        self.held.clear()


def main(argv: list[str] | None = None) -> int:
    """torchrun with ``argv`` (its options, then the worker's command); the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    with tempfile.TemporaryDirectory(prefix="hf_scale_errors.") as folder:
        os.environ[ERROR_DIR_VAR] = folder  # the workers inherit it
        held = _HeldLines()
        try:
            torchrun_main(sys.argv[1:] if argv is None else argv)
        except ChildFailedError as e:
            filed = filed_errors(Path(folder))
            if only_clear_errors({rank: f.exitcode for rank, f in e.failures.items()}, filed):
                held.drop()
                for line in distinct(filed.values()):
                    print(line, file=sys.stderr, flush=True)
                return EXIT_BAD_INPUT
            for line in distinct(filed.values()):  # said, then the crash as torchrun reports it
                print(line, file=sys.stderr, flush=True)
            raise
        finally:
            held.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
