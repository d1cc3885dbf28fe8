"""``python -m hf_scale.torchrun``: workers' clear errors said once, exit 2; real crashes reported
as torchrun reports them (issue 37).

The workers here are a few lines of Python (no torch): each case costs the agent's start.
"""

from __future__ import annotations

import sys

import pytest

from tests.harness import finish_command, start_command

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


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("torchrun") / "worker.py"
    path.write_text(WORKER)
    return path


def torchrun(worker, mode: str, *options: str):
    argv = [sys.executable, "-m", "hf_scale.torchrun", "--nproc-per-node=2", "--standalone", *options, str(worker), mode]
    return finish_command(start_command(argv), timeout=120, check=False)


@pytest.mark.parametrize("mode, options, lines", [
    ("same", [], ["hf-scale finetune: error: the same on every rank"]),
    ("differ", [], ["hf-scale finetune: error: rank 0 says its own", "hf-scale finetune: error: rank 1 says its own"]),
    ("same", ["--max-restarts=1"], ["hf-scale finetune: error: the same on every rank"]),  # said once, not per attempt
])
def test_clear_errors_are_said_once_with_status_2(worker, mode, options, lines):
    result = torchrun(worker, mode, *options)
    assert result.returncode == 2, result.stdout
    assert [line for line in result.stdout.splitlines() if line.strip()] == lines, result.stdout


@pytest.mark.parametrize("mode, words", [
    ("crash", ["RuntimeError: a real bug", "Traceback", "ChildFailedError", "exitcode  : 1"]),
    ("segfault", ["ChildFailedError", "SIGSEGV"]),
    ("clear and crash", ["hf-scale finetune: error: rank 0 was given bad input", "RuntimeError: an unrelated bug",
                         "ChildFailedError", "exitcode  : 1"]),
])
def test_a_real_crash_keeps_torchruns_report_and_status(worker, mode, words):
    result = torchrun(worker, mode)
    assert result.returncode == 1, result.stdout
    assert all(w in result.stdout for w in words), result.stdout
    assert result.stdout.count("hf-scale finetune: error:") <= 1, result.stdout
    assert "failed (exitcode" in result.stdout  # the agent's line, held back and then let through
