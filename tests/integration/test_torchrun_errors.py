"""``python -m hf_scale.torchrun``: workers' clear errors said once, exit 2; real crashes reported
as torchrun reports them (issue 37).

The workers here are a few lines of Python (no torch): each case costs the agent's start, so
the module starts every case's agent up front, two at a time, and each test checks its own.
"""

from __future__ import annotations

import sys

import pytest

from tests.harness import run_commands

WORKER = r'''
import os, signal, sys, time
from pathlib import Path
from hf_scale.torchrun import ERROR_DIR_VAR, file_error

rank, mode = int(os.environ["RANK"]), sys.argv[1]
folder = Path(os.environ[ERROR_DIR_VAR])

def wait_for(count):  # until `count` ranks have filed a line
    while len([p for p in folder.iterdir() if p.name.startswith("rank")]) < count:
        time.sleep(0.05)

if mode == "same":
    file_error("hf-scale finetune: error: the same on every rank")
    wait_for(2)
    sys.exit(2)
if mode == "differ":
    file_error(f"hf-scale finetune: error: rank {rank} says its own")
    wait_for(2)
    sys.exit(2)
if mode == "crash" and rank == 1:
    raise RuntimeError("a real bug")
if mode == "segfault" and rank == 0:
    os.kill(os.getpid(), signal.SIGSEGV)
if mode == "clear and crash":
    if rank == 0:
        file_error("hf-scale finetune: error: rank 0 was given bad input")
        time.sleep(60)
    wait_for(1)
    raise RuntimeError("an unrelated bug")
time.sleep(60)  # stopped by the agent once another rank failed
'''


CLEAR = [
    ("same", [], ["hf-scale finetune: error: the same on every rank"]),
    ("differ", [], ["hf-scale finetune: error: rank 0 says its own", "hf-scale finetune: error: rank 1 says its own"]),
    ("same", ["--max-restarts=1"], ["hf-scale finetune: error: the same on every rank"]),  # said once, not per attempt
]
CRASHES = [
    ("crash", ["RuntimeError: a real bug", "Traceback", "ChildFailedError", "exitcode  : 1"]),
    ("segfault", ["ChildFailedError", "SIGSEGV"]),
    ("clear and crash", ["hf-scale finetune: error: rank 0 was given bad input", "RuntimeError: an unrelated bug",
                         "ChildFailedError", "exitcode  : 1"]),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[tuple[str, ...], object]:
    """(mode, *options) -> the torchrun of that case, run to its end: every case, two at a time."""
    worker = tmp_path_factory.mktemp("torchrun") / "worker.py"
    worker.write_text(WORKER)
    runs = [(mode, *options) for mode, options, _ in CLEAR] + [(mode,) for mode, _ in CRASHES]
    argvs = [[sys.executable, "-m", "hf_scale.torchrun", "--nproc-per-node=2", "--standalone", *options, str(worker), mode]
             for mode, *options in runs]
    return dict(zip(runs, run_commands(argvs, timeout=120)))


@pytest.mark.parametrize("mode, options, lines", CLEAR)
def test_clear_errors_are_said_once_with_status_2(results, mode, options, lines):
    result = results[(mode, *options)]
    assert result.returncode == 2, result.stdout
    assert [line for line in result.stdout.splitlines() if line.strip()] == lines, result.stdout


@pytest.mark.parametrize("mode, words", CRASHES)
def test_a_real_crash_keeps_torchruns_report_and_status(results, mode, words):
    result = results[(mode,)]
    assert result.returncode == 1, result.stdout
    assert all(w in result.stdout for w in words), result.stdout
    assert result.stdout.count("hf-scale finetune: error:") <= 1, result.stdout
    assert "failed (exitcode" in result.stdout  # the agent's line, held back and then let through
