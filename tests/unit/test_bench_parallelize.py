"""scripts/bench_parallelize.py's check (f): hf_scale fsdp against torch's fully_shard per round
of alternating legs (issue 42: >= 1.1x tokens/s, peak RSS <= 1.0x, the same last loss, in every
round), computed from the rows the launcher returns."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_parallelize import checks, rounds


def _row(tok_s, peak=2.38, loss=13.05, load=0.0):
    return {"status": "ok", "tok_s": tok_s, "peak": peak, "train_peak": peak, "loss": loss, "other_load": load,
            "is_fsdp": True}


def test_each_round_pairs_the_ith_runs():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80)), ("hf_fsdp", _row(60)), ("torch_fsdp", _row(50))]
    (line,) = rounds(runs)
    assert line.startswith("(f) PASS")
    assert "round 1: 90.0 / 80.0 tok/s = 1.125x" in line and "round 2: 60.0 / 50.0 tok/s = 1.200x" in line


def test_one_round_below_the_target_fails_it():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80)), ("hf_fsdp", _row(84)), ("torch_fsdp", _row(80))]
    assert rounds(runs)[0].startswith("(f) FAIL")


def test_memory_and_loss_are_part_of_it():
    assert rounds([("hf_fsdp", _row(99, peak=2.39)), ("torch_fsdp", _row(80))])[0].startswith("(f) FAIL")
    assert rounds([("hf_fsdp", _row(99, loss=13.1)), ("torch_fsdp", _row(80))])[0].startswith("(f) FAIL")


def test_without_both_legs_no_line():
    assert rounds([("hf_fsdp", _row(90))]) == []
    assert rounds([("hf_fsdp", {"status": "timed out"}), ("torch_fsdp", _row(80))]) == []


def test_checks_include_the_rounds():
    runs = [("hf_fsdp", _row(90)), ("torch_fsdp", _row(80))]
    out = checks(dict(runs), runs)
    assert any(line.startswith("(f) PASS") for line in out)
    assert any(line.startswith("(a) PASS") for line in out)
