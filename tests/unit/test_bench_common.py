"""scripts/bench_common.py: a leg that hangs is killed with its children; one reason per failed leg."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import failure_reason, launch_ranks, markdown_table, run_logged


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_timeout_kills_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    start = time.monotonic()
    reason = run_logged(["bash", "-c", script], tmp_path / "leg.log", timeout=2)
    assert time.monotonic() - start < 30
    assert reason == "failed: exit code timeout after 2s"
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered at once; give the kernel a moment to reap
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "a child of the timed-out leg is still running"


def test_launch_ranks_collects_results_or_one_reason(tmp_path):
    def leg(name: str, body: str):
        code = (f"import json, pathlib\nfor r in range(2):\n    p = pathlib.Path({str(tmp_path)!r}) "
                f"/ f'{name}.rank{{r}}.json'\n{body}")
        return launch_ranks([sys.executable, "-c", code], tmp_path, name, world=2, timeout=60)

    results, error = leg("ok", "    p.write_text(json.dumps({'status': 'ok', 'r': r}))")
    assert error is None and [r["r"] for r in results] == [0, 1]
    _, error = leg("na", "    p.write_text(json.dumps({'status': 'n/a (option missing: x)'}))")
    assert error == "n/a (option missing: x)"
    _, error = leg("half", "    p.write_text(json.dumps({'status': 'ok'})) if r == 0 else None")
    assert error == "failed: 1 rank(s) wrote no result"
    _, error = leg("ok", "    pass")  # launched again (a later round): the first launch's results are not read
    assert error == "failed: 2 rank(s) wrote no result"
    _, error = leg("crash", "    raise ValueError('lr must be > 0, got -1')")
    assert error == "failed: ValueError: lr must be > 0, got -1"


def test_failure_reason_and_table():
    log = "noise\n[rank1]: RuntimeError: first\n[rank0]: torch.OutOfMemoryError: last one\n"
    assert failure_reason(log, 1) == "failed: OutOfMemoryError: last one"
    assert failure_reason("killed\n", -9) == "failed: exit code -9"
    assert failure_reason("ValueError: " + "x" * 300, 1).endswith("x...")
    assert json.dumps(markdown_table(["a", "b", "c"], [["1", "2", "3"], ["failed", "why"]])) == (
        json.dumps("| a | b | c |\n|---|---|---|\n| 1 | 2 | 3 |\n| failed | why |  |"))
