"""The Makefile's recipes stop at the first failing command, also inside a pipe."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

MAKEFILE = Path(__file__).parents[2] / "Makefile"


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("git")), reason="needs make and git")
def test_wheel_check_stops_when_the_copy_of_the_tree_fails(tmp_path):
    """A tracked file deleted from the working tree: ``tar -cf`` cannot read it and fails, but
    still archives the rest, so the second tar succeeds. Without pipefail the recipe went on to
    build a wheel from the incomplete copy (here: the stand-in python3 would record its call)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("kept.py", "gone.py"):
        (repo / name).write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    (repo / "gone.py").unlink()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "python3-ran"
    (bin_dir / "python3").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(["make", "-f", str(MAKEFILE), "wheel-check", f"WHEEL_TMP={tmp_path / 'wc'}"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "gone.py" in out.stderr  # tar's "Cannot stat" for the missing file
    assert not marker.exists(), "make went on past the failed tar"
    assert (tmp_path / "wc" / "src" / "kept.py").exists()  # the copy itself ran
