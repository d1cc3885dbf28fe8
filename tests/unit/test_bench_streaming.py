"""scripts/bench_streaming.py: its target line (streaming peak RSS within 5% between the small and
the 10x file) and the in-memory line beside it follow from the figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_streaming import merge, relative_change, verdict_lines


def test_streaming_verdicts():
    rows = {"N": 100, "10N": 1000}
    peaks = {("streaming", "N"): 1000, ("streaming", "10N"): 1040, ("in memory", "N"): 1000,
             ("in memory", "10N"): 1500}
    assert relative_change(1000, 1040) == pytest.approx(0.04)
    lines = verdict_lines(peaks, rows)
    assert lines[0].startswith("PASS: streaming peak RSS on the 10x file within 5% of the small file's")
    assert "on 1,000 rows vs" in lines[0] and "+4.0%" in lines[0]
    assert lines[1].startswith("beside it, in memory (data.streaming: false):") and "+50.0%" in lines[1]
    assert verdict_lines({**peaks, ("streaming", "10N"): 1060}, rows)[0].startswith("FAIL")
    assert verdict_lines({**peaks, ("streaming", "10N"): 940}, rows)[0].startswith("FAIL")  # smaller counts too
    del peaks[("in memory", "10N")]
    assert verdict_lines(peaks, rows)[1] == "n/a: in memory: a leg did not finish"


def test_merge_keeps_the_largest_peak():
    rounds = [{"status": "ok", "peak": 10, "tree": 12, "wall": 5.0, "steps": 3, "cmd": "a"},
              {"status": "failed: z"},
              {"status": "ok", "peak": 11, "tree": 11, "wall": 7.0, "steps": 3, "cmd": "a"}]
    merged = merge(rounds)
    assert (merged["peak"], merged["peaks"], merged["tree"], merged["wall"]) == (11, [10, 11], 12, 6.0)
    assert merge([{"status": "failed: z"}])["status"] == "failed: z"
