"""Time `.ci/run` as CI runs it, on a fresh clone of the committed HEAD, and write the ``ci``
section of docs/tests.md: how long `.ci/run` and `make test` took, the test counts, the slowest
15 tests, and the targets (`make test` <= 25 min, `.ci/run` <= 50 min on this 2-core machine).
The README's "At a glance" table takes its verdicts from there (``scripts/write_doc.py``).

    python scripts/time_ci.py --write docs/tests.md        # about 45 minutes
    python scripts/time_ci.py --clone /tmp/ci --keep       # keep the clone (its .venv) afterwards

The clone builds its own `.venv` (`make` installs it), as CI's does; a calibration cached in
``~/.cache/hf_scale`` is used as CI would use it. The section's first line names the commit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, add_write_arg, check_doc, write_doc

TEST_LIMIT_MIN, CI_LIMIT_MIN = 25, 50
MARK = ".time_ci_clone"  # in a clone this script made (the only folder --clone may replace)
_PYTEST_LAST = re.compile(r"^=*\s*(?P<counts>\d+ (?:passed|failed).*?) in (?P<seconds>[\d.]+)s\b", re.MULTILINE)


def pytest_summary(log: str) -> tuple[str, float] | None:
    """``(counts, seconds)`` from pytest's last line ('976 passed, 2 skipped in 1519.12s')."""
    found = list(_PYTEST_LAST.finditer(log))
    return (found[0]["counts"], float(found[0]["seconds"])) if found else None


def slowest(log: str, count: int = 15) -> list[str]:
    """The ``--durations`` block's lines ('12.34s call tests/...::test_x')."""
    found = re.search(r"^=+ slowest \d+ durations =+$", log, re.MULTILINE)
    block = log[found.end():] if found else ""
    return [line.strip() for line in block.splitlines() if re.match(r"^\s*[\d.]+s (call|setup|teardown)", line)][:count]


def report(commit: str, ci_seconds: float, exit_code: int, log: str) -> str:
    tests = pytest_summary(log)
    lines = [(f"`.ci/run` on a fresh clone of {commit}: exit {exit_code}, {ci_seconds / 60:.1f} min "
              "(make test, then make demo, then make wheel-check; the clone installs its own .venv).")]
    verdict = lambda ok: "PASS" if ok else "FAIL"
    if tests:
        counts, seconds = tests
        lines.append(f"make test: {counts} in {seconds / 60:.1f} min.")
    lines += ["", "```"]
    if tests:
        lines.append(f"{verdict(tests[1] <= TEST_LIMIT_MIN * 60)}: make test {tests[1] / 60:.1f} min "
                     f"(need <= {TEST_LIMIT_MIN} min)")
    lines.append(f"{verdict(exit_code == 0 and ci_seconds <= CI_LIMIT_MIN * 60)}: .ci/run {ci_seconds / 60:.1f} min, "
                 f"exit {exit_code} (need exit 0 in <= {CI_LIMIT_MIN} min)")
    lines += ["```", "", "The slowest 15 tests (pytest --durations):", "", "```", *slowest(log), "```"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clone", help="where to clone (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the clone afterwards")
    parser.add_argument("--log", help="also save .ci/run's output here")
    add_write_arg(parser, "ci")
    args = parser.parse_args()
    check_doc(args)
    clone = Path(args.clone or tempfile.mkdtemp(prefix="hf_scale_ci_"))
    if clone.exists() and any(clone.iterdir()):
        if not (clone / MARK).exists():
            sys.exit(f"{clone} exists and is not a clone this script made: give a new folder to --clone")
        shutil.rmtree(clone)
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    (clone / MARK).touch()  # .ci/run never reads it; untracked in the clone
    commit = subprocess.run(["git", "-C", str(clone), "log", "-1", "--format=%h"], capture_output=True,
                            text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    start = time.monotonic()
    proc = subprocess.Popen(["bash", ".ci/run"], cwd=clone, env={**env, "CI": "true"}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    for line in proc.stdout:
        sys.stdout.write(line)
        log.append(line)
    exit_code = proc.wait()
    seconds = time.monotonic() - start
    if args.log:
        Path(args.log).write_text("".join(log))
    body = report(commit, seconds, exit_code, "".join(log))
    print(body)
    write_doc(args, body)
    if not args.keep:
        shutil.rmtree(clone, ignore_errors=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
