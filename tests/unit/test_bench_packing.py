"""scripts/bench_packing.py: the generated data spreads in length as the benchmark says, and the
ratios, loss-curve gaps and verdicts it prints follow from the figures."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_common import TreeRun, cpu_at, wait_for_quiet
from bench_packing import (
    FREE,
    FREE_DDP,
    PACKED,
    PADDED,
    TRL,
    curve_gaps,
    documents,
    make_examples,
    mean_last,
    merge,
    multistep_example,
    spread,
    step_gap,
    table,
    verdicts,
    write_jsonl,
)


def test_examples_work_every_step_out():
    example = multistep_example(random.Random(1), 3)
    assert example["prompt"] == "Start with 27, then add 42, then add 73, then subtract 70."
    assert example["response"] == ("27 + 42 = 69. 27 + 42 + 73 = 69 + 73 = 142. "
                                   "27 + 42 + 73 - 70 = 142 - 70 = 72. Answer: 72")
    assert make_examples(50, seed=3) == make_examples(50, seed=3) != make_examples(50, seed=4)


def test_lengths_spread_about_tenfold(tmp_path):
    """In characters (the tokens follow: SmolLM2 spends a token per digit; the run prints the
    token spread): 1 to 10 steps, the longest ~10x the shortest; all step counts present."""
    rows = make_examples(2000, seed=0)
    counts = {r["prompt"].count(", then") for r in rows}
    assert counts == set(range(1, 11))
    s = spread([len(r["prompt"]) + len(r["response"]) for r in rows])
    assert 6 <= s["ratio"] <= 14, s
    assert s["min"] < s["median"] < s["max"]
    size = write_jsonl(tmp_path / "d.jsonl", rows[:10])
    assert size == (tmp_path / "d.jsonl").stat().st_size and len((tmp_path / "d.jsonl").read_text().splitlines()) == 10
    assert spread([47, 100, 483]) == {"min": 47, "median": 100, "mean": 210, "max": 483, "ratio": 483 / 47}


def test_documents_of_a_row():
    assert documents({"input_ids": [1, 2, 3]}) == 1
    assert documents({"input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 0, 1, 2]}) == 2


def _leg(tok_s, loss, tokens=1000, cpu=10.0, **extra):
    return {"status": "ok", "tok_s": tok_s, "step_s": [1.0] * len(tok_s), "share": [1.0] * len(tok_s), "examples": [8],
            "tokens": tokens, "cpu": cpu, "peak": 2**30, "loss": loss, "others": [0.25], **extra}


def test_loss_gaps():
    assert mean_last([4.0, 2.0, 1.0, 3.0], 2) == 2.0
    assert mean_last([1.0], 3) == 1.0
    legs = {PADDED: _leg([1], [3.0, 1.0, 1.0]), PACKED: _leg([1], [3.0, 1.1, 1.1]),
            TRL: {"status": "failed: x"}}
    assert curve_gaps(legs, PADDED, 2) == {PACKED: pytest.approx(0.1)}
    assert step_gap([1.0, 2.0], [1.0, 2.002]) == pytest.approx(0.002 / 2.002)
    assert step_gap([1.0], [1.0, 2.0]) == float("inf")


def test_verdicts():
    same = [2.0, 1.5, 1.0, 0.9]
    legs = {PADDED: _leg([100, 110, 90], [2.1, 1.4, 1.05, 0.95], tokens=1000, cpu=10.0),
            PACKED: _leg([160, 150, 170], same, tokens=1600, cpu=10.0),
            FREE: _leg([140, 150, 145], [2.0, 1.5, 1.0, 0.9005], tokens=1500, cpu=10.0),
            TRL: _leg([100, 130, 100], same, tokens=1000, cpu=10.0, same_batches=True)}
    lines = verdicts(legs, 2)
    assert lines[0] == "PASS: packed real tokens/s >= 1.5x padded (160.0 vs 100.0 = 1.60x; per CPU-second 1.60x)"
    assert lines[1].startswith("FAIL: packed + padding_free real tokens/s >= 1.5x padded (145.0 vs 100.0 = 1.45x")
    assert lines[2] == ("PASS: hf_scale packed (rows) real tokens/s >= 1.2x TRL SFTTrainer packing + padding_free "
                        "(160.0 vs 100.0 = 1.60x; per CPU-second 1.60x)")
    assert lines[3].startswith("PASS: hf_scale packed + padding_free (TRL's settings) real tokens/s >= 1.2x TRL")
    assert "145.0 vs 100.0 = 1.45x; per CPU-second 1.50x" in lines[3]
    assert lines[4].startswith("PASS: every leg's mean loss over the last 2 steps within 10% of padded's")
    assert lines[5].startswith("PASS: the same batches give the same loss at every step within 0.001")
    assert "TRL packing + padding_free vs packed 0.0e+00" in lines[5]
    legs[FREE_DDP] = _leg([110, 120, 115], same, tokens=1500, cpu=10.0)  # TRL's layout too: a line of its own
    lines = verdicts(legs, 2)
    assert lines[4] == ("FAIL: hf_scale packed + padding_free under ddp (TRL's settings and layout) real tokens/s "
                        ">= 1.2x TRL SFTTrainer packing + padding_free (115.0 vs 100.0 = 1.15x; per CPU-second 1.50x)")
    assert "packed + padding_free (ddp) vs packed 0.0e+00" in lines[6]
    del legs[FREE_DDP]
    legs[TRL] = {**legs[TRL], "same_batches": False, "loss": [9.0] * 4}  # other batches: not compared step by step
    lines = verdicts(legs, 2)
    assert "TRL" not in lines[5] and lines[4].startswith("FAIL") and TRL in lines[4]
    assert verdicts({PADDED: legs[PADDED]}, 2) == [
        "n/a: packed vs padded (packed not run, padded ok)",
        "n/a: packed + padding_free vs padded (packed + padding_free not run, padded ok)",
        "n/a: hf_scale packed (rows) vs TRL (packed not run, TRL packing + padding_free not run)",
        "n/a: hf_scale packed + padding_free (TRL's settings) vs TRL (packed + padding_free not run, "
        "TRL packing + padding_free not run)"]


def test_merge_pools_rounds():
    a, b = _leg([1, 2], [3.0, 2.0], tokens=10, cpu=2.0), _leg([3], [3.0, 2.0], tokens=20, cpu=3.0)
    merged = merge([a, {"status": "failed: y"}, b])
    assert merged["tok_s"] == [1, 2, 3] and merged["tokens"] == 30 and merged["cpu"] == 5.0
    assert merged["rounds"] == 2 and merged["same_loss_every_round"]
    assert merge([{"status": "failed: y"}])["status"] == "failed: y"


def test_cpu_between_samples():
    """The tree's CPU seconds and the machine's, between sample times; what others kept busy."""
    samples = [(10.0, 1.0, 0, 100.0), (12.0, 3.0, 0, 103.0), (14.0, 4.0, 0, 106.0)]
    assert cpu_at(samples, 11.0) == 2.0 and cpu_at(samples, 13.0) == 3.5
    assert cpu_at(samples, 5.0) == 1.0 and cpu_at(samples, 20.0) == 4.0 and cpu_at([], 1.0) == 0.0
    run = TreeRun()
    run.samples = samples
    assert run.cpu_between(10.0, 14.0) == 3.0
    assert run.others_between(10.0, 14.0) == pytest.approx((6.0 - 3.0) / 4.0)
    busy, waited = wait_for_quiet(0, cores=1e9, window=0.05)  # quiet at once
    assert 0 <= busy <= (os.cpu_count() or 1) and waited < 5


def test_table_puts_the_ratios_first():
    legs = {PADDED: _leg([100, 100], [1.0], tokens=500, cpu=10.0, share=[0.5, 0.5]),
            PACKED: _leg([150, 150], [1.0], tokens=750, cpu=10.0, share=[1.0, 1.0]),
            TRL: {"status": "failed: OSError: x"}}
    lines = table(legs, 1).splitlines()
    assert lines[0].startswith("| leg | real tok/s vs padded | real tok/s vs TRL | real tokens/s |")
    assert lines[2].startswith("| padded | 1.00 | n/a | 100.0 | 50.0 | 200.0 |")
    assert "| 1.00 | 0.25 | 1.0000 |" in lines[2]  # peak RSS, others' cores, final loss  # positions/s: 100 / 0.5
    assert lines[3].startswith("| packed | 1.50 | n/a | 150.0 | 75.0 | 150.0 |")
    assert lines[4].startswith("| TRL packing + padding_free | failed: OSError: x |")


def test_leg_names_survive_the_legs_option():
    """``--legs`` is comma-separated: no leg name may hold a comma."""
    from bench_packing import DEFAULT_LEGS, LEGS

    assert set(DEFAULT_LEGS) <= set(LEGS) and all("," not in name for name in LEGS)
