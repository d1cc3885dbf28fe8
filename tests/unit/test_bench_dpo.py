"""scripts/bench_dpo.py: hf_scale's pair rows become TRL's prompt / completion ids scoring the same
tokens, and the ratios and verdicts it prints follow from the legs' figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_dpo import leg_table, loss_lines, merge, ratio_lines, trl_rows


def _leg(tok_s: float, peak: float, loss=(0.6931, 0.6931, 0.69)) -> dict:
    return {"status": "ok", "tok_s": [tok_s * 0.9, tok_s, tok_s * 1.1], "step_s": [1.0, 1.0, 1.0],
            "peak": peak, "loss": list(loss)}


def test_trl_rows_split_prompt_and_scored_completion():
    row = {"chosen_input_ids": [1, 2, 3, 4, 5, 9], "chosen_labels": [-100, -100, -100, 4, 5, -100],
           "rejected_input_ids": [1, 2, 3, 7, 9], "rejected_labels": [-100, -100, -100, 7, -100]}
    assert trl_rows([row]) == [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [7]}]


def test_trl_rows_refuse_what_trl_cannot_hold():
    gap = {"chosen_input_ids": [1, 2, 3, 4], "chosen_labels": [-100, 2, -100, 4],
           "rejected_input_ids": [1, 5], "rejected_labels": [-100, 5]}
    with pytest.raises(ValueError, match="gap"):
        trl_rows([gap])
    other_prompt = {"chosen_input_ids": [1, 2], "chosen_labels": [-100, 2],
                    "rejected_input_ids": [8, 5], "rejected_labels": [-100, 5]}
    with pytest.raises(ValueError, match="prompts differ"):
        trl_rows([other_prompt])


def test_ratios_and_verdicts_follow_the_figures():
    legs = {"hf_scale ddp": _leg(60.0, 3.0), "TRL ddp": _leg(40.0, 4.0),
            "hf_scale fsdp": _leg(45.0, 2.5), "TRL fsdp": {"status": "not run: FSDP dropped"},
            "hf_scale LoRA": _leg(50.0, 1.6, loss=(0.6931, 0.6, 0.5))}
    lines = ratio_lines(legs)
    assert lines[0].startswith("PASS: ddp: tokens/s 1.50x TRL")
    assert lines[1].startswith("PASS: ddp: peak RSS 0.75x TRL")
    assert lines[2] == "n/a: fsdp: tokens/s and peak RSS vs TRL (TRL fsdp not run: FSDP dropped)"
    assert "hf_scale fsdp against TRL ddp: tokens/s 1.12x, peak RSS 0.62x" in lines[3]
    assert lines[4].startswith("FAIL: LoRA peak RSS 0.64x the full-parameter run's")  # target <= 0.6x
    assert len(lines) == 5  # the checkpointed pair did not run: no line for it
    legs |= {"hf_scale fsdp ac": _leg(30.0, 2.0), "hf_scale LoRA ac": _leg(35.0, 1.1)}
    assert ratio_lines(legs)[5].startswith("PASS: LoRA peak RSS 0.55x the full-parameter run's with activation "
                                           "checkpointing")
    legs["hf_scale LoRA ac"] = _leg(35.0, 1.3)
    assert ratio_lines(legs)[5].startswith("FAIL: LoRA peak RSS 0.65x")
    legs["hf_scale ddp"] = _leg(44.0, 3.8)  # 1.1x and 0.95x: both fail
    assert [ln.split(":")[0] for ln in ratio_lines(legs)[:2]] == ["FAIL", "FAIL"]
    table = leg_table(legs)
    assert table[2].startswith("| hf_scale ddp | 44.0 | 1.00 | 3.80 | 3 |")
    assert table[5].startswith("| TRL fsdp | not run: FSDP dropped |")


def test_loss_gap_compares_the_full_parameter_legs_only():
    legs = {"hf_scale ddp": _leg(1, 1, loss=(0.6931, 0.50)), "TRL ddp": _leg(1, 1, loss=(0.6931, 0.52)),
            "hf_scale LoRA": _leg(1, 1, loss=(0.6931, 0.1))}
    assert loss_lines(legs)[-1].startswith("largest loss gap between the full-parameter legs, per step: 0.0e+00, 2.0e-02")


def test_merge_pools_the_rounds_that_ran():
    a, b = _leg(10.0, 3.0), _leg(20.0, 3.5)
    merged = merge([a, {"status": "failed: timeout"}, b])
    assert merged["tok_s"] == a["tok_s"] + b["tok_s"] and merged["peak"] == 3.5 and merged["rounds"] == 2
    assert merge([{"status": "failed: timeout"}])["status"] == "failed: timeout"
