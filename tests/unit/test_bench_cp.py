"""scripts/bench_cp.py: the anchor verdicts (hf_scale's exchanges against DeepSpeed-Ulysses, issue
39's >= 1.1x) follow from the legs' tokens/s, and the anchor is refused where it cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
from bench_cp import ANCHOR, anchor_verdicts  # noqa: E402


def test_anchor_verdicts_from_round_means():
    speed = {(4096, 2, "alltoall"): [120.0, 100.0], (4096, 2, ANCHOR): [100.0, 100.0],
             (4096, 2, "allgather"): [100.0, 110.0], (4096, 1, "-"): [90.0, 90.0],
             (8192, 4, "alltoall"): [50.0]}  # no anchor at 8192: no verdict
    lines = [line for line in anchor_verdicts(speed).splitlines() if line.startswith(("PASS", "FAIL"))]
    assert lines == [
        "PASS: cp=2, 4096 tokens: hf_scale alltoall tokens/s 1.10x DeepSpeed-Ulysses (110 vs 100; "
        "rounds 1.20x, 1.00x; need >= 1.1x)",
        "FAIL: cp=2, 4096 tokens: hf_scale allgather tokens/s 1.05x DeepSpeed-Ulysses (105 vs 100; "
        "rounds 1.00x, 1.10x; need >= 1.1x)",
    ]
    assert anchor_verdicts({(4096, 2, "alltoall"): [1.0]}) == ""


def test_longest_refuses_the_anchor():
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_cp.py"), "--longest", "100", "--exchange",
                           f"alltoall,{ANCHOR}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"leave {ANCHOR} out of --exchange" in done.stderr
